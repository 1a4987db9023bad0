"""torch DCP interop: a checkpoint written by torch's own ``fully_shard`` + ``dcp.save`` (in the
layout torchtitan writes) is imported, loaded directly with resharding, exported back to DCP;
hostile or damaged ``.metadata`` files are refused without running anything; import memory is
bounded by the largest tensor."""

import datetime
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint import CheckpointError
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.core.distributed_checkpoint.dcp_interop import map_keys, read_dcp_metadata
from tests.checkpoint.helpers import make_llama, shard_params
from tests.multirank import run_on_ranks

SEED = 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torchtitan's layout: model keys at the top level, the optimizer flattened under "optimizer".
TITAN_RULES = ["--exclude", "optimizer.param_groups.", "--exclude", "lr_scheduler.", "--exclude", "train_state.",
               "--rename", "optimizer.state.=optim.state.", "--rename", "=model."]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.clone()


def _torch_fully_shard_after_one_adamw_step(**adamw):
    """torch's fully_shard on every rank, then one AdamW step."""
    model = make_llama(seed=SEED)
    for layer in model.layers.values():
        torch_fully_shard(layer)
    torch_fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), **{"lr": 1e-2, **adamw})
    torch.manual_seed(SEED)
    model(torch.randint(0, 100, (2, 8))).sum().backward()
    optim.step()
    return model, optim


def _save_with_torch_dcp(path):
    """torch's fully_shard and one AdamW step, then torch's dcp.save in torchtitan's layout."""
    model, optim = _torch_fully_shard_after_one_adamw_step()
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": 1, "base_lrs": [0.01]},
             "train_state": {"step": 7}}
    torch_dcp.save(state, checkpoint_id=path)
    reference = {k: _full(v) for k, v in msd.items()}  # every rank joins the gathers
    reference.update({f"optimizer.{k}": _full(v) for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return reference if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step-7")
    reference = run_on_ranks(2, _save_with_torch_dcp, path, timeout=120)[0]
    return path, reference


def _ours(key):
    """The key a torchtitan key gets under TITAN_RULES."""
    return "optim." + key[len("optimizer."):] if key.startswith("optimizer.state.") else "model." + key


def _load_imported_into_hp_fully_shard(path):
    """One rank (the DCP checkpoint was saved by two): our fully_shard, then load."""
    model = make_llama(seed=SEED + 1)
    for layer in model.layers.values():
        hp.fully_shard(layer)
    hp.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 100, (2, 8))).sum().backward()
    optim.step()  # creates the state the load fills
    state = {"model": hdcp.get_model_state_dict(model), "optim": {"state": hdcp.get_optimizer_state_dict(
        model, optim)["state"]}}
    assert state["optim"]["state"], "the optimizer state must exist before loading into it"
    hdcp.load(state, checkpoint_id=path)
    flat, _ = hdcp.flatten_state_dict(state)
    return {k: _full(v) for k, v in flat.items()}


def test_import_dcp_then_load_into_hp_fully_shard_on_another_world_size(dcp_checkpoint, tmp_path, capsys):
    src, reference = dcp_checkpoint
    dst = str(tmp_path / "imported")
    assert main(["import-dcp", src, dst, *TITAN_RULES]) == 0
    assert "imported" in capsys.readouterr().out
    assert main(["verify", dst]) == 0
    loaded = run_on_ranks(1, _load_imported_into_hp_fully_shard, dst, timeout=120)[0]
    assert set(loaded) == {_ours(k) for k in reference}
    for key, expected in reference.items():
        assert torch.equal(loaded[_ours(key)], expected), key
    imported = hdcp.read_checkpoint_metadata(dst).state_dict_metadata
    assert not any(k.startswith(("model.optimizer", "model.lr_scheduler", "model.train_state")) for k in imported)


# torch's get_optimizer_state_dict layout: {"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn]}]},
# which DCP flattens to optim.param_groups.0.lr, ...; the hyper-parameters differ from the loader's.
ADAMW = {"lr": 0.0123, "betas": (0.8, 0.9), "weight_decay": 0.05, "eps": 1e-7}


