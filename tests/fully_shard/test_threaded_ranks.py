"""fully_shard with ranks as threads of one process (torch's MultiThreadedTestCase harness):
the per-process caches (world mesh, post-forward subgroups) must be per rank."""

import subprocess
import sys


def test_ranks_as_threads_of_one_process():
    # A fresh process: the threaded process group patches torch.distributed globally, and a
    # deadlock must fail the test (timeout), not hang the suite.
    proc = subprocess.run([sys.executable, "-m", "tests.fully_shard._threaded_ranks"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
