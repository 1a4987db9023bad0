"""Checkpoints under fsspec URLs (object_store/): memory:// in one process, file:// on 2 gloo
ranks (memory:// is per process); the commit protocol: data objects tagged by save id,
metadata.json last; ranged reads; corrupt objects refused."""

from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.object_store import reader as object_reader
from tests.checkpoint.helpers import blank_state, distribute_state, full_state, load_and_check, save_layout
from tests.multirank import run_on_ranks

fsspec = pytest.importorskip("fsspec", reason="object storage needs fsspec (pip install 'hyper_parallel[s3]')")

T = 120


def _names(url):
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(path)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []


def test_memory_round_trip_and_replace(memory_url):
    save_layout(memory_url, None, no_dist=True)
    first = hdcp.FsspecReader(memory_url)
    first.initialize_reader(None)
    first_id = first.read_metadata().save_id
    assert METADATA_FILE in _names(memory_url)
    assert all(first_id in n for n in _names(memory_url) if n != METADATA_FILE)
    assert load_and_check(memory_url, [None], no_dist=True)
    # A second save to the same URL commits by replacing metadata.json; the first save's objects go.
    save_layout(memory_url, None, seed=3, no_dist=True)
    assert not any(first_id in n for n in _names(memory_url))
    assert load_and_check(memory_url, [None], seed=3, no_dist=True)


def test_async_save_to_memory(memory_url):
    future = hdcp.async_save(full_state(), checkpoint_id=memory_url, no_dist=True)
    assert future.result(timeout=60).save_id
    assert not any(n.startswith(".done") for n in _names(memory_url))  # markers removed at commit
    assert load_and_check(memory_url, [None], no_dist=True)


def test_without_metadata_object_it_is_no_checkpoint(memory_url):
    save_layout(memory_url, None, no_dist=True)
    fsspec.filesystem("memory").rm(f"{memory_url[len('memory://'):]}/{METADATA_FILE}")
    with pytest.raises(hdcp.CheckpointError, match="not a committed checkpoint: metadata.json is missing"):
        hdcp.load(blank_state(), checkpoint_id=memory_url, no_dist=True)


def _corrupt_tensor_object(url):
    fs, path = fsspec.core.url_to_fs(url)
    name = next(n for n in _names(url) if n.endswith(".safetensors"))
    data = bytearray(fs.cat_file(f"{path}/{name}"))
    data[-3] ^= 0xFF  # inside the last chunk
    fs.pipe_file(f"{path}/{name}", bytes(data))


def test_corrupt_object_is_refused(memory_url):
    save_layout(memory_url, None, no_dist=True)
    _corrupt_tensor_object(memory_url)
    with pytest.raises(hdcp.CheckpointError, match="checksum mismatch in memory://.*the object is corrupt"):
        hdcp.load(blank_state(), checkpoint_id=memory_url, no_dist=True)
    hdcp.load(blank_state(), checkpoint_id=memory_url, no_dist=True, verify=False)  # unchecked: loads


def test_truncated_object_is_refused(memory_url):
    save_layout(memory_url, None, no_dist=True)
    fs, path = fsspec.core.url_to_fs(memory_url)
    name = next(n for n in _names(memory_url) if n.endswith(".safetensors"))
    fs.pipe_file(f"{path}/{name}", fs.cat_file(f"{path}/{name}")[:-4])
    with pytest.raises(hdcp.CheckpointError, match=r"has \d+ bytes, metadata says \d+ \(truncated or replaced\)"):
        hdcp.load(blank_state(), checkpoint_id=memory_url, no_dist=True)


class _FailingUpload(hdcp.FsspecWriter):
    def execute_write(self, plan, planner):
        super().execute_write(plan, planner)
        raise OSError("connection reset (simulated)")


def test_failed_save_leaves_the_committed_checkpoint(memory_url):
    save_layout(memory_url, None, no_dist=True)
    before = _names(memory_url)
    with pytest.raises(OSError, match="simulated"):
        hdcp.save(full_state(seed=1), checkpoint_id=memory_url, no_dist=True, storage_writer=_FailingUpload())
    assert _names(memory_url) == before  # its uploads deleted, the old checkpoint untouched
    assert load_and_check(memory_url, [None], no_dist=True)