def _save_model_and_optim_with_torch_dcp(path):
    model, optim = _torch_fully_shard_after_one_adamw_step(**ADAMW)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    torch_dcp.save(state, checkpoint_id=path)
    flat, _ = hdcp.flatten_state_dict(state)
    return {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _load_model_and_optim_into_hp(path):
    """hp.fully_shard on a 2x2 HSDP mesh with 4 ranks, a plain model in one process; then
    the full state: parameters, optimizer state and param groups, flat."""
    model = make_llama(seed=SEED + 1)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.layers.values():
            hp.fully_shard(layer, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hdcp.load({"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}, checkpoint_id=path,
              no_dist=not dist.is_initialized())
    state = {"model": hdcp.get_model_state_dict(model), "optim": hdcp.get_optimizer_state_dict(model, optim)}
    flat, _ = hdcp.flatten_state_dict(state)
    return {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _assert_same_state(loaded, saved):
    assert loaded.keys() == saved.keys()
    for key, expected in saved.items():
        if isinstance(expected, torch.Tensor):
            assert torch.equal(loaded[key], expected), key
    groups, expected = loaded["optim.param_groups"], saved["optim.param_groups"]
    assert [dict(g, betas=tuple(g["betas"])) for g in groups] == expected
    assert expected[0]["lr"] == ADAMW["lr"] and expected[0]["betas"] == ADAMW["betas"]


def test_torch_get_optimizer_state_dict_checkpoint_imports_into_hsdp_and_one_process(tmp_path):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ours")
    saved = run_on_ranks(2, _save_model_and_optim_with_torch_dcp, src, timeout=120)[0]
    assert "optim.param_groups.0.lr" in read_dcp_metadata(src).state_dict_metadata  # DCP's flattening
    assert main(["import-dcp", src, dst]) == 0
    assert main(["verify", dst]) == 0
    for loaded in run_on_ranks(4, _load_model_and_optim_into_hp, dst, timeout=120):
        _assert_same_state(loaded, saved)
    _assert_same_state(_load_model_and_optim_into_hp(dst), saved)


def test_torchtitan_weights_reach_model_init_from_through_export_hf(dcp_checkpoint, tmp_path):
    src, reference = dcp_checkpoint
    ours, hf = str(tmp_path / "ours"), str(tmp_path / "hf")
    assert main(["import-dcp", src, ours, "--exclude", "optimizer.", "--exclude", "lr_scheduler.",
                 "--exclude", "train_state."]) == 0
    assert main(["export-hf", ours, hf]) == 0
    model = make_llama(seed=SEED + 3)
    hdcp.load_hf(model, hf)  # what model.init_from does
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[key]), key


def test_map_keys_excludes_then_renames_by_first_matching_prefix_and_refuses_collisions():
    keys = ["w", "optimizer.state.w.exp_avg", "optimizer.param_groups.w.lr", "train_state.step"]
    assert map_keys(keys, rename=[("optimizer.state.", "optim.state."), ("", "model.")],
                    exclude=["optimizer.param_groups.", "train_state."]) == {
        "model.w": "w", "optim.state.w.exp_avg": "optimizer.state.w.exp_avg"}
    with pytest.raises(CheckpointError, match=r"'a.x' and 'b.x' both map to 'x'"):
        map_keys(["a.x", "b.x"], rename=[("a.", ""), ("b.", "")])


def _load_dcp_directly_resharded(path):
    """Two ranks, sharded on the last dim (torch's fully_shard saved dim-0 shards)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_params(make_llama(seed=SEED + 2), mesh, lambda n, p: [Shard(p.dim() - 1)])
    state = hdcp.get_model_state_dict(model)
    step = {"train_state": {"step": None}}
    hdcp.load({**state, **step}, checkpoint_id=path)
    return {k: _full(v) for k, v in state.items()}, step["train_state"]["step"]


def test_load_reads_a_dcp_directory_directly_with_resharding(dcp_checkpoint):
    src, reference = dcp_checkpoint
    for loaded, step in run_on_ranks(2, _load_dcp_directly_resharded, src, timeout=120):
        assert step == 7
        assert set(loaded) == {k for k in reference if not k.startswith("optimizer.")}
        for key, tensor in loaded.items():
            assert torch.equal(tensor, reference[key]), key


def test_cli_verify_of_a_dcp_directory_says_it_has_no_checksums(dcp_checkpoint, capsys):
    src, _ = dcp_checkpoint
    assert main(["verify", src]) == 1
    err = capsys.readouterr().err
    assert "is a torch DCP checkpoint, which has no checksums to verify" in err and "import-dcp" in err


def test_load_from_dcp_says_once_there_are_no_checksums(dcp_checkpoint, tmp_path, caplog):
    src, reference = dcp_checkpoint
    fresh = str(tmp_path / "copy")  # a directory this process has not loaded yet
    shutil.copytree(src, fresh)
    state = {"output.weight": torch.zeros_like(reference["output.weight"])}
    with caplog.at_level("WARNING"):
        hdcp.load(state, checkpoint_id=fresh, no_dist=True, verify=False)
        assert not [r for r in caplog.records if "no checksums" in r.getMessage()]
        hdcp.load(state, checkpoint_id=fresh, no_dist=True)
        hdcp.load(state, checkpoint_id=fresh, no_dist=True)
    assert torch.equal(state["output.weight"], reference["output.weight"])
    told = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(told) == 1 and fresh in told[0]


def test_export_dcp_round_trip_read_by_torch(dcp_checkpoint, tmp_path):
    src, reference = dcp_checkpoint
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    hdcp.import_dcp(src, ours, exclude=["optimizer.param_groups."])
    assert main(["export-dcp", ours, back]) == 0
    state = {k: torch.zeros_like(v) for k, v in reference.items()}
    state.update({"train_state": {"step": None}, "lr_scheduler": {"last_epoch": None, "base_lrs": None}})
    torch_dcp.load(state, checkpoint_id=back, no_dist=True)
    for key, expected in reference.items():
        assert torch.equal(state[key], expected), key
    assert state["train_state"]["step"] == 7
    assert state["lr_scheduler"] == {"last_epoch": 1, "base_lrs": [0.01]}


# ------------------------------------------------------------------------ refused input


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _dcp_dir(tmp_path, payload: bytes):
    path = tmp_path / "hostile"
    path.mkdir()
    (path / ".metadata").write_bytes(payload)
    return str(path)


def test_hostile_metadata_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "ran"
    path = _dcp_dir(tmp_path, pickle.dumps({"state_dict_metadata": _RunsACommand(marker)}))
    with pytest.raises(CheckpointError, match=r"references posix\.system.*refusing") as info:
        read_dcp_metadata(path)
    assert ".metadata" in str(info.value)
    with pytest.raises(CheckpointError, match="posix.system"):
        hdcp.load({"x": torch.zeros(1)}, checkpoint_id=path, no_dist=True)
    assert main(["import-dcp", path, str(tmp_path / "out")]) == 1
    assert "posix.system" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_unknown_class_and_truncated_metadata_are_refused(dcp_checkpoint, tmp_path):
    import collections

    path = _dcp_dir(tmp_path, pickle.dumps(collections.Counter(a=1)))
    with pytest.raises(CheckpointError, match=r"collections\.Counter, which is not one of torch DCP's"):
        read_dcp_metadata(path)
    src, _ = dcp_checkpoint
    with open(os.path.join(src, ".metadata"), "rb") as f:
        whole = f.read()
    (tmp_path / "hostile" / ".metadata").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="not a readable torch DCP .metadata.*truncated"):
        read_dcp_metadata(path)


def test_truncated_data_file_is_named(dcp_checkpoint, tmp_path):
    src, reference = dcp_checkpoint
    broken = str(tmp_path / "broken")
    shutil.copytree(src, broken)
    data = os.path.join(broken, "__1_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError, match=r"__1_0.distcp is truncated: '.*' needs bytes"):
        hdcp.import_dcp(broken, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing committed
    state = {k: torch.zeros_like(v) for k, v in reference.items()}
    with pytest.raises(CheckpointError, match=r"__1_0.distcp is truncated"):
        hdcp.load(state, checkpoint_id=broken, no_dist=True, verify=False)


def test_transforms_and_non_plain_values_are_refused_by_key(tmp_path):
    src = str(tmp_path / "dcp")
    torch_dcp.save({"w": torch.arange(6.0), "when": datetime.timedelta(days=1), "n": 3}, checkpoint_id=src,
                   no_dist=True)
    with pytest.raises(CheckpointError, match=r"value 'when' .*only plain data"):
        hdcp.import_dcp(src, str(tmp_path / "out"))
    imported = hdcp.import_dcp(src, str(tmp_path / "out"), exclude=["when"])
    assert set(imported.state_dict_metadata) == {"w", "n"}
    state = {"w": torch.zeros(6), "n": None}
    hdcp.load(state, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["n"] == 3

    complex_dir = str(tmp_path / "complex")
    torch_dcp.save({"c": torch.arange(4.0) * (1 + 2j)}, checkpoint_id=complex_dir, no_dist=True)
    with pytest.raises(CheckpointError, match=r"'c' has dtype torch.complex64, which safetensors cannot store"):
        hdcp.import_dcp(complex_dir, str(tmp_path / "complex-out"))
    loaded = {"c": torch.zeros(4, dtype=torch.complex64)}
    hdcp.load(loaded, checkpoint_id=complex_dir, no_dist=True)  # load reads what import cannot store
    assert torch.equal(loaded["c"], torch.arange(4.0) * (1 + 2j))

    with open(os.path.join(src, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # our own file, written just above
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    info.transform_descriptors = ["stream.zstd"]
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"'w' is stored through the transforms \['stream.zstd'\]"):
        hdcp.load({"w": torch.zeros(6)}, checkpoint_id=src, no_dist=True)


# ------------------------------------------------------------------------ bounded memory

_MEASURE = """
import sys
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import translate_metadata

def peak_rss():  # VmHWM: this process's own peak (ru_maxrss would include the forking parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

translate_metadata(sys.argv[1])
hdcp.import_dcp(sys.argv[3], sys.argv[4])  # a tiny one first: the modules it imports are not counted
before = peak_rss()
hdcp.import_dcp(sys.argv[1], sys.argv[2])
print(peak_rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc (Linux)")
def test_import_memory_is_bounded_by_the_largest_tensor_not_the_checkpoint(tmp_path):
    largest = 16 << 20
    sizes = [largest // 4 // (1 + i % 2) for i in range(12)]  # 16 and 8 MiB tensors, 144 MiB in all
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ours")
    torch_dcp.save({f"t{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}, checkpoint_id=src,
                   no_dist=True)
    total = sum(sizes) * 4
    tiny = str(tmp_path / "tiny_dcp")
    torch_dcp.save({"t": torch.ones(4)}, checkpoint_id=tiny, no_dist=True)
    # A fixed mmap threshold makes glibc map every large block and unmap it when freed: the peak
    # RSS then follows the live tensors, not what the allocator's heaps keep (with the dynamic
    # threshold the same import measured 24 to 72 MiB from run to run).
    env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    result = subprocess.run([sys.executable, "-c", _MEASURE, src, dst, tiny, str(tmp_path / "tiny_ours")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.split()[-1])
    # One chunk at a time, not the checkpoint (measured 18 MiB for 16 MiB tensors).
    assert grown < 2 * largest < total / 4, f"import grew the peak RSS by {grown} bytes for a {total}-byte checkpoint"
    loaded = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    hdcp.load(loaded, checkpoint_id=dst, no_dist=True)
    assert all(torch.equal(t, torch.full_like(t, float(i))) for i, t in enumerate(loaded.values()))


@pytest.mark.timeout(60)
def test_fifo_as_dcp_metadata_or_data_file_is_refused_without_blocking(dcp_checkpoint, tmp_path):
    src, reference = dcp_checkpoint
    broken = tmp_path / "fifo-metadata"
    broken.mkdir()
    os.mkfifo(broken / ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata is a FIFO, not a regular file"):
        read_dcp_metadata(str(broken))
    broken = str(tmp_path / "fifo-data")
    shutil.copytree(src, broken)
    os.remove(os.path.join(broken, "__1_0.distcp"))
    os.mkfifo(os.path.join(broken, "__1_0.distcp"))
    with pytest.raises(CheckpointError, match=r"__1_0.distcp is a FIFO, not a regular file"):
        hdcp.import_dcp(broken, str(tmp_path / "out"))
