"""CheckpointManager: interval, force, retention, commit detection, async, exact resume."""

import os
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointManager,
    ModelState,
    OptimizerState,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    is_checkpoint,
)
from tests.checkpoint.helpers import full_model_state_dict, make_llama, seeded_grads_step, shard_params
from tests.multirank import run_on_ranks


def _steps_on_disk(folder):
    return sorted(int(n[5:]) for n in os.listdir(folder) if n.startswith("step-") and is_checkpoint(os.path.join(folder, n)))


def test_argument_validation(tmp_path):
    for kwargs, match in [({"interval": 0}, "interval"), ({"interval": 1.5}, "interval"),
                          ({"keep_last_n": 0}, "keep_last_n")]:
        with pytest.raises(ValueError, match=match):
            CheckpointManager(tmp_path, **kwargs)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        manager.save(-1, {})


def test_interval_force_and_retention_counting_forced_saves(tmp_path):
    manager = CheckpointManager(tmp_path, interval=3, keep_last_n=2)
    weights = torch.zeros(4)
    saved = [step for step in range(1, 8) if manager.save(step, {"w": weights})]
    assert saved == [3, 6] and _steps_on_disk(tmp_path) == [3, 6]
    assert manager.save(7, {"w": weights}, force=True) is True
    assert _steps_on_disk(tmp_path) == [6, 7]
    assert manager.latest_step() == 7


def test_uncommitted_dirs_ignored_and_stale_staging_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_n=1)
    manager.save(5, {"w": torch.ones(3)})
    os.makedirs(tmp_path / "step-9")  # a crashed writer's directory without metadata
    (tmp_path / "step-9" / "__0_0.safetensors").write_bytes(b"partial")
    os.makedirs(tmp_path / ".step-9.staging-abc123")
    assert manager.latest_step() == 5
    manager.save(6, {"w": torch.ones(3)})
    assert _steps_on_disk(tmp_path) == [6]
    assert (tmp_path / "step-9").is_dir()  # never deleted: not a checkpoint
    assert (tmp_path / ".step-9.staging-abc123").is_dir()  # a save could be writing it now
    CheckpointManager(tmp_path)  # a new run: no save of its own in flight yet
    assert not (tmp_path / ".step-9.staging-abc123").exists()
    assert (tmp_path / "step-9").is_dir()


def test_newest_checkpoint_is_never_deleted(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_n=1)
    manager.save(10, {"w": torch.ones(2)})
    manager.save(4, {"w": torch.ones(2)}, force=True)  # e.g. a rerun from an older point
    assert _steps_on_disk(tmp_path) == [4, 10]
    manager.save(12, {"w": torch.ones(2)})
    assert _steps_on_disk(tmp_path) == [12]


def test_load_latest_restores_exact_values_without_process_group(tmp_path):
    model = make_llama(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seeded_grads_step(model, optim, 0)
    manager = CheckpointManager(tmp_path, interval=2)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optim),
             "step": 2, "scheduler": {"last_epoch": 2, "lrs": [0.5, 0.25]}, "rng": torch.arange(4)}
    assert manager.load_latest(state) is None
    assert manager.save(2, state) is True
    expected_params = full_model_state_dict(model)
    expected_optim = {k: v.clone() for k, v in optim.state_dict()["state"][0].items()}

    model2 = make_llama(seed=2)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    state2 = {"model": ModelState(model2), "optim": OptimizerState(model2, optim2),
              "step": 0, "scheduler": {"last_epoch": 0, "lrs": [1.0, 1.0]}, "rng": torch.zeros(4, dtype=torch.int64)}
    assert CheckpointManager(tmp_path).load_latest(state2) == 2
    assert state2["step"] == 2 and state2["scheduler"] == {"last_epoch": 2, "lrs": [0.5, 0.25]}
    assert torch.equal(state2["rng"], torch.arange(4))
    assert all(torch.equal(v, expected_params[k]) for k, v in full_model_state_dict(model2).items())
    assert optim2.param_groups[0]["lr"] == 1e-2
    assert all(torch.equal(optim2.state_dict()["state"][0][k], v) for k, v in expected_optim.items())


def test_async_save_and_wait(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_n=1, async_save=True)
    weights = torch.arange(1000.0)
    first = manager.save(1, {"w": weights})
    assert isinstance(first, Future)
    weights.add_(1)  # after the call: not in the checkpoint
    second = manager.save(2, {"w": weights})  # waits for the first, then applies retention
    assert first.done()
    manager.wait()
    assert second.done() and _steps_on_disk(tmp_path) == [2]
    loaded = {"w": torch.zeros(1000)}
    assert manager.load_latest(loaded) == 2 and torch.equal(loaded["w"], torch.arange(1000.0) + 1)