def test_unknown_scheme_is_one_clear_error():
    with pytest.raises(ValueError, match=r"nosuch:// is no storage fsspec knows"):
        hdcp.save({"w": torch.ones(2)}, checkpoint_id="nosuch://bucket/x", no_dist=True)
    with pytest.raises(ValueError, match=r"nosuch:// is no storage fsspec knows"):
        hdcp.load({"w": torch.ones(2)}, checkpoint_id="nosuch://bucket/x", no_dist=True)


def test_rank_local_saves_are_refused(memory_url):
    with pytest.raises(ValueError, match="use_collectives=False are not supported on object storage"):
        hdcp.save({"w": torch.ones(2)}, checkpoint_id=memory_url, no_dist=True, use_collectives=False)


# ------------------------------------------------------------------- 2 gloo ranks, file://

def _counted_reads(url, layouts):
    """Load ``url`` into ``layouts``; the bytes this rank fetched per stored chunk."""
    fetched = {}
    original = object_reader.FsspecReader._run

    def run(self, batch, *args):
        for fetch in batch:
            key = (fetch.info.relative_path, fetch.info.offset)
            fetched[key] = fetched.get(key, 0) + fetch.end - fetch.start
        return original(self, batch, *args)

    object_reader.FsspecReader._run = run
    try:
        load_and_check(url, layouts)
    finally:
        object_reader.FsspecReader._run = original
    return fetched


def test_file_url_two_ranks_resharding(tmp_path):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, save_layout, url, "fsdp", timeout=T)
    assert os.path.isfile(tmp_path / "step-1" / METADATA_FILE)
    assert all(run_on_ranks(2, load_and_check, url, ["shard1", "replicate"], timeout=T))
    assert load_and_check(url, [None], no_dist=True)
    # Resharding Shard(0) -> Shard(1): no rank fetches a stored range twice, and each tensor
    # chunk is fetched once in all: by the rank that checks it, which forwards it to the other.
    per_rank = run_on_ranks(2, _counted_reads, url, ["shard1"], timeout=T)
    md = hdcp.FsspecReader(url)
    md.initialize_reader(None)
    lengths = {(i.relative_path, i.offset): i.length for i in md.read_metadata().storage_data.values()}
    for fetched in per_rank:
        assert all(n <= lengths[key] for key, n in fetched.items())
    tensor_chunks = [key for key in lengths if key[0].endswith(".safetensors")]
    total = {key: sum(fetched.get(key, 0) for fetched in per_rank) for key in tensor_chunks}
    assert total == {key: lengths[key] for key in tensor_chunks}


def _load_corrupt(url):
    try:
        load_and_check(url, ["shard1"])
    except hdcp.CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_file_url_two_ranks_forwarded_corrupt_chunk_fails_every_rank(tmp_path):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, save_layout, url, "fsdp", timeout=T)
    _corrupt_tensor_object(url)
    errors = run_on_ranks(2, _load_corrupt, url, timeout=T)  # no rank waits forever for a forward
    # The source names the corruption; a rank it could not forward the chunk to names the source.
    assert any("checksum mismatch" in e and "the object is corrupt" in e for e in errors), errors
    assert all("checksum mismatch" in e or ("could not fetch" in e and "to forward it" in e) for e in errors), errors


def test_file_url_two_ranks_async_save(tmp_path):
    url = f"file://{tmp_path}/step-2"
    assert all(run_on_ranks(2, _async_save_layout, url, timeout=T))
    assert all(run_on_ranks(2, load_and_check, url, ["fsdp"], timeout=T))
    assert not [n for n in os.listdir(tmp_path / "step-2") if n.startswith(".")]


def _async_save_layout(url):
    future = hdcp.async_save(distribute_state(full_state(), "fsdp"), checkpoint_id=url)
    return future.result(timeout=60).save_id is not None


# ------------------------------------------------------------------- verify, CheckpointManager

