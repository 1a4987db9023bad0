"""A peer that dies during ``async_save`` (ranks started without torchrun) is noticed
by the survivor within seconds (heartbeat markers), not after the 1800 s commit timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from hyper_parallel.platform import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RANK = textwrap.dedent("""
    import datetime, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from hyper_parallel import checkpoint as hdcp

    rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

    class DiesMidWrite(hdcp.FileSystemWriter):
        def execute_write(self, plan, planner):
            result = super().execute_write(plan, planner)
            if self.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # files written, result never published
            return result

    future = hdcp.async_save({"w": torch.arange(1000.0) + rank * 0, "step": 3}, checkpoint_id=path,
                             storage_writer=DiesMidWrite(sync_files=False))
    start = time.monotonic()
    error = future.exception(timeout=120)
    print(f"{time.monotonic() - start:.1f} {type(error).__name__}: {error}", flush=True)
    os._exit(0)  # the process group cannot be shut down cleanly without the dead peer
""")


def test_dead_peer_during_async_save_is_detected_in_seconds(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = str(free_port())
    path = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": REPO, "HYPER_PARALLEL_DEVICE": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, path], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    started = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=150)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == -9
    assert "CheckpointError" in out and "rank 1 stopped responding" in out, (out, err[-2000:])
    waited = float(out.split()[0])
    assert waited < 30, f"the survivor waited {waited:.0f}s"
    assert time.monotonic() - started < 140
    assert not os.path.exists(path)
