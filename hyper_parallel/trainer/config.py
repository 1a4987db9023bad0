"""Compose the Hydra config from the command line and validate it before anything starts."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import List, Sequence

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
_PRECISIONS = ("fp32", "bf16")


class ConfigError(ValueError):
    """The configuration cannot run; the message lists every problem found."""


@dataclass(frozen=True)
class ParallelDims:
    """The data-parallel layout: ``replicate`` x ``shard`` ranks."""

    replicate: int
    shard: int

    @property
    def dp_size(self) -> int:
        return self.replicate * self.shard


def compose_config(overrides: Sequence[str], config_dir: str = CONFIG_DIR,
                   config_name: str = "train") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with Hydra command-line ``overrides``.

    Uses Hydra's compose API, so nothing changes the working directory or writes ``.hydra``
    folders. The result is resolved and in struct mode (unknown keys are errors).

    Raises:
        ConfigError: a malformed override, an unknown key or group option, or a value that
            does not resolve (the message says which).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        cause = f"\n{str(err.__cause__).splitlines()[0]}" if err.__cause__ else ""
        raise ConfigError(_first_lines(str(err)) + cause) from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def _first_lines(message: str, limit: int = 6) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])


def resolve_parallel(cfg: DictConfig, world_size: int) -> ParallelDims:
    """The mesh shape from ``parallel.dp_replicate`` / ``parallel.dp_shard`` (-1: the rest).

    Raises:
        ConfigError: the shape does not multiply to ``world_size``.
    """
    replicate, shard = int(cfg.parallel.dp_replicate), int(cfg.parallel.dp_shard)
    if replicate < 1:
        raise ConfigError(f"parallel.dp_replicate={replicate} must be >= 1")
    if shard == -1:
        if world_size % replicate:
            raise ConfigError(
                f"parallel.dp_replicate={replicate} does not divide the world size {world_size}"
            )
        shard = world_size // replicate
    if shard < 1 or replicate * shard != world_size:
        raise ConfigError(
            f"parallel.dp_replicate={replicate} x parallel.dp_shard={cfg.parallel.dp_shard} does not "
            f"factor the world size {world_size} (use dp_shard=-1 for the rest of the world)"
        )
    return ParallelDims(replicate, shard)


def validate_config(cfg: DictConfig, world_size: int) -> ParallelDims:
    """Check every value the recipe relies on; return the data-parallel layout.

    Raises:
        ConfigError: listing all problems found (mesh, batch split, ranges, choices).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("required value(s) not set: " + ", ".join(missing)
                          + " (pass them as overrides, e.g. " + missing[0] + "=...)")
    problems: List[str] = []
    dims = None
    try:
        dims = resolve_parallel(cfg, world_size)
    except ConfigError as err:
        problems.append(str(err))
    t = cfg.training
    for key in ("steps", "global_batch_size", "seq_len", "grad_accum_steps"):
        if not isinstance(t[key], int) or t[key] < 1:
            problems.append(f"training.{key}={t[key]!r} must be a positive integer")
    if not isinstance(t.seed, int) or t.seed < 0:
        problems.append(f"training.seed={t.seed!r} must be a non-negative integer")
    if t.max_grad_norm < 0:
        problems.append(f"training.max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    if t.device not in ("auto", "cpu"):
        problems.append(f"training.device={t.device!r} must be 'auto' or 'cpu'")
    if dims is not None and not problems:
        ranks_x_accum = dims.dp_size * t.grad_accum_steps
        if t.global_batch_size % ranks_x_accum:
            problems.append(
                f"training.global_batch_size={t.global_batch_size} does not divide over "
                f"{dims.dp_size} data-parallel ranks x training.grad_accum_steps={t.grad_accum_steps}"
                f" (needs a multiple of {ranks_x_accum})"
            )
    if isinstance(t.seq_len, int) and t.seq_len > cfg.model.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.parallel.mixed_precision not in _PRECISIONS:
        problems.append(f"parallel.mixed_precision={cfg.parallel.mixed_precision!r} must be one of {_PRECISIONS}")
    o = cfg.optim
    if o.name != "adamw":
        problems.append(f"optim.name={o.name!r}: only 'adamw' is available")
    if not o.lr > 0:
        problems.append(f"optim.lr={o.lr} must be > 0")
    if o.warmup_steps < 0 or not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optim.warmup_steps={o.warmup_steps} must be >= 0 and optim.min_lr_ratio="
                        f"{o.min_lr_ratio} in [0, 1]")
    c = cfg.checkpoint
    if not isinstance(c.interval, int) or c.interval < 1:
        problems.append(f"checkpoint.interval={c.interval!r} must be a positive integer")
    if not isinstance(c.keep_last_n, int) or c.keep_last_n < 1:
        problems.append(f"checkpoint.keep_last_n={c.keep_last_n!r} must be a positive integer")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("logging.tensorboard=true needs the 'tensorboard' package "
                        "(pip install tensorboard), or set logging.tensorboard=false")
    if cfg.logging.log_every < 1:
        problems.append(f"logging.log_every={cfg.logging.log_every} must be >= 1")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return dims