def test_verify_checkpoint_reads_objects(memory_url):
    save_layout(memory_url, None, no_dist=True)
    assert hdcp.is_checkpoint(memory_url) and not hdcp.is_checkpoint(memory_url + "-none")
    assert hdcp.verify_checkpoint(memory_url).save_id
    _corrupt_tensor_object(memory_url)
    with pytest.raises(hdcp.CheckpointError, match=r"checkpoint file memory://.*fails its checksum"):
        hdcp.verify_checkpoint(memory_url)


def _folder(url):
    return url.rsplit("/", 1)[0]


def test_manager_on_memory_url(memory_url):
    folder = _folder(memory_url)
    fs, path = fsspec.core.url_to_fs(folder)
    # A killed save's upload in step-9 (no metadata object) and a foreign object there.
    fs.pipe_file(f"{path}/step-9/__0_0.{'ab' * 16}.safetensors", b"partial")
    fs.pipe_file(f"{path}/step-9/notes.txt", b"not ours")
    manager = hdcp.CheckpointManager(folder, keep_last_n=2)
    assert _names(f"{folder}/step-9") == ["notes.txt"]  # the abandoned upload is gone, nothing else
    for step in (1, 2, 3):
        manager.save(step, full_state(seed=step))
    assert manager.committed_steps() == [2, 3] and manager.latest_step() == 3
    assert not fs.exists(f"{path}/step-1")
    target = blank_state()
    assert manager.load_latest(target) == 3
    assert load_and_check(manager.checkpoint_path(3), [None], seed=3, no_dist=True)
    manager.close()


def test_manager_async_and_corrupt_latest(memory_url):
    folder = _folder(memory_url)
    manager = hdcp.CheckpointManager(folder, keep_last_n=2, async_save=True)
    for step in (1, 2):
        manager.save(step, full_state(seed=step))
    manager.wait()
    assert manager.committed_steps() == [1, 2]
    _corrupt_tensor_object(manager.checkpoint_path(2))
    target = blank_state()
    assert manager.load_latest(target) == 1  # the corrupt newest one is skipped (verify_checkpoint)
    manager.close()


@pytest.mark.parametrize("span_bytes", [32 << 20, 1000])
def test_adjacent_ranges_go_out_as_one_request(memory_url, monkeypatch, span_bytes):
    state = {f"t{i}": torch.arange(64, dtype=torch.float32) + i for i in range(6)}  # 256 B each, one file
    hdcp.save(state, checkpoint_id=memory_url, no_dist=True)
    monkeypatch.setattr(object_reader, "SPAN_BYTES", span_bytes)
    fs = fsspec.filesystem("memory")
    requests = []
    real = type(fs).cat_ranges
    monkeypatch.setattr(type(fs), "cat_ranges", lambda self, paths, *a, **k: requests.append(len(paths))
                        or real(self, paths, *a, **k))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    hdcp.load(target, checkpoint_id=memory_url, no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert requests == ([1] if span_bytes > 1536 else [2])  # 6 chunks of 256 B: one span, or 3 + 3


def test_forward_sources_are_the_checkers_else_the_largest_readers_in_rounds():
    from hyper_parallel.core.distributed_checkpoint.object_store.forwarding import Forward, plan_forwards
    from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import Verification

    a, b, c = (hdcp.MetadataIndex(name, (0, 0)) for name in "abc")

    def item(index, rows):
        return ReadItem(LoadItemType.TENSOR, index, (0, 0), index, (0, 0), (rows, 4))

    plans = [LoadPlan([item(a, 2), item(c, 4)], Verification(True, True, frozenset())),
             LoadPlan([item(a, 2), item(b, 1)], Verification(True, True, frozenset({a}))),
             LoadPlan([item(b, 3)], Verification(True, True, frozenset()))]
    out = plan_forwards(plans, lambda index: 64, round_bytes=100)
    fa, fb = Forward(a, 1, (0,), 64, 0), Forward(b, 2, (1,), 64, 1)  # c: one reader, nothing to forward
    assert [p.storage_data.forwards for p in out] == [(fa,), (fa, fb), (fb,)]
    assert [p.storage_data.verification for p in out] == [p.storage_data for p in plans]
