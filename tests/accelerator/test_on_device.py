"""fully_shard and checkpoints on the accelerator itself: streams, casts on the all-gather
stream, inductor, a post-optimizer event, HSDP on a (1, 1) mesh, CPU offload, activation
checkpointing, GPU-resident checkpoints (a small staging budget, checked and unchecked loads
with 1 and 2 reader threads into strided device tensors, slabs unpinned by ``release()``).

The rest of the suite runs gloo ranks on CPU, where streams are no-ops. This module runs one
rank on ``HP_TEST_DEVICE`` (default: ``cuda`` when a GPU is present, else ``cpu``), so on a
GPU machine it checks the CUDA paths (NCCL needs one GPU per rank: world size 1), and in CI
the same code runs on CPU, which keeps it working between GPU sessions.
"""

from __future__ import annotations

import copy
import os
from typing import Dict, List

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.trainer.setup.parallelize import apply_activation_checkpointing
from tests.fully_shard._helpers import CountingBackend, full_params, global_batch, max_diff, tiny_llama, train
from tests.fully_shard._helpers import float64_lm_loss, sgd
from tests.checkpoint.helpers import app_state, local_tensor_clones
from tests.multirank import run_on_ranks

DEVICE = os.environ.get("HP_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="HP_TEST_DEVICE=cuda without a CUDA GPU")
TOL = 1e-10  # float64: only summation order differs
T = 600


def _on_ranks(fn, *args):
    return run_on_ranks(1, fn, *args, timeout=T, device=DEVICE)[0]


def _mesh():
    return init_device_mesh(DEVICE, (1,))


def _batches(steps: int) -> List[torch.Tensor]:
    return [global_batch(s).to(DEVICE) for s in range(steps)]


def _shard_blocks_and_root(model: nn.Module, shard) -> nn.Module:
    for block in model.layers.values():
        shard(block)
    shard(model)
    return model


def _sleep_on_device() -> None:
    """Keep the device busy for a while (~25 ms), so the host runs ahead of it."""
    if DEVICE == "cuda":
        torch.cuda._sleep(50_000_000)


# -- fully_shard ------------------------------------------------------------------------------
def _float64_parity():
    """Eager float64 training (AdamW) on the device vs the same model unwrapped."""
    torch.manual_seed(0)
    reference = tiny_llama().to(DEVICE)
    model = _shard_blocks_and_root(copy.deepcopy(reference), lambda m: hp.fully_shard(m, mesh=_mesh()))
    batches = _batches(3)
    train(reference, batches)
    train(model, batches)
    assert all(p.device.type == DEVICE for p in model.parameters())
    return max_diff(full_params(model), full_params(reference))


def test_float64_training_matches_the_unwrapped_model():
    assert _on_ranks(_float64_parity) <= TOL


def _bf16_vs_torch():
    """bf16 parameters, fp32 reduction: the copy-in cast runs on the all-gather stream and the
    copy-out on the compute stream. Same steps with torch's FSDP2 and the same policy."""
    seen: List[torch.dtype] = []
    results = {}
    for impl in ("hp", "torch"):
        torch.manual_seed(0)
        model = tiny_llama(torch.float32).to(DEVICE)
        if impl == "hp":
            policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            _shard_blocks_and_root(model, lambda m: hp.fully_shard(m, mesh=_mesh(), mp_policy=policy))
            block = model.layers["0"]
            block.register_forward_pre_hook(lambda mod, args: seen.append(next(mod.parameters()).dtype))
        else:
            policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            _shard_blocks_and_root(model, lambda m: torch_fully_shard(m, mesh=_mesh(), mp_policy=policy))
        losses = train(model, _batches(3), loss_fn=float64_lm_loss, make_optimizer=sgd)
        results[impl] = (losses, full_params(model))
    assert seen and set(seen) == {torch.bfloat16}, seen  # the block computed with bf16 parameters
    (hp_losses, hp_params), (torch_losses, torch_params) = results["hp"], results["torch"]
    return max(abs(a - b) for a, b in zip(hp_losses, torch_losses)), max_diff(hp_params, torch_params)


def test_bf16_mixed_precision_matches_torch_fsdp2():
    loss_diff, param_diff = _on_ranks(_bf16_vs_torch)
    assert loss_diff <= 1e-3 and param_diff <= 1e-3, (loss_diff, param_diff)


def _compiled_meta_init(fullgraph: bool):
    """The torchtitan flow: build on meta, compile every block (inductor on CUDA), shard,
    materialise on the device, init; vs the same model eager (both float64, SGD)."""
    backend = CountingBackend("inductor" if DEVICE == "cuda" else "aot_eager")
    params = {}
    for compiled in (False, True):
        with torch.device("meta"):
            model = tiny_llama()
        for block in model.layers.values():
            if compiled:
                block.compile(backend=backend, fullgraph=fullgraph)
            hp.fully_shard(block, mesh=_mesh())
        hp.fully_shard(model, mesh=_mesh())
        model.to_empty(device=DEVICE)
        model.init_weights(0)
        train(model, _batches(2), loss_fn=float64_lm_loss, make_optimizer=sgd)
        params[compiled] = {k.replace("_orig_mod.", ""): v for k, v in full_params(model).items()}
    torch._dynamo.reset()
    assert backend.calls >= 2 * 2, backend.calls  # compiled forwards ran: 2 blocks, 2 steps
    return max_diff(params[True], params[False])


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_blocks_from_a_meta_build_match_eager(fullgraph):
    assert _on_ranks(_compiled_meta_init, fullgraph) <= TOL


def _post_optim_event_parity():
    """torch's test_post_optim_event on the device: the event recorded after each optimizer
    step orders the next step's all-gathers while the host runs ahead of a busy device."""
    torch.manual_seed(0)
    reference = tiny_llama().to(DEVICE)
    model = _shard_blocks_and_root(copy.deepcopy(reference), lambda m: hp.fully_shard(m, mesh=_mesh()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    module = torch.get_device_module(DEVICE)
    optim.register_step_post_hook(lambda *_: model.set_post_optim_event(module.current_stream().record_event()))
    batches = _batches(4)
    for batch in batches:
        float64_lm_loss(model, batch).backward()
        optim.step()
        optim.zero_grad()
        _sleep_on_device()
    train(reference, batches, loss_fn=float64_lm_loss, lr=1e-2, make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    return max_diff(full_params(model), full_params(reference))


def test_post_optim_event_training_matches_the_unwrapped_model():
    assert _on_ranks(_post_optim_event_parity) <= TOL


def _variant_parity(variant: str):
    """Float64 training on the device against the unwrapped model: HSDP on a (1, 1) mesh (one
    GPU runs a real NCCL reduce-scatter and all-reduce), CPU offload (gradients copied on the
    reduce-scatter stream into pinned memory, waited for at the end of backward), activation
    checkpointing (recomputed forwards inside backward)."""
    torch.manual_seed(0)
    reference = tiny_llama().to(DEVICE)
    model = copy.deepcopy(reference)
    if variant == "hsdp_1x1":
        mesh = init_device_mesh(DEVICE, (1, 1), mesh_dim_names=("replicate", "shard"))
        _shard_blocks_and_root(model, lambda m: hp.fully_shard(m, mesh=mesh))
    elif variant == "cpu_offload":
        policy = hp.CPUOffloadPolicy(pin_memory=True)
        _shard_blocks_and_root(model, lambda m: hp.fully_shard(m, mesh=_mesh(), offload_policy=policy))
    else:
        apply_activation_checkpointing(model)
        _shard_blocks_and_root(model, lambda m: hp.fully_shard(m, mesh=_mesh()))
    batches = _batches(3)
    train(reference, batches)
    train(model, [b.to(DEVICE) for b in batches])
    return max_diff(full_params(model), full_params(reference))


@pytest.mark.parametrize("variant", ["hsdp_1x1", "cpu_offload", "activation_checkpointing"])
def test_variants_match_the_unwrapped_model(variant):
    assert _on_ranks(_variant_parity, variant) <= TOL


# -- checkpoints of device-resident state ------------------------------------------------------
def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = _shard_blocks_and_root(tiny_llama().to(DEVICE), lambda m: hp.fully_shard(m, mesh=_mesh()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, seed)
    return model, optim


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    float64_lm_loss(model, global_batch(seed).to(DEVICE)).backward()
    optim.step()
    optim.zero_grad()


def _assert_same_on_device(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].device == value.device, key
        assert torch.equal(actual[key], value), key


def _round_trip(path: str, background: bool):
    """Save model + AdamW state from device memory (sync, or async with staging in the
    background and an optimizer step at once), load into another model: every tensor equal
    to the state at the save call, still on the device."""
    model, optim = _model_and_optimizer(0)
    state = app_state(model, optim)
    expected = local_tensor_clones(state)
    assert any(t.device.type == DEVICE for t in expected.values())
    if background:
        _sleep_on_device()  # the staging copies queue behind it
        future = hdcp.async_save(state, checkpoint_id=path, stage_in_background=True)
        train_step(model, optim, 1)  # waits for staging (optimizer hook): must not leak in
        future.result(timeout=T)
    else:
        hdcp.save(state, checkpoint_id=path)
    fresh_model, fresh_optim = _model_and_optimizer(7)
    fresh = app_state(fresh_model, fresh_optim)
    hdcp.load(fresh, checkpoint_id=path)
    _assert_same_on_device(local_tensor_clones(fresh), expected)
    return True


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save-in-background"])
def test_device_state_round_trips_exactly(tmp_path, background):
    assert _on_ranks(_round_trip, str(tmp_path / "ckpt"), background)


def _small_budget_save_and_strided_loads(path: str, verify: bool, threads: int):
    """An async save from device memory through a staging budget of a few slabs, then a load
    (checked or not, 1 or 2 reader threads) into device tensors that are strided views: the
    bounce slabs and the copy stream, ordered after the caller's stream."""
    pool = hdcp.staging_buffers()
    sizes = dict(slab_bytes=pool.slab_bytes, budget_bytes=pool.budget_bytes, sync_window_bytes=pool.sync_window_bytes)
    pool.configure(slab_bytes=16 << 10, budget_bytes=64 << 10, sync_window_bytes=32 << 10)
    try:
        g = torch.Generator().manual_seed(0)
        state = {"a": torch.randn(160, 96, generator=g, dtype=torch.float64).to(DEVICE),
                 "b": torch.arange(5000, dtype=torch.int64).to(DEVICE)}
        _sleep_on_device()  # the staging copies queue behind it
        hdcp.async_save(state, checkpoint_id=path, no_dist=True).result(timeout=T)
        target = {"a": torch.zeros(96, 160, dtype=torch.float64, device=DEVICE).t(),
                  "b": torch.zeros(5000, 2, dtype=torch.int64, device=DEVICE)[:, 1]}
        _sleep_on_device()  # the load's copies must wait for the caller's queued work
        hdcp.load(target, storage_reader=hdcp.FileSystemReader(path, verify=verify, thread_count=threads),
                  no_dist=True)
        return all(torch.equal(target[k], state[k]) for k in state) and pool.in_use == 0
    finally:
        pool.configure(**sizes)
        pool.release()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_small_budget_save_and_strided_device_loads(tmp_path, verify, threads):
    assert _on_ranks(_small_budget_save_and_strided_loads, str(tmp_path / "ckpt"), verify, threads)


def _pinned_release(path: str):
    """Slabs pinned for a save are unregistered by release() (CUDA: cudaHostUnregister
    succeeds for every cudaHostRegister; CPU: nothing is pinned)."""
    import gc
    from unittest import mock

    from hyper_parallel.platform import Platform

    calls = {"register": 0, "unregister": 0}
    register, unregister = Platform.host_register, Platform.host_unregister

    def counted(name, real):
        def call(self, *args):
            real(self, *args)
            calls[name] += 1
        return call

    pool = hdcp.staging_buffers()
    pool.release()
    with mock.patch.object(Platform, "host_register", counted("register", register)), \
            mock.patch.object(Platform, "host_unregister", counted("unregister", unregister)):
        state = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to(DEVICE)}
        hdcp.async_save(state, checkpoint_id=path, no_dist=True).result(timeout=T)
        held = calls["register"] - calls["unregister"]
        pool.release()
        gc.collect()
    return held, calls


def test_released_staging_slabs_are_unpinned(tmp_path):
    held, calls = _on_ranks(_pinned_release, str(tmp_path / "ckpt"))
    assert calls["register"] == calls["unregister"], calls
    if DEVICE == "cuda":
        assert held > 0, calls  # the save's slabs were pinned until release()
