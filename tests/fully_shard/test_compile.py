"""fully_shard with torch.compile on CPU (``backend="aot_eager"``; inductor once, where a C++
compiler is installed), meta-device init.

Every compiled run is compared in float64 (SGD, so gradient differences map linearly to the
parameters) with eager fully_shard, with torch's own FSDP2 ``fully_shard`` compiled the same
way, and with single-process training on the global batch.
"""

from __future__ import annotations

import shutil
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import hyper_parallel as hp
from hyper_parallel.trainer.setup.parallelize import apply_activation_checkpointing
from tests.fully_shard._helpers import (CountingBackend, float64_lm_loss, full_params, global_batch, max_diff, sgd,
                                        tiny_llama, train)
from tests.multirank import run_on_ranks

TOL = 1e-10  # float64 everywhere: only summation order differs
MP_TOL = 1e-5  # fp32 compute (mixed precision), compiled vs eager on the same inputs


# One backend for the whole file: dynamo's cache is per backend, so runs after the first reuse
# the compiled block instead of compiling it again (compiling dominates this file's time).
_BACKEND = None


def _backend() -> CountingBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = CountingBackend("aot_eager")
    return _BACKEND


def _compile_blocks(model: nn.Module, order: str, shard: Callable, backend) -> nn.Module:
    """Compile and shard ``model`` in one of the supported orders; returns what to train."""
    if order == "eager":
        for block in model.layers.values():
            shard(block)
    elif order == "block.compile, then shard (torchtitan)":
        for block in model.layers.values():
            block.compile(backend=backend, fullgraph=True)
            shard(block)
    elif order == "torch.compile fullgraph, then shard":
        for name, block in model.layers.items():
            model.layers[name] = torch.compile(block, backend=backend, fullgraph=True)
            shard(model.layers[name])
    elif order == "shard, then torch.compile fullgraph":
        for name, block in model.layers.items():
            shard(block)
            model.layers[name] = torch.compile(block, backend=backend, fullgraph=True)
    elif order == "whole model":
        for block in model.layers.values():
            shard(block)
        shard(model)
        return torch.compile(model, backend=backend)
    else:
        raise ValueError(order)
    shard(model)
    return model


def _run(order: str, impl: str, *, mesh=None, mixed_precision: bool = False, checkpointing: bool = False,
         micro_batches: int = 1, steps: int = 2, batch_size: int = 4,
         backend: CountingBackend = None) -> Tuple[List[float], Dict[str, torch.Tensor], int]:
    """Build tiny Llama on meta (float64), compile + shard it, materialise, init, train with SGD
    on this rank's slice of each global batch. Returns (losses, full params, compiled graph calls)."""
    backend = backend or _backend()
    calls_before = backend.calls
    mesh = mesh if mesh is not None else hp.init_device_mesh("cpu", (dist.get_world_size(),))
    dp_rank, dp_size = _dp_coordinates(mesh)
    if impl == "hp":
        policy = hp.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
        kw = dict(mp_policy=policy) if mixed_precision else {}

        def shard(m):
            return hp.fully_shard(m, mesh=mesh, **kw)
    else:
        policy = TorchMixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float64)
        kw = dict(mp_policy=policy) if mixed_precision else {}

        def shard(m):
            return torch_fully_shard(m, mesh=mesh, **kw)
    with torch.device("meta"):
        model = tiny_llama().to(torch.float64)
    if checkpointing:
        apply_activation_checkpointing(model)
    trained = _compile_blocks(model, order, shard, backend)
    model.to_empty(device="cpu")
    model.init_weights(0)
    losses = train(trained, [global_batch(s, batch_size).chunk(dp_size)[dp_rank] for s in range(steps)],
                   loss_fn=float64_lm_loss, micro_batches=micro_batches, before_micro=_sync_on_last_micro,
                   make_optimizer=sgd)
    return losses, _strip(full_params(model)), backend.calls - calls_before


def _dp_coordinates(mesh) -> Tuple[int, int]:
    """This rank's index and the count of distinct data slices on a (replicate, shard) mesh."""
    if mesh.ndim == 1:
        return mesh.get_local_rank(), mesh.size()
    return mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1), mesh.size()


def _strip(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k.replace("_orig_mod.", ""): v.to(torch.float64) for k, v in params.items()}


def _sync_on_last_micro(model: nn.Module, micro: int, micro_batches: int) -> None:
    model.set_requires_gradient_sync(micro == micro_batches - 1)