# ------------------------------------------------------------------- with a process group


def _sharded_save_then_reshard_load(folder, async_save):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = shard_params(make_llama(seed=3), mesh, lambda n, p: [Shard(0)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seeded_grads_step(model, optim, 0)
    manager = CheckpointManager(folder, interval=1, keep_last_n=1, async_save=async_save)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "step": 1}
    manager.save(1, state)
    seeded_grads_step(model, optim, 1)
    manager.save(2, {**state, "step": 2})
    manager.wait()
    assert _steps_on_disk(folder) == [2] and manager.latest_step() == 2

    model2 = shard_params(make_llama(seed=4), mesh, lambda n, p: [Shard(p.dim() - 1)])
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    state2 = {"model": ModelState(model2), "optim": OptimizerState(model2, optim2), "step": 0}
    assert manager.load_latest(state2) == 2 and state2["step"] == 2
    seeded_grads_step(model, optim, 2)
    seeded_grads_step(model2, optim2, 2)
    a, b = full_model_state_dict(model), full_model_state_dict(model2)
    return all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_with_process_group_resumes_exactly_into_other_sharding(tmp_path, async_save):
    assert all(run_on_ranks(2, _sharded_save_then_reshard_load, str(tmp_path), async_save, timeout=120))


# ------------------------------------------------ training resume on another world size


def _lm_step(model, optim, step):
    """One step on a fixed global batch. Every rank computes the whole batch, so the gradient
    FSDP averages is the same on all ranks and training is bit-identical to one process."""
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(100 + step))
    optim.zero_grad()
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optim.step()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_two_steps_fsdp_and_save(folder):
    import hyper_parallel as hp

    model = make_llama(seed=21)
    for layer in model.layers.values():
        hp.fully_shard(layer)
    hp.fully_shard(model)
    optim = _adamw(model)
    manager = CheckpointManager(folder, interval=2)
    for step in (1, 2):
        _lm_step(model, optim, step)
        manager.save(step, {"model": ModelState(model), "optim": OptimizerState(model, optim), "step": step})
    return manager.latest_step()


def _load_into_fsdp(folder):
    """Load the latest checkpoint into an hp.fully_shard model on this world; full values back."""
    import hyper_parallel as hp

    model = make_llama(seed=98)
    for layer in model.layers.values():
        hp.fully_shard(layer, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    hp.fully_shard(model, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    optim = _adamw(model)
    step = CheckpointManager(folder).load_latest({"model": ModelState(model), "optim": OptimizerState(model, optim)})
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return step, get_model_state_dict(model, options=full), get_optimizer_state_dict(model, optim, options=full)


def test_train_2_steps_on_2_ranks_resume_elsewhere_equals_uninterrupted_training(tmp_path):
    """2 -> 1 process: 2 more steps equal 4 uninterrupted ones bit for bit; 2 -> 4 ranks
    (hp.fully_shard on Shard(1)): the loaded parameters and optimizer state are exact."""
    assert run_on_ranks(2, _train_two_steps_fsdp_and_save, str(tmp_path), timeout=120) == [2, 2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as the ranks
    try:
        reference = make_llama(seed=21)
        ref_optim = _adamw(reference)
        for step in (1, 2):
            _lm_step(reference, ref_optim, step)
        after_two = {k: v.clone() for k, v in reference.state_dict().items()}
        exp_avg = {name: ref_optim.state[p]["exp_avg"].clone() for name, p in reference.named_parameters()}
        for step in (3, 4):
            _lm_step(reference, ref_optim, step)

        model = make_llama(seed=99)
        optim = _adamw(model)
        state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "step": 0}
        assert CheckpointManager(tmp_path).load_latest(state) == 2 and state["step"] == 2
        for step in (3, 4):
            _lm_step(model, optim, step)
    finally:
        torch.set_num_threads(threads)
    expected = reference.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())

    step, params, optim_sd = run_on_ranks(4, _load_into_fsdp, str(tmp_path), timeout=120)[0]
    assert step == 2 and params.keys() == after_two.keys()
    assert all(torch.equal(v, after_two[k]) for k, v in params.items())
    assert all(torch.equal(optim_sd["state"][k]["exp_avg"], v) for k, v in exp_avg.items())
