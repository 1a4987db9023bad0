"""Run torch's own FSDP2 unit-test files against ``hyper_parallel.fully_shard`` on CPU/gloo.

Each selected file is run twice under pytest: once as-is (torch's ``fully_shard``), once with
hyper_parallel's ``fully_shard`` / ``FSDPModule`` / ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
``CPUOffloadPolicy`` / ``register_fsdp_forward_method`` patched in for torch's. The table lists,
per file, what passes with torch and, of those, what passes and fails with ours (first error line).

The patch must reach every process torch's harness starts (``FSDPTest`` spawns one process per
rank), so it is installed by a generated ``sitecustomize.py`` that imports this file and calls
:func:`install_patch`. It replaces the names in ``torch.distributed.fsdp`` and
``torch.distributed._composable.fsdp[.fully_shard]``, and rebinds any global of a test module (or
of ``common_fsdp``) that *is* one of torch's originals, whatever path it was imported from.

The same file is the pytest plugin (``-p torch_fsdp2_conformance``) that streams one JSON line per
test phase to ``$HP_FSDP2_CONFORMANCE_LOG``, so a file killed by its timeout still reports the
tests it finished.

``--cpu-port`` applies the textual rewrites in ``CPU_PORT_REWRITES`` to copies of the files (never
to the originals): older torch test files hard-code CUDA and are skipped whole on CPU.

Example::

    .venv/bin/python tools/torch_fsdp2_conformance.py "$TORCH_FSDP_TESTS" --cpu-port \\
        --files test_fully_shard_init.py --json /tmp/conformance.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

# Named selections (``--set NAME``): the files, and the pytest -k expression within them.
TEST_SETS = {
    # Per-parameter meshes (shard_placement_fn returning ShardPlacementResult: experts on an
    # expert-data mesh). The overlap and memory classes need CUDA (sleeps, memory stats) and
    # skip on CPU; the training test needs 8 ranks.
    "per-param-mesh": (("test_fully_shard_training.py", "test_fully_shard_overlap.py",
                        "test_fully_shard_memory.py"),
                       "shard_placement_fn_tp_ep or PerParamMesh"),
}
IMPL_ENV = "HP_FSDP2_CONFORMANCE_IMPL"
LOG_ENV = "HP_FSDP2_CONFORMANCE_LOG"
MAX_WORLD_ENV = "HP_FSDP2_CONFORMANCE_MAX_WORLD"
PATCHED_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
                 "CPUOffloadPolicy", "register_fsdp_forward_method")
TORCH_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                 "torch.distributed._composable.fsdp.fully_shard")
REBIND_MODULES = re.compile(r"^(_?test_fully_shard\w*|torch\.testing\._internal\.common_fsdp)$")
# (pattern, replacement, why), applied to copies of every file. The stored files come from torch's
# main branch; these drop names the installed torch 2.13 lacks and that do not affect the test.
COMPAT_REWRITES = (
    (r"\n    HardwareClassification,", "", "common_utils name newer than torch 2.13"),
    (r"\n    hw_classification = HardwareClassification\.ACCELERATOR\n", "\n",
     "test-selection tag newer than torch 2.13"),
    (r"\bfrom torch\.distributed\._tensor\.debug import", "from torch.distributed.tensor.debug import",
     "the old alias module is gone in torch 2.13 (same CommDebugMode)"),
)
# (pattern, replacement, why): applied with --cpu-port only.
CPU_PORT_REWRITES = (
    (r"skip_if_lt_x_gpu\((\d+)\)", r"skip_if_lt_x_gpu(\1, allow_cpu=True)",
     "run GPU-count-gated tests on CPU ranks"),
    (r"torch\.cuda\.device_count\(\)", "{world}", "CPU world size instead of the GPU count"),
    (r"torch\.get_device_module\(device_type\)\.device_count\(\)", "{world}",
     "CPU world size instead of the accelerator count"),
    (r"torch\.accelerator\.current_accelerator\(\)\.type", '"cpu"',
     "no accelerator on CPU (the line is overwritten by get_devtype() right after)"),
    (r"device=\"cuda\"", 'device="cpu"', "tensors on CPU"),
    (r"init_device_mesh\(\s*\"cuda\"", 'init_device_mesh("cpu"', "CPU/gloo meshes"),
    (r"\.cuda\(\)", ".cpu()", "modules on CPU"),
    (r"device_ids=\[self\.rank\]", "device_ids=None", "DDP on CPU takes no device_ids"),
    (r"\btest_compiled_fsdp\(", "compiled_fsdp_test(", "helper renamed in common_fsdp"),
    (r"\btest_compiled_fsdp,", "compiled_fsdp_test,", "helper renamed in common_fsdp"),
    (r"\n\s*except_for=\[\"cpu\"\],", "", "instantiate the device-generic classes for CPU too"),
    (r"\"tp_degree\": \[1, 2\]", '"tp_degree": [1]',
     "no TP sub-tests: torch 2.13 has no DTensor sharding rule for CPU flash attention"),
)


# ---------------------------------------------------------------------------------------------
# Patch (runs in every process through the generated sitecustomize.py)
# ---------------------------------------------------------------------------------------------
class _RebindLoader(importlib.abc.Loader):
    """Executes a module, then swaps torch's FSDP2 objects in its globals for ours."""

    def __init__(self, inner: importlib.abc.Loader, swap: dict[int, Any]) -> None:
        self._inner, self._swap = inner, swap

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for key, value in list(vars(module).items()):
            if id(value) in self._swap:
                setattr(module, key, self._swap[id(value)])
        if module.__name__ == "torch.testing._internal.common_fsdp":
            _run_fsdp_test_on_cpu(module)
        elif os.environ.get(MAX_WORLD_ENV):
            _cap_world_size(module, int(os.environ[MAX_WORLD_ENV]))