def _reference(steps: int = 2, micro_batches: int = 1, batch_size: int = 4) -> Dict[str, torch.Tensor]:
    """Single-process float64 training on the global batches."""
    model = tiny_llama().to(torch.float64)
    model.init_weights(0)
    train(model, [global_batch(s, batch_size) for s in range(steps)], loss_fn=float64_lm_loss,
          micro_batches=micro_batches, make_optimizer=sgd)
    return _strip(full_params(model))


def _losses_diff(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


_ORDERS = ("block.compile, then shard (torchtitan)", "torch.compile fullgraph, then shard",
           "shard, then torch.compile fullgraph", "whole model")


def _fsdp_orders():
    reference = _reference()
    eager_losses, eager_params, _ = _run("eager", "hp")
    out = {"eager vs reference": max_diff(eager_params, reference)}
    for order in _ORDERS:
        losses, params, calls = _run(order, "hp")
        assert calls >= 2 * 2, f"{order}: compiled code ran {calls} times"  # 2 blocks, 2 steps
        out[f"{order}: params vs reference"] = max_diff(params, reference)
        out[f"{order}: losses vs eager"] = _losses_diff(losses, eager_losses)
    # torch FSDP2 compiled the same way, torchtitan order.
    losses, params, _ = _run(_ORDERS[0], "torch")
    out["torch FSDP2 compiled: params vs reference"] = max_diff(params, reference)
    out["torch FSDP2 compiled: losses vs hp eager"] = _losses_diff(losses, eager_losses)
    return out


def test_compiled_blocks_in_every_order_match_eager_and_reference():
    for result in run_on_ranks(2, _fsdp_orders, timeout=600):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, f"max abs diff above {TOL}: {bad}"


def _fsdp_checkpointing_mixed_precision_accumulation():
    order = _ORDERS[0]
    kw = dict(mixed_precision=True, checkpointing=True, micro_batches=2)
    eager_losses, eager_params, _ = _run("eager", "hp", **kw)
    losses, params, calls = _run(order, "hp", **kw)
    torch_losses, torch_params, _ = _run(order, "torch", **kw)
    assert calls >= 2 * 2 * 2, calls  # 2 blocks, 2 micro-batches, 2 steps
    return {"hp compiled vs hp eager": max_diff(params, eager_params),
            "hp compiled vs torch FSDP2 compiled": max_diff(params, torch_params),
            "losses: hp compiled vs eager": _losses_diff(losses, eager_losses),
            "losses: hp compiled vs torch FSDP2 compiled": _losses_diff(losses, torch_losses)}


def test_checkpointing_mixed_precision_and_accumulation_compiled():
    for result in run_on_ranks(2, _fsdp_checkpointing_mixed_precision_accumulation, timeout=600):
        bad = {k: v for k, v in result.items() if not v <= MP_TOL}
        assert not bad, f"max abs diff above {MP_TOL}: {bad}"


def _hsdp_compiled():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kw = dict(mesh=mesh, checkpointing=True, micro_batches=2, batch_size=8)
    _, params, calls = _run(_ORDERS[0], "hp", **kw)
    assert calls >= 2 * 2 * 2, calls
    # (eager HSDP against the same reference: tests/fully_shard/test_hsdp_tp.py)
    return {"params vs reference": max_diff(params, _reference(micro_batches=2, batch_size=8))}


# slow: compiled blocks on an HSDP mesh are also covered by test_mixed_meshes' compiled run with
# HSDP experts, compile with checkpointing and accumulation by the FSDP test above
@pytest.mark.slow
def test_hsdp_compiled_with_checkpointing_and_accumulation():
    for result in run_on_ranks(4, _hsdp_compiled, timeout=600):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, f"max abs diff above {TOL}: {bad}"


INDUCTOR_TOL = 1e-9  # float64; inductor's fused kernels may round differently in the last bits


def _fsdp_inductor():
    kw = dict(checkpointing=True, micro_batches=2)
    backend = CountingBackend("inductor")
    eager_losses, _, _ = _run("eager", "hp", **kw)
    losses, params, calls = _run(_ORDERS[0], "hp", backend=backend, **kw)
    assert calls >= 2 * 2 * 2, calls  # 2 blocks, 2 micro-batches, 2 steps
    return {"params vs reference": max_diff(params, _reference(micro_batches=2)),
            "losses vs eager": _losses_diff(losses, eager_losses)}


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor on CPU compiles C++: no C++ compiler here")
def test_inductor_compiled_blocks_with_checkpointing_and_accumulation_match_reference():
    for result in run_on_ranks(2, _fsdp_inductor, timeout=600):
        bad = {k: v for k, v in result.items() if not v <= INDUCTOR_TOL}
        assert not bad, f"max abs diff above {INDUCTOR_TOL}: {bad}"
