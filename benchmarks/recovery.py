"""What a failure costs the recipe: from ``kill -9`` of one worker to the first resumed step, and
the steps lost, with in-memory snapshots every ``--memory-interval`` steps (``checkpoint.memory_interval``, default
every step) against
durable checkpoints only (every ``--durable-interval`` steps, local disk); and the step-time cost
of the snapshots.

Each case runs ``recipes/train.py`` under ``torchrun --standalone --max-restarts=1`` on
``--world`` CPU ranks, kills rank 1 (SIGKILL) once step ``--kill-after`` is logged, and times,
from the kill, the appearance of the first step logged after the restart (``metrics.jsonl`` is
polled every 10 ms); "steps lost" is the newest step logged before the kill minus the step the
job resumed at (the ``"recovered"`` row's step). The recovery itself (agreeing, fetching, loading) is the ``seconds`` of the
``"recovered"`` row. The step time is the training loop's wall time over its steps (the summary
line: saves and snapshots included) of uninterrupted runs with and without snapshots, the modes
alternating ``--rounds`` times, with how many snapshots were taken and how many due steps were
deferred (a snapshot due while the previous one is in flight waits for the next step);
``--step-cost-only`` measures only that.

    python benchmarks/recovery.py [--model llama_50m] [--seq 128] [--batch 4] [--world 2]
        [--steps 16] [--kill-after 8] [--durable-interval 5] [--memory-interval 1] [--rounds 2] [--dir /tmp/hp_recovery]
        [--memory-dir /dev/shm/hp_recovery] [--s3] [--step-cost-only]

``--s3`` adds a case with the durable checkpoints on a moto S3 server started on 127.0.0.1 (needs
``moto[server]``, ``boto3`` and ``s3fs``; stopped by its pid at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "recipes", "train.py")
sys.path.insert(0, REPO)
from tests.recipes.launch import worker_pids  # noqa: E402  (the ranks a torchrun agent started)


def _rows(output_dir: str) -> List[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]


def _overrides(args: argparse.Namespace, output_dir: str, extra: List[str]) -> List[str]:
    return [f"model={args.model}", f"training.seq_len={args.seq}", f"training.global_batch_size={args.batch * args.world}",
            f"training.steps={args.steps}", "optim.warmup_steps=2", "logging.log_every=1000", f"output_dir={output_dir}",
            *extra]


def _start(args: argparse.Namespace, overrides: List[str], restarts: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_DEVICE": "cpu", "PYTHONPATH": REPO, **args.env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           f"--max-restarts={restarts}", "--monitor-interval=0.1", RECIPE, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, log: str) -> str:
    """Wait for the job; its output (the agents' lines carry times) is kept in ``log``."""
    out, _ = proc.communicate(timeout=3600)
    with open(log, "w") as f:
        f.write(out)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}):\n{out}")
    return out


def recovery(args: argparse.Namespace, name: str, extra: List[str]) -> Dict[str, float]:
    """One killed run: seconds from the kill to the first resumed step, steps lost, recovery seconds."""
    out = os.path.join(args.dir, re.sub(r"\W+", "_", name))
    shutil.rmtree(out, ignore_errors=True)
    proc = _start(args, _overrides(args, out, extra), restarts=1)
    while not any(r.get("step", 0) >= args.kill_after for r in _rows(out) if "event" not in r):
        if proc.poll() is not None:
            raise SystemExit(f"{name}: the job ended before step {args.kill_after}:\n{proc.stdout.read()}")
        time.sleep(0.01)
    before = len(_rows(out))
    workers = worker_pids(proc.pid)
    killed_at = time.perf_counter()
    os.kill(workers[1], signal.SIGKILL)
    newest_before = max(r["step"] for r in _rows(out)[:before] if "event" not in r)
    while True:  # the restarted job's "recovered" row, then its first step
        rows = _rows(out)[before:]
        at = next((i for i, r in enumerate(rows) if r.get("event") == "recovered"), None)
        if at is not None and any("event" not in r for r in rows[at + 1:]):
            break
        if proc.poll() is not None:
            raise SystemExit(f"{name}: the job ended without a recovery row:\n{proc.stdout.read()}")
        time.sleep(0.01)
    first_step_after = time.perf_counter() - killed_at
    _finish(proc, out + ".log")
    event = rows[at]
    return {"kill_to_first_step_s": first_step_after, "steps_lost": newest_before - event["step"],
            "recovery_s": event["seconds"], "from": event["from"]}


