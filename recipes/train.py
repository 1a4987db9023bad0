"""Train a Llama-style model with FSDP/HSDP from the Hydra config in configs/train.yaml.

    torchrun --nproc_per_node=N recipes/train.py [hydra overrides, e.g. training.steps=50 parallel=hsdp]

Resumes from the latest complete checkpoint in ``checkpoint.folder`` (on any mesh shape).
``--cfg`` prints the composed config and exits. ``--check`` validates the config and the
machine (folders, earlier checkpoints, memory) for WORLD_SIZE ranks, LOCAL_WORLD_SIZE of
them on this machine (defaults 1), without starting training; ``--check --world-size N
[--ranks-per-node M]`` checks the layout of N ranks, M of them on this machine (default N),
whatever the environment says. scripts/train.sh runs it before torchrun. ``--help`` shows this text. Exit codes: 0 done (also after a SIGTERM stop
with its final checkpoint), 2 a problem reported in one line (under torchrun by every rank that
meets it, as ``error: (rank R of N) ...``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

# [Note: SIGTERM during the start-up checks] torchrun stops every rank with SIGTERM as soon as
# one rank exits. A rank that meets a config or preflight problem prints its line and exits 2;
# the other ranks, still importing or checking, would die before printing theirs, and a rank
# that met a problem of its own would take it along. So until the checks are done a SIGTERM is
# held: a rank with a problem still prints it and exits 2, one without dies of the SIGTERM then.
_held_signals: list[int] = []


def _hold_sigterm(signum: int, frame: object) -> None:
    _held_signals.append(signum)


def _release_sigterm() -> None:
    """SIGTERM's default action back; one held meanwhile ends the process now, as it would have."""
    if signal.getsignal(signal.SIGTERM) is _hold_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if _held_signals:
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":  # (before the slow imports; not when a test imports main)
    signal.signal(signal.SIGTERM, _hold_sigterm)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run from a checkout whether or not (or however) the package is installed.
sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hyper_parallel.platform import init_distributed  # noqa: E402
from hyper_parallel.trainer import ConfigError, compose_config, run_training, validate_config  # noqa: E402
from hyper_parallel.trainer.step.agreement import JobFailed  # noqa: E402
from hyper_parallel.trainer.launch.preflight import check_environment  # noqa: E402

CONFIG_DIR = os.path.join(REPO, "configs")
FLAGS = ("--cfg", "--check")
SIZE_OPTIONS = ("--world-size", "--ranks-per-node")
EXIT_PROBLEM = 2


def _env_int(name: str) -> int:
    return int(os.environ.get(name, 1))


def _size_options(argv: list[str]) -> tuple[list[str], dict[str, int]]:
    """(argv without ``--world-size N`` / ``--ranks-per-node M`` (or ``=N``), their values).

    Raises:
        ConfigError: a value that is not a positive integer, or the options without ``--check``.
    """
    rest, found, i = [], {}, 0
    while i < len(argv):
        name, sep, value = argv[i].partition("=")
        if name in SIZE_OPTIONS:
            if not sep:
                value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{name} takes a positive number of ranks, not {value!r}")
            found[name] = int(value)
        else:
            rest.append(argv[i])
        i += 1
    if found and "--check" not in rest:
        raise ConfigError(f"{', '.join(found)} only go with --check (under torchrun the world is torchrun's)")
    return rest, found


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    world_size = _env_int("WORLD_SIZE")
    try:
        argv, sizes = _size_options(argv)
        world_size = sizes.get("--world-size", world_size)
        ranks_per_node = sizes.get("--ranks-per-node", world_size if "--world-size" in sizes
                                   else _env_int("LOCAL_WORLD_SIZE"))
        cfg = compose_config([a for a in argv if a not in FLAGS], config_dir=CONFIG_DIR)
        config = validate_config(cfg, world_size)
        if "--cfg" not in argv:
            check_environment(config.cfg, config.dims, ranks_per_node=ranks_per_node,
                              meta_model=config.meta_model)
    except ConfigError as err:
        # Every rank that meets it says it (torchrun may stop the others before they do).
        print(f"error: {_rank_prefix(argv, world_size)}{err}", file=sys.stderr, flush=True)
        return EXIT_PROBLEM
    _release_sigterm()
    if "--cfg" in argv:
        print(OmegaConf.to_yaml(cfg))
        return 0
    if "--check" in argv:
        print(f"config OK for {world_size} rank(s)")
        return 0
    platform = init_distributed()
    try:
        run_training(config, platform)
    except JobFailed as failure:
        # Every rank raised it at the same point; the ranks that found the problem say what it
        # is. No process-group teardown (a peer may already be gone).
        message = failure.report(platform.rank, platform.world_size)
        if message:
            print(f"error: {message}", file=sys.stderr, flush=True)
        _exit_now(EXIT_PROBLEM)
    dist.destroy_process_group()
    # [Note: exit without interpreter teardown] A gloo worker thread may still be dropping a
    # finished collective's tensors (a barrier's prior work) when the interpreter finalizes;
    # the decref then needs the GIL, Python < 3.14 ends such a thread inside a C++ destructor
    # and the rank aborts ("terminate called without an active exception", exit -6) after a
    # successful run. Everything the job writes is closed and flushed by now.
    _exit_now(0)


def _rank_prefix(argv: list[str], world_size: int) -> str:
    """``(rank R of N) `` for a rank of a job of several ranks, else nothing (``--check``)."""
    if "--check" in argv or world_size == 1:
        return ""
    return f"(rank {os.environ.get('RANK', 0)} of {world_size}) "


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
