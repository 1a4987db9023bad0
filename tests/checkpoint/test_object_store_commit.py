"""The object store commit protocol's waits on memory://: what a rank reads while it polls."""

from __future__ import annotations

import threading
import time

import pytest

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from tests.checkpoint.helpers import full_state

fsspec = pytest.importorskip("fsspec", reason="object storage needs fsspec (pip install 'hyper_parallel[s3]')")


@pytest.fixture
def memory_url(request):
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name.replace('[', '-').replace(']', '')}"
    yield f"memory://{root}/step-1"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_waiting_rank_does_not_reread_the_replaced_metadata_while_others_write(memory_url, monkeypatch):
    hdcp.save(full_state(seed=1), checkpoint_id=memory_url, no_dist=True)  # the checkpoint being replaced
    fs, path = fsspec.core.url_to_fs(memory_url)
    writer = hdcp.FsspecWriter(memory_url, commit_timeout_s=30)
    writer.initialize_writer(None)
    writer.configure_writer(False, rank=1, world_size=2)
    save_id = "cd" * 16
    marker = f"{path}/{store.DONE_MARKER.format(1, save_id)}"
    fs.pipe_file(marker, b"{}")  # rank 1 published its part; the coordinator has not collected it yet
    reads = []
    real_read = store.read_metadata
    monkeypatch.setattr(store, "read_metadata", lambda *a: reads.append(1) or real_read(*a))
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("md", writer.wait_committed(SavePlan([], save_id=save_id))))
    waiter.start()
    time.sleep(1.0)  # several polls while the other ranks still write
    assert reads == []
    # The coordinator collects the marker, then commits the new metadata.
    metadata = real_read(fs, path, memory_url)
    metadata.save_id = save_id
    fs.rm(marker)
    fs.pipe_file(f"{path}/{METADATA_FILE}", metadata.to_json().encode())
    waiter.join(timeout=30)
    assert result["md"].save_id == save_id and len(reads) == 1
