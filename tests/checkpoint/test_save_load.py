"""Round trips across meshes, world sizes and placements; dedup; plan caching; key errors."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

from hyper_parallel import checkpoint as hdcp
from tests.checkpoint.helpers import (
    FailingWriter,
    assert_state_equal,
    blank_state,
    counting_reads,
    distribute_state,
    full_state,
    load_and_check,
    message_or,
    save_layout,
    state_nbytes,
)
from tests.multirank import run_on_ranks

T = 120


def _save_then_load(path, save_layout_name, load_layouts, **save_kwargs):
    save_layout(path, save_layout_name, **save_kwargs)
    return load_and_check(path, load_layouts)


def _tensor_bytes_by_rank(path):
    md = hdcp.read_checkpoint_metadata(path)
    by_rank = {}
    for name, info in md.files.items():
        if name.endswith(".safetensors"):
            rank = int(name[2:].split("_")[0])
            by_rank[rank] = by_rank.get(rank, 0) + info.size
    return by_rank


def test_fsdp_save_loads_into_every_layout_on_4_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    layouts = ["hsdp", "shard1", "replicate", "2d", "shard00", "fsdp"]
    assert all(run_on_ranks(4, _save_then_load, path, "fsdp", layouts, timeout=T))
    # ... and into 2 ranks, and into one plain process.
    assert all(run_on_ranks(2, load_and_check, path, ["shard1", "hsdp"], timeout=T))
    assert load_and_check(path, [None], no_dist=True)


def test_hsdp_save_writes_one_copy_spread_over_replicas(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(4, save_layout, path, "hsdp", timeout=T)
    by_rank = _tensor_bytes_by_rank(path)
    state_bytes = state_nbytes(full_state())
    header_slack = 4096 * len(by_rank)
    assert state_bytes <= sum(by_rank.values()) <= state_bytes + header_slack
    # mesh [[0, 1], [2, 3]]: replicas {0, 2} and {1, 3} split their chunks about evenly
    for a, b in ((0, 2), (1, 3)):
        assert max(by_rank[a], by_rank[b]) < 1.5 * min(by_rank[a], by_rank[b]), by_rank
    assert load_and_check(path, [None], no_dist=True)
    assert all(run_on_ranks(2, load_and_check, path, ["fsdp"], timeout=T))


def test_save_to_minimum_rank_and_keeping_redundancy(tmp_path):
    lowest, redundant = str(tmp_path / "lowest"), str(tmp_path / "redundant")
    run_on_ranks(4, save_layout, lowest, "hsdp", save_to_minimum_rank=True, timeout=T)
    # mesh [[0, 1], [2, 3]]: replicas {0, 2} and {1, 3}; the lowest of each writes.
    assert sorted(_tensor_bytes_by_rank(lowest)) == [0, 1]
    run_on_ranks(4, save_layout, redundant, "hsdp", remove_redundancy=False, timeout=T)
    state_bytes = state_nbytes(full_state())
    assert sum(_tensor_bytes_by_rank(redundant).values()) >= 2 * state_bytes - state_bytes // 4
    for path in (lowest, redundant):
        assert load_and_check(path, [None], no_dist=True, verify=True)


def test_shard1_on_2_ranks_to_hsdp_on_4(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, save_layout, path, "shard1", timeout=T)
    assert all(run_on_ranks(4, load_and_check, path, ["hsdp", "shard1"], timeout=T))
    run_on_ranks(4, save_layout, path, "2d", timeout=T)
    assert all(run_on_ranks(2, load_and_check, path, ["hsdp"], timeout=T))


def test_single_process_save_loads_sharded(tmp_path):
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    assert all(run_on_ranks(4, load_and_check, path, ["fsdp"], timeout=T))


def _rank_local_round_trip(path, diverging_path):
    save_layout(path, "hsdp", use_collectives=False)
    dist.barrier()
    load_and_check(path, ["hsdp", "fsdp"], use_collectives=False)
    hdcp.save({"rng": torch.tensor([dist.get_rank()])}, checkpoint_id=diverging_path, use_collectives=False)
    return True


def test_use_collectives_false_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    diverging = str(tmp_path / "diverging")
    assert all(run_on_ranks(4, _rank_local_round_trip, path, diverging, timeout=T))
    with pytest.raises(hdcp.CheckpointError, match="ranks saved different values for 'rng'"):
        hdcp.load({"rng": torch.zeros(1, dtype=torch.int64)}, checkpoint_id=diverging, no_dist=True)
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "metadata.rank*.json"))) == [
        f"metadata.rank{r}.json" for r in range(4)]
    assert hdcp.is_checkpoint(path) and not os.path.exists(os.path.join(path, "metadata.json"))
    assert all(run_on_ranks(2, load_and_check, path, ["shard1"], timeout=T))
    assert load_and_check(path, [None], no_dist=True)
    with pytest.raises(hdcp.CheckpointError, match="new checkpoint_id"):
        save_layout(path, None, no_dist=True, use_collectives=False)
    os.remove(os.path.join(path, "metadata.rank3.json"))
    assert not hdcp.is_checkpoint(path)
    with pytest.raises(hdcp.CheckpointError, match="incomplete"):
        load_and_check(path, [None], no_dist=True)


class CountingPlanner(hdcp.StandardSavePlanner):
    global_builds = 0

    def build_global_plan(self, all_plans):
        CountingPlanner.global_builds += 1
        return super().build_global_plan(all_plans)


def _repeated_saves_reuse_plan(root):
    CountingPlanner.global_builds = 0
    for i in range(3):
        hdcp.save(distribute_state(full_state(seed=i), "fsdp"), checkpoint_id=f"{root}/s{i}", planner=CountingPlanner())
    load_and_check(f"{root}/s2", ["hsdp"], seed=2)
    return CountingPlanner.global_builds


def test_repeated_save_reuses_global_plan(tmp_path):
    assert run_on_ranks(2, _repeated_saves_reuse_plan, str(tmp_path), timeout=T)[0] == 1


def _diverging_plain_value(path):
    state = distribute_state(full_state(), "fsdp")
    state["rng"] = torch.tensor([dist.get_rank()])
    return message_or("saved", lambda: hdcp.save(state, checkpoint_id=path))


def test_differing_plain_tensors_are_refused(tmp_path):
    messages = run_on_ranks(2, _diverging_plain_value, str(tmp_path / "ckpt"), timeout=T)
    assert all("'rng'" in m and "differs" in m for m in messages), messages
    assert not hdcp.is_checkpoint(str(tmp_path / "ckpt"))


def test_key_errors_name_the_key(tmp_path):
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    cases = {
        "shape": lambda s: s["model"].__setitem__("layers.0.w", torch.zeros(7, 4)),
        "dtype": lambda s: s["model"].__setitem__("layers.0.w", torch.zeros(7, 5, dtype=torch.float64)),
        "missing": lambda s: s["model"].__setitem__("extra.w", torch.zeros(2)),
    }
    for case, mutate in cases.items():
        state = blank_state()
        mutate(state)
        key = "model.extra.w" if case == "missing" else "model.layers.0.w"
        with pytest.raises(hdcp.CheckpointError, match=f"'{key}'"):
            hdcp.load(state, checkpoint_id=path, no_dist=True)
    state = blank_state()
    state["model"]["extra.w"] = torch.zeros(2)
    del state["train"]
    planner = hdcp.StandardLoadPlanner(strict=False)
    hdcp.load(state, checkpoint_id=path, no_dist=True, planner=planner)
    assert planner.missing_keys == ["model.extra.w"]
    assert planner.unexpected_keys == ["train.name", "train.step", "train.tokens_seen"]
    assert torch.equal(state["model"]["layers.0.w"], full_state()["model"]["layers.0.w"])


def test_values_need_json_or_explicit_pickle(tmp_path):
    state = full_state()
    state["train"]["when"] = {1, 2}  # a set: not JSON
    with pytest.raises(TypeError, match="'train.when'"):
        hdcp.save(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    pickled = str(tmp_path / "b")
    hdcp.save(state, storage_writer=hdcp.FileSystemWriter(pickled, allow_pickle=True), no_dist=True)
    target = blank_state()
    target["train"]["when"] = None
    with pytest.raises(hdcp.CheckpointError, match="'train.when'.*refusing"):
        hdcp.load(target, checkpoint_id=pickled, no_dist=True)
    hdcp.load(target, storage_reader=hdcp.FileSystemReader(pickled, allow_pickle=True), no_dist=True)
    assert_state_equal(target, state)


def test_files_are_valid_safetensors_and_metadata_reads_without_process_group(tmp_path):
    from safetensors import safe_open

    path = str(tmp_path / "ckpt")
    run_on_ranks(2, save_layout, path, "fsdp", timeout=T)
    md = hdcp.FileSystemReader(path).read_metadata()
    assert md.state_dict_metadata["optim.state.layers.0.w.exp_avg"].size == (7, 5)
    assert md.layouts["model.layers.0.w"]["placements"] == ["S(0)"]
    full = full_state()["model"]["layers.1.w"]
    for index, info in md.storage_data.items():
        if index.fqn == "model.layers.1.w":
            with safe_open(os.path.join(path, info.relative_path), "pt") as f:
                name = next(k for k in f.keys() if k.startswith("model.layers.1.w@"))
                chunk = f.get_tensor(name)
            rows = slice(index.offset[0], index.offset[0] + chunk.shape[0])
            assert torch.equal(chunk, full[rows])


def _failing_save(path):
    state = distribute_state(full_state(), "fsdp")
    return message_or("saved", lambda: hdcp.save(state, storage_writer=FailingWriter(path)),
                      (hdcp.CheckpointError, OSError))


def test_failed_save_on_one_rank_fails_everywhere_and_cleans_up(tmp_path):
    messages = run_on_ranks(2, _failing_save, str(tmp_path / "ckpt"), timeout=T)
    assert all("disk full" in m for m in messages), messages
    assert os.listdir(tmp_path) == []


def _bytes_read_for_column_shard(path, cols):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = {"w": distribute_tensor(torch.zeros(8, cols), mesh, (Shard(1),))}
    with counting_reads() as read:
        hdcp.load(target, checkpoint_id=path, verify=False)  # verification reads whole chunks
    assert torch.equal(target["w"].full_tensor(), torch.arange(8 * cols, dtype=torch.float32).view(8, cols))
    return sum(read)


@pytest.mark.parametrize("cols", [4096, 64])
def test_reads_fetch_only_the_overlapping_bytes(tmp_path, cols):
    path = str(tmp_path / "ckpt")
    hdcp.save({"w": torch.arange(8 * cols, dtype=torch.float32).view(8, cols)}, checkpoint_id=path, no_dist=True)
    # Each of 4 ranks needs an 8 x cols/4 column block: 8 runs of 4 KiB, 12 KiB apart, nothing
    # in between; runs of 64 B only 192 B apart are read as their 8 whole rows (a syscall each
    # would cost more than copying the gaps; the page cache reads whole pages anyway).
    expected = 8 * cols if cols == 4096 else 8 * cols * 4
    assert run_on_ranks(4, _bytes_read_for_column_shard, path, cols, timeout=T) == [expected] * 4


def _hsdp_load_bytes(path):
    target = distribute_state(blank_state(), "hsdp")
    with counting_reads() as read:
        hdcp.load(target, checkpoint_id=path, verify=False)  # verification reads whole chunks
    assert_state_equal(target, full_state())
    return sum(read)


def test_hsdp_load_reads_each_shard_once_and_broadcasts(tmp_path):
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    reads = run_on_ranks(4, _hsdp_load_bytes, path, timeout=T)
    # Ranks 2 and 3 (replicate coordinate 1) read only the plain tensors and values.
    assert reads[2] == reads[3] < 1024
    plain = 4 * len(full_state()["optim"]["state"])  # the float32 "step" tensors
    assert reads[0] + reads[1] - 2 * reads[2] == state_nbytes(full_state()) - plain


def test_plain_values_keep_their_python_types(tmp_path):
    path = str(tmp_path / "ckpt")
    values = {"groups": [{1: "a", (2, 3): None}, (1.5, "s", [True])], "inf": float("inf"), "empty": {}}
    hdcp.save(values, checkpoint_id=path, no_dist=True)
    target = {"groups": None, "inf": 0.0, "empty": None}
    hdcp.load(target, checkpoint_id=path, no_dist=True)
    assert target == values and isinstance(target["groups"][1], tuple)


def test_load_fills_parameters_in_place(tmp_path):
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    source = torch.nn.Linear(5, 3)
    hdcp.save(dict(source.named_parameters()), checkpoint_id=path, no_dist=True)
    target = torch.nn.Linear(5, 3)
    weight = target.weight
    hdcp.load(dict(target.named_parameters()), checkpoint_id=path, no_dist=True)
    assert target.weight is weight and weight.requires_grad
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)


def _per_rank_keys(path):
    rank = dist.get_rank()
    state = distribute_state(full_state(), "fsdp")
    state[f"rng.rank{rank}"] = torch.tensor([rank, 10 * rank])
    state[f"loader.rank{rank}"] = {"position": 100 + rank}
    hdcp.save(state, checkpoint_id=path)
    target = distribute_state(blank_state(), "hsdp")
    target[f"rng.rank{rank}"] = torch.zeros(2, dtype=torch.int64)
    target[f"loader.rank{rank}"] = {"position": None}
    hdcp.load(target, checkpoint_id=path)
    expected = full_state()
    expected[f"rng.rank{rank}"] = torch.tensor([rank, 10 * rank])
    expected[f"loader.rank{rank}"] = {"position": 100 + rank}
    assert_state_equal(target, expected)
    return sorted(hdcp.read_checkpoint_metadata(path).files)


def test_per_rank_values_under_rank_specific_keys(tmp_path):
    files = run_on_ranks(4, _per_rank_keys, str(tmp_path / "ckpt"), timeout=T)[0]
    # Every rank wrote its own values file; keys held by all ranks came from rank 0 only.
    assert [f for f in files if "values" in f] == [f"__{r}.values.json" for r in range(4)]
    md = hdcp.read_checkpoint_metadata(str(tmp_path / "ckpt"))
    assert {i.fqn: s.relative_path for i, s in md.storage_data.items() if i.fqn.startswith(("train.", "optim.state.norm"))
            and "exp_avg" not in i.fqn} == {
        "train.step": "__0.values.json", "train.tokens_seen": "__0.values.json", "train.name": "__0.values.json",
        "optim.state.norm.weight.step": "__0_0.safetensors"}


def _empty_and_scalar_tensors(path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"empty": distribute_tensor(torch.zeros(0, 4), mesh, (Shard(0),)),
             "tiny": distribute_tensor(torch.tensor([7.0]), mesh, (Shard(0),)),
             "scalar": torch.tensor(3.5), "flag": torch.tensor([True, False])}
    hdcp.save(state, checkpoint_id=path)
    target = {"empty": distribute_tensor(torch.ones(0, 4), mesh, (Shard(0),)),
              "tiny": distribute_tensor(torch.zeros(1), mesh, (Shard(0),)),
              "scalar": torch.tensor(0.0), "flag": torch.tensor([False, True])}
    hdcp.load(target, checkpoint_id=path)
    assert target["empty"].shape == (0, 4) and target["tiny"].full_tensor().tolist() == [7.0]
    assert target["scalar"].item() == 3.5 and target["flag"].tolist() == [True, False]
    return hdcp.read_checkpoint_metadata(path).state_dict_metadata["empty"].size


def test_empty_scalar_and_bool_tensors(tmp_path):
    assert run_on_ranks(2, _empty_and_scalar_tensors, str(tmp_path / "ckpt"), timeout=T) == [(0, 4)] * 2


def _replicas_with_different_keys(path):
    target = distribute_state(blank_state(), "hsdp")
    if dist.get_rank() == 2:
        del target["model"]["norm.weight"]
    return message_or("loaded", lambda: hdcp.load(target, checkpoint_id=path))


def test_replicas_asking_for_different_keys_fail_instead_of_hanging(tmp_path):
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    messages = run_on_ranks(4, _replicas_with_different_keys, path, timeout=T)
    assert all("would broadcast different replicated shards" in m for m in messages), messages


def _trained_mlp_and_adamw(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("save_fn", ["save", "async_save"])
def test_stateful_values_are_saved_and_restored(tmp_path, save_fn):
    path = str(tmp_path / "ckpt")
    model, optim = _trained_mlp_and_adamw(0)
    state = {"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim), "step": 7}
    result = getattr(hdcp, save_fn)(state, checkpoint_id=path, no_dist=True)
    if save_fn == "async_save":
        result.result(timeout=60)
    target_model, target_optim = _trained_mlp_and_adamw(1)
    target = {"model": hdcp.ModelState(target_model), "optim": hdcp.OptimizerState(target_model, target_optim),
              "step": 0}
    hdcp.load(target, checkpoint_id=path, no_dist=True)
    assert target["step"] == 7 and isinstance(target["model"], hdcp.ModelState)
    for a, b in zip(model.parameters(), target_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), target_model.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[a][name], target_optim.state[b][name]), name


class DoublingPlanner(hdcp.StandardSavePlanner):
    """Serves other bytes than the state holds: the planning-time checksum must not be reused."""

    def get_data(self, item):
        data = super().get_data(item)
        return data * 2 if isinstance(data, torch.Tensor) else data


@pytest.mark.parametrize("planner_type", [hdcp.StandardSavePlanner, DoublingPlanner])
def test_plain_tensor_checksums_match_the_written_bytes(tmp_path, planner_type):
    path = str(tmp_path / "ckpt")
    state = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "step": 3}
    hdcp.save(state, checkpoint_id=path, no_dist=True, planner=planner_type())
    hdcp.verify_checkpoint(path)
    target = {"w": torch.zeros(3, 4), "step": 0}
    hdcp.load(target, checkpoint_id=path, no_dist=True, verify=True)
    factor = 2 if planner_type is DoublingPlanner else 1
    assert torch.equal(target["w"], state["w"] * factor) and target["step"] == 3