def _cap_world_size(module: Any, cap: int) -> None:
    """Run the module's multi-process test classes on at most ``cap`` ranks (--max-world-size)."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    for value in list(vars(module).values()):
        if isinstance(value, type) and issubclass(value, MultiProcessTestCase) \
                and isinstance(vars(value).get("world_size"), property):
            world = vars(value)["world_size"].fget
            value.world_size = property(lambda self, world=world: min(world(self), cap))


def _run_fsdp_test_on_cpu(common_fsdp: Any) -> None:
    """Let ``FSDPTest`` run its ranks on CPU, as ``FSDPTestMultiThread`` does.

    In torch 2.13 ``FSDPTest._run`` exits every rank with "Need at least N CUDA devices" when
    ``torch.accelerator.device_count() < world_size``, i.e. always on CPU, although the copy it
    overrides (``FSDPTestMixin._run``, otherwise identical) guards that check with
    ``DEVICE_TYPE != "cpu"``. Use the mixin's copy (both implementations get it).
    """
    common_fsdp.FSDPTest._run = common_fsdp.FSDPTestMixin.__dict__["_run"]


class _RebindFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of test modules and ``common_fsdp`` in :class:`_RebindLoader`."""

    def __init__(self, swap: dict[int, Any], originals: list[Any]) -> None:
        self._swap = swap
        self._originals = originals  # keeps the ids in ``swap`` valid

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not REBIND_MODULES.match(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RebindLoader(spec.loader, self._swap)
        return spec


def ours() -> dict[str, Any]:
    """hyper_parallel's replacements, by torch name; names hyper_parallel lacks are left out."""
    import hyper_parallel

    found = {}
    for name in PATCHED_NAMES:
        try:
            found[name] = getattr(hyper_parallel, name)
        except AttributeError:
            continue
    return found


def install_patch() -> None:
    """Install the import hook; with ``$IMPL_ENV`` == "ours" also swap torch's FSDP2 names."""
    impl = os.environ.get(IMPL_ENV)
    if impl not in ("torch", "ours"):
        return
    swap: dict[int, Any] = {}
    originals = []
    if impl == "ours":
        replacements = ours()
        for module_name in TORCH_MODULES:
            module = importlib.import_module(module_name)
            for name, new in replacements.items():
                old = vars(module).get(name)
                if old is None or old is new:
                    continue
                originals.append(old)
                swap[id(old)] = new
                setattr(module, name, new)
    sys.meta_path.insert(0, _RebindFinder(swap, originals))


# ---------------------------------------------------------------------------------------------
# pytest plugin (loaded with -p torch_fsdp2_conformance)
# ---------------------------------------------------------------------------------------------
_ERROR_LINE = re.compile(r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Failed)\b.*)$")
_TEST_LINE = re.compile(r'(test_fully_shard\w*\.py)(?:", line |:)(\d+)')


def first_error_line(text: str) -> str:
    """The last ``SomethingError: message`` line of a failure text, skipping torch's wrappers,
    prefixed with the last test-file line in the traceback (``file.py:123``)."""
    best = ""
    for line in text.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and "exited with error code" not in line and "Expected zero exit code" not in line:
            best = match.group(1)
    if not best:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        best = lines[-1] if lines else ""
    where = _TEST_LINE.findall(text)
    prefix = f"{where[-1][0]}:{where[-1][1]}: " if where else ""
    return (prefix + best)[:240]


