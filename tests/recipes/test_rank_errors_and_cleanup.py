"""Under torchrun a problem reaches the user from whichever rank meets it (torchrun stops the
other ranks with SIGTERM as soon as one exits), and an interrupted test session leaves no
recipe rank running."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
import time

from tests.recipes.launch import RECIPE, TINY, finish, run, start, torchrun_cmd


def test_a_problem_only_one_rank_meets_reaches_the_user_under_torchrun(tmp_path):
    (tmp_path / "hf0").mkdir()  # model.init_from of rank 0 is a folder, rank 1's does not exist
    per_rank = f"model.init_from={tmp_path}/hf${{oc.env:RANK}}"
    result = run(torchrun_cmd(2, [*TINY, f"output_dir={tmp_path}/out", per_rank], extra=["--standalone"]), timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: (rank 1 of 2) model.init_from={tmp_path}/hf1 is not a folder"], result.stderr
    assert result.returncode != 0


def _wait_until_sigterm_is_caught(pid: int, timeout: float = 60) -> None:
    """Until process ``pid`` has a SIGTERM handler (/proc's SigCgt mask)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"the recipe did not catch SIGTERM within {timeout}s")


def test_a_sigterm_during_the_start_up_checks_waits_for_the_ranks_error_line(tmp_path):
    rank_1_of_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    # Two ranks 1 at once: one with a problem in its config, one without (its checks pass).
    failing = start([sys.executable, RECIPE, *TINY, f"output_dir={tmp_path}", "parallel.pp_schedule=GPipe"],
                    stderr=subprocess.PIPE, extra_env=rank_1_of_2)
    passing = start([sys.executable, RECIPE, *TINY, f"output_dir={tmp_path}", "--check"], extra_env=rank_1_of_2)
    for proc in (failing, passing):
        _wait_until_sigterm_is_caught(proc.pid)  # (from its first lines on, before torch is imported)
        proc.send_signal(signal.SIGTERM)  # as torchrun does when another rank exited first
    _, err = failing.communicate(timeout=120)
    assert (failing.returncode, err) == (2, "error: (rank 1 of 2) parallel.pp_schedule=GPipe needs parallel.pp > 1 "
                                            "(it has no effect with parallel.pp=1); set parallel.pp or remove it\n")
    # A rank without a problem ends by the held SIGTERM once the checks are done (never trains).
    out = finish(passing, timeout=120)
    assert passing.returncode == -signal.SIGTERM and "config OK" not in out, out


_INTERRUPTED_SESSION = '''
import os, time

from tests.recipes.launch import TINY, start, torchrun_cmd, wait_for_step, worker_pids


def test_a_long_job(tmp_path):
    # Quiet after step 1: a rank printing into the pipe of the ended session would fail by itself.
    long = [o for o in TINY if not o.startswith(("logging.log_every=", "training.steps="))]
    proc = start(torchrun_cmd(2, [*long, "logging.log_every=1000000", "training.steps=1000000",
                                  "checkpoint.interval=1000000", f"output_dir={tmp_path}"], extra=["--standalone"]))
    wait_for_step(str(tmp_path), 2, proc, timeout=240)
    with open(os.environ["PIDS_FILE"] + ".tmp", "w") as f:
        f.write(" ".join(map(str, [proc.pid, *worker_pids(proc.pid).values()])))
    os.rename(os.environ["PIDS_FILE"] + ".tmp", os.environ["PIDS_FILE"])
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # the test harness's own cleanup
def test_interrupting_a_test_session_ends_the_ranks_it_started(tmp_path):
    (tmp_path / "test_inner.py").write_text(_INTERRUPTED_SESSION)
    pids_file = tmp_path / "pids"
    session = start([sys.executable, "-m", "pytest", "-q", "-p", "tests.recipes.conftest", "-p", "no:cacheprovider",
                     "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                    extra_env={"PIDS_FILE": str(pids_file)})
    deadline = time.monotonic() + 180
    while not pids_file.exists():
        assert session.poll() is None and time.monotonic() < deadline, finish(session, timeout=10)
        time.sleep(0.1)
    pids = [int(pid) for pid in pids_file.read_text().split()]
    assert len(pids) == 3 and all(_alive(pid) for pid in pids)  # torchrun and its 2 ranks
    session.send_signal(signal.SIGINT)  # Ctrl-C
    output = finish(session, timeout=120)
    assert "KeyboardInterrupt" in output, output
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], output
