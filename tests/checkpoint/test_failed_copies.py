"""After a failure, staging slabs go back to the pool only once the copies into or out of
them have completed (the next save or load reuses them on a fresh stream, unordered after
the old one).

On CPU the copy stream's events are None (copies are synchronous), so these tests give
:class:`CopyStream` events that model a stream: ``record()`` marks the copies issued so far,
``synchronize()`` of an event completes everything recorded up to it. Each slab handed back
must find every recorded copy completed (in these failure paths nothing is handed back
earlier, so that is exactly the rule).
"""

from __future__ import annotations

import os
import threading
from typing import List

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import BounceReads
from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import StagingBuffers
from hyper_parallel.platform.copy_stream import CopyStream
from tests.checkpoint.helpers import BOX_COLS, BOX_ROWS, AppliedBoxes, FailingStagingPlanner, FullDiskWriter, box_read


class _StreamModel:
    """Events in issue order on one modelled stream, and the slabs given back too early."""

    def __init__(self) -> None:
        self.recorded = self.completed = 0
        self.early: List[int] = []  # copies still in flight at each premature give_back
        self.lock = threading.Lock()


class _Event:
    def __init__(self, model: _StreamModel) -> None:
        self._model = model
        with model.lock:
            model.recorded += 1
            self._seq = model.recorded

    def synchronize(self) -> None:
        with self._model.lock:
            self._model.completed = max(self._model.completed, self._seq)

    def query(self) -> bool:
        return self._seq <= self._model.completed


@pytest.fixture
def stream_model(monkeypatch):
    model = _StreamModel()
    monkeypatch.setattr(CopyStream, "record", lambda self: _Event(model))
    give_back = StagingBuffers.give_back

    def checked_give_back(pool, window, slab):
        with model.lock:
            if model.completed < model.recorded:
                model.early.append(model.recorded - model.completed)
        give_back(pool, window, slab)

    monkeypatch.setattr(StagingBuffers, "give_back", checked_give_back)
    return model


class _FailingApply(AppliedBoxes):
    def apply_tensor(self, read_item, tensor):
        raise RuntimeError("apply_tensor broke (simulated)")


def test_a_failing_load_gives_slabs_back_after_their_copies(tmp_path, stream_model):
    pool = StagingBuffers(slab_bytes=1024, budget_bytes=4096, sync_window_bytes=4096)
    path = str(tmp_path / "chunks.bin")
    with open(path, "wb") as f:
        f.write(torch.arange(2 * BOX_ROWS * BOX_COLS, dtype=torch.float64).numpy().tobytes())
    reader = BounceReads(pool, pool.window(snapshot=False), _FailingApply(), torch.device("cpu"))
    fd = os.open(path, os.O_RDONLY)
    try:
        for b in range(2):  # two boxes, a slab each; the first one's apply_tensor fails in finish
            dest = torch.zeros(BOX_COLS, BOX_ROWS, dtype=torch.float64).t()
            reader.read(fd, path, b * BOX_ROWS * BOX_COLS * 8, (BOX_ROWS, BOX_COLS), box_read(f"b{b}"), dest,
                        torch.float64)
        with pytest.raises(RuntimeError, match="simulated"):
            reader.finish()
    finally:
        os.close(fd)
    assert pool.in_use == 0 and stream_model.recorded >= 2
    assert stream_model.early == []


@pytest.mark.timeout(60)
def test_a_failing_save_gives_slabs_back_after_their_copies(tmp_path, stream_model):
    """Staging fails after copying five chunks that no writer consumed (the writer failed
    first): the slabs go back only once those copies completed."""
    pool = hdcp.staging_buffers()
    hdcp.wait_for_pending_save()
    state = {"small": {f"b{i}": torch.full((64,), float(i)) for i in range(8)}}  # b5 fails
    path = str(tmp_path / "ckpt")
    with pytest.raises((RuntimeError, OSError), match="simulated"):
        hdcp.async_save(state, checkpoint_id=path, no_dist=True, planner=FailingStagingPlanner(),
                        storage_writer=FullDiskWriter(path)).result(timeout=30)
    hdcp.wait_for_pending_save()
    assert pool.in_use == 0 and stream_model.recorded >= 2
    assert stream_model.early == []