def _log(record: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session: Any) -> None:
    """Record every selected test so a file's timeout shows which tests it cut off."""
    for item in session.items:
        _log({"nodeid": item.nodeid, "when": "collected", "outcome": "collected"})


def pytest_collectreport(report: Any) -> None:
    """Record import/collection errors of a file."""
    if report.failed:
        _log({"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
              "line": first_error_line(report.longreprtext)})


def pytest_runtest_logreport(report: Any) -> None:
    """Record each phase's outcome with its first error line."""
    line = ""
    if report.failed:
        line = first_error_line(report.longreprtext)
    elif report.skipped and isinstance(report.longrepr, tuple):
        line = str(report.longrepr[2])[:200]
    _log({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "line": line})


# ---------------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------------
class Result(NamedTuple):
    """Final outcome of one test under one implementation."""

    outcome: str  # passed | failed | skipped | timeout
    line: str


def fold(records: list[dict[str, Any]], timed_out: bool) -> dict[str, Result]:
    """Fold the per-phase records of one pytest run into one result per test.

    A failed phase wins (its first error line is kept); otherwise the call phase decides; a test
    skipped in setup is skipped; a test collected but never finished timed out (or was not run).
    """
    phases: dict[str, dict[str, tuple[str, str]]] = {}
    for rec in records:
        phases.setdefault(rec["nodeid"], {}).setdefault(rec["when"], (rec["outcome"], rec.get("line", "")))
    results = {}
    for nodeid, seen in phases.items():
        failed = [seen[w] for w in ("collect", "setup", "call", "teardown")
                  if seen.get(w, ("", ""))[0] == "failed"]
        if failed:
            results[nodeid] = Result("failed", failed[0][1])
        elif "call" in seen:
            results[nodeid] = Result(*seen["call"])
        elif seen.get("setup", ("", ""))[0] == "skipped":
            results[nodeid] = Result(*seen["setup"])
        else:
            results[nodeid] = Result("timeout" if timed_out else "not run", "")
    return results


def port_files(src: Path, dst: Path, cpu_port: bool, world: int) -> None:
    """Copy the test files into ``dst``: ``COMPAT_REWRITES`` always, ``CPU_PORT_REWRITES`` too
    with ``cpu_port``. The originals are never modified."""
    rewrites = COMPAT_REWRITES + (CPU_PORT_REWRITES if cpu_port else ())
    for path in src.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for pattern, repl, _why in rewrites:
            text = re.sub(pattern, repl.replace("{world}", str(world)), text)
        (dst / path.name).write_text(text, encoding="utf-8")