def step_time(args: argparse.Namespace, name: str, extra: List[str]) -> Tuple[float, str]:
    """Seconds per step of an uninterrupted run: its training loop's wall time (the run's
    summary line, saves and snapshots included) over its steps; and how many snapshots were
    taken and deferred (its console line, "" without snapshots)."""
    out = os.path.join(args.dir, "steps_" + re.sub(r"\W+", "_", name))
    shutil.rmtree(out, ignore_errors=True)
    output = _finish(_start(args, _overrides(args, out, extra), 0), out + ".log")
    summary = re.search(r"done: steps 0 -> (\d+) in ([0-9.]+)s", output)
    counts = re.search(r"memory snapshots: (\d+) taken, (\d+) due", output)
    return float(summary.group(2)) / int(summary.group(1)), f"{counts.group(1)}/{counts.group(2)}" if counts else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama_50m")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--durable-interval", type=int, default=5)
    parser.add_argument("--memory-interval", type=int, default=1, help="checkpoint.memory_interval of the snapshot case")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/hp_recovery")
    parser.add_argument("--memory-dir", default="/dev/shm/hp_recovery", help="checkpoint.memory_dir (a tmpfs)")
    parser.add_argument("--s3", action="store_true", help="also durable checkpoints on a local moto S3 server")
    parser.add_argument("--step-cost-only", action="store_true", help="only the step-time cost (no killed runs)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    memory = args.memory_dir
    snapshots = "memory snapshots every " + ("step" if args.memory_interval == 1 else f"{args.memory_interval} steps")
    cases = {
        "durable only": [f"checkpoint.interval={args.durable_interval}"],
        snapshots: [f"checkpoint.interval={args.durable_interval}", f"checkpoint.memory_interval={args.memory_interval}",
                    f"checkpoint.memory_dir={memory}"],
    }
    args.env, server = {}, None
    if args.s3:
        server, args.env = _s3_server()
        cases["durable only, S3 (moto)"] = [f"checkpoint.interval={args.durable_interval}",
                                            f"checkpoint.folder=s3://bench/run-{int(time.time())}"]
    try:
        _report(args, cases)
    finally:
        if server is not None:
            server.terminate()  # the moto server this process started, by its pid
            server.wait()


def _s3_server():
    """A moto S3 server on loopback (this process's child) with a bucket ``bench``, and the
    environment that points botocore at it."""
    import boto3
    from hyper_parallel.platform import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", endpoint.rsplit(":", 1)[1]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in env.items()
                                                         if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
                         region_name="us-east-1").create_bucket(Bucket="bench")
            return server, env
        except Exception:  # not listening yet
            time.sleep(0.2)
    server.terminate()
    raise SystemExit(f"the moto server did not answer on {endpoint}")


def _report(args: argparse.Namespace, cases: Dict[str, List[str]]) -> None:
    print(f"# {args.model}, seq {args.seq}, {args.batch} sequences per rank, {args.world} CPU ranks, "
          f"kill -9 of rank 1 after step {args.kill_after}, durable checkpoints every {args.durable_interval} steps")
    if not args.step_cost_only:
        print("| case | kill -> first resumed step (s) | steps lost | recovery row (s) | from |")
        print("|---|---|---|---|---|")
        for name, extra in cases.items():
            r = recovery(args, name, extra)
            print(f"| {name} | {r['kill_to_first_step_s']:.2f} | {r['steps_lost']} | {r['recovery_s']:.3f} "
                  f"| {r['from']} |", flush=True)
    local = list(cases)[:2]  # the step-time cost: durable checkpoints on disk, without and with snapshots
    times: Dict[str, List[float]] = {name: [] for name in local}
    counts: Dict[str, List[str]] = {name: [] for name in local}
    for i in range(args.rounds):
        for name in (local if i % 2 == 0 else reversed(local)):
            seconds, taken = step_time(args, name, cases[name])
            times[name].append(seconds)
            counts[name].append(taken)
    base = statistics.median(times["durable only"])
    print("\n| case | seconds per step (training loop wall time / steps), per round | ratio to durable only "
          "| snapshots taken / due steps deferred, per round |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values) / base:.3f} "
              f"| {', '.join(c for c in counts[name] if c) or '-'} |")


if __name__ == "__main__":
    main()