def run_pytest(workdir: Path, targets: list[str], impl: str, timeout: int, keyword: str | None,
               max_world: int | None) -> tuple[dict[str, Result], float, bool]:
    """Run pytest on ``targets`` in ``workdir`` with ``impl``; results, seconds, timed out."""
    log = workdir / f"log-{impl}-{time.monotonic_ns()}.jsonl"
    env = dict(os.environ)
    tools_dir = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(workdir / "site"), tools_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if max_world:
        env[MAX_WORLD_ENV] = str(max_world)
    env.update({IMPL_ENV: impl, LOG_ENV: str(log), "CUDA_VISIBLE_DEVICES": "",
                "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--assert=plain", "-p", "torch_fsdp2_conformance", "--rootdir", str(workdir), *targets]
    if keyword:
        cmd += ["-k", keyword]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    records = []
    if log.exists():
        records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return fold(records, timed_out), time.monotonic() - start, timed_out


def table(report: dict[str, Any]) -> str:
    """Per-file counts, then every test that passes with torch and fails with ours."""
    out = [f"{'file':44} {'tests':>5} {'torch ok':>8} {'ours ok':>7} {'ours fail':>9}  seconds"]
    failing = []
    for name, entry in report["files"].items():
        torch_res = {k: Result(*v) for k, v in entry["torch"].items()}
        ours_res = {k: Result(*v) for k, v in entry["ours"].items()}
        torch_ok = [k for k, r in torch_res.items() if r.outcome == "passed"]
        ours_ok = [k for k in torch_ok if ours_res.get(k, Result("not run", "")).outcome == "passed"]
        bad = [k for k in torch_ok if k not in ours_ok]
        seconds = "/".join(f"{entry['seconds'][impl]:.0f}" for impl in ("torch", "ours")
                           if impl in entry["seconds"])
        out.append(f"{name:44} {len(torch_res):5} {len(torch_ok):8} {len(ours_ok):7} "
                   f"{len(bad):9}  {seconds}")
        for key in bad:
            res = ours_res.get(key, Result("not run", ""))
            failing.append(f"  {key}: [{res.outcome}] {res.line}")
        for key, res in torch_res.items():
            if res.outcome == "failed" and res.line and key.endswith(".py"):
                out.append(f"  (torch run: collection error: {res.line})")
    return "\n".join(out + ["", "passes with torch, fails with ours:"] + (failing or ["  none"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?",
                        help="folder holding torch's test_fully_shard_*.py")
    parser.add_argument("--files", nargs="*", help="file names to run (default: all test_*.py)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--set", dest="test_set", choices=sorted(TEST_SETS),
                        help="a named selection of files and tests (TEST_SETS); --files / -k override it")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per file and impl")
    parser.add_argument("--cpu-port", action="store_true", help="apply CPU_PORT_REWRITES")
    parser.add_argument("--world-size", type=int, default=4, help="CPU world size for --cpu-port")
    parser.add_argument("--max-world-size", type=int,
                        help="run multi-process test classes on at most this many ranks")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--rerun-failed", type=Path, metavar="JSON",
                        help="run with ours only the tests a previous --json run found failing")
    parser.add_argument("--show", type=Path, nargs="+", metavar="JSON",
                        help="print the table of earlier --json runs (merged) and exit")
    args = parser.parse_args(argv)
    if args.show:
        merged: dict[str, Any] = {"files": {}}
        for path in args.show:
            for name, entry in json.loads(path.read_text())["files"].items():
                old_entry = merged["files"].setdefault(name, {"torch": {}, "ours": {}, "seconds": {}})
                for impl in ("torch", "ours"):
                    old_entry[impl].update(entry[impl])
                for impl, sec in entry["seconds"].items():
                    old_entry["seconds"][impl] = old_entry["seconds"].get(impl, 0.0) + sec
        print(table(merged))
        return 0
    if args.folder is None:
        parser.error("folder is required unless --show is given")

    previous = json.loads(args.rerun_failed.read_text()) if args.rerun_failed else None
    if args.test_set:
        set_files, set_keyword = TEST_SETS[args.test_set]
        args.files = args.files or [f for f in set_files if (args.folder / f).exists()]
        args.keyword = args.keyword or set_keyword
    files = args.files or sorted(p.name for p in args.folder.glob("test_*.py"))
    import hyper_parallel

    print(f"ours: hyper_parallel from {Path(hyper_parallel.__file__).parent}", flush=True)
    missing = [n for n in PATCHED_NAMES if n not in ours()]
    if missing:
        print(f"hyper_parallel lacks {missing}: torch's are left in place for those", flush=True)
    report: dict[str, Any] = {"cpu_port": args.cpu_port, "files": {}}
    with tempfile.TemporaryDirectory(prefix="fsdp2-conformance-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(
            "import torch_fsdp2_conformance\ntorch_fsdp2_conformance.install_patch()\n")
        port_files(args.folder, work, args.cpu_port, args.world_size)
        for name in files:
            entry: dict[str, Any] = {"torch": {}, "ours": {}, "seconds": {}}
            impls, targets = ("torch", "ours"), [name]
            if previous is not None:
                prev = previous["files"].get(name)
                if prev is None:
                    continue
                entry["torch"] = prev["torch"]
                targets = [k for k, v in prev["torch"].items() if v[0] == "passed"
                           and prev["ours"].get(k, ["not run"])[0] != "passed"]
                impls = ("ours",)
                if not targets:
                    entry["ours"] = prev["ours"]
                    report["files"][name] = entry
                    continue
            for impl in impls:
                if impl == "ours" and previous is None:  # only what passes with torch
                    targets = [k for k, v in entry["torch"].items() if v[0] == "passed"]
                    if not targets:
                        continue
                results, seconds, timed_out = run_pytest(work, targets, impl, args.timeout,
                                                         args.keyword, args.max_world_size)
                entry[impl] = {k: list(v) for k, v in results.items()}
                entry["seconds"][impl] = seconds
                print(f"{name} [{impl}]: {len(results)} tests, {seconds:.0f}s"
                      + (" (TIMEOUT)" if timed_out else ""), flush=True)
            if previous is not None:
                merged = dict(previous["files"][name]["ours"])
                merged.update(entry["ours"])
                entry["ours"] = merged
            report["files"][name] = entry
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
