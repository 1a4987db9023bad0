"""Compose the Hydra config from the command line and validate it before anything starts."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from hyper_parallel.models.llama import LlamaConfig

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
_PRECISIONS = ("fp32", "bf16")
# Keys of the ``model`` group that are recipe options, not LlamaConfig fields.
_MODEL_RECIPE_KEYS = ("name", "activation_checkpointing", "init_from")


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


def llama_config(model_cfg: DictConfig) -> LlamaConfig:
    """The ``LlamaConfig`` described by the ``model`` config group.

    Raises:
        ValueError: inconsistent sizes (e.g. ``dim`` not divisible by ``n_heads``).
    """
    return LlamaConfig(**{k: v for k, v in model_cfg.items() if k not in _MODEL_RECIPE_KEYS})


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
    t, o, c = cfg.training, cfg.optim, cfg.checkpoint
    for key in ("steps", "global_batch_size", "seq_len", "grad_accum_steps"):
        _check_int(problems, f"training.{key}", t[key], minimum=1)
    _check_int(problems, "training.seed", t.seed, minimum=0)
    _check_number(problems, "training.max_grad_norm", t.max_grad_norm, low=0.0, note=" (0 disables clipping)")
    if t.device not in ("auto", "cpu"):
        problems.append(f"training.device={t.device!r} must be 'auto' or 'cpu'")
    if not isinstance(t.compile, bool):
        problems.append(f"training.compile={t.compile!r} must be true or false")
    elif t.compile and t.compile_backend not in _compile_backends():
        problems.append(f"training.compile_backend={t.compile_backend!r} is not a torch.compile "
                        f"backend; known: {_compile_backends()}")
    if dims is not None and not problems:
        ranks_x_accum = dims.dp_size * t.grad_accum_steps
        if t.global_batch_size % ranks_x_accum:
            problems.append(
                f"training.global_batch_size={t.global_batch_size} does not divide over "
                f"{dims.dp_size} data-parallel ranks x training.grad_accum_steps={t.grad_accum_steps}"
                f" (needs a multiple of {ranks_x_accum})"
            )
    try:
        llama_config(cfg.model)
    except (ValueError, TypeError) as err:
        problems.append(f"model: {err}")
    if _is_int(t.seq_len) and t.seq_len > cfg.model.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.parallel.mixed_precision not in _PRECISIONS:
        problems.append(f"parallel.mixed_precision={cfg.parallel.mixed_precision!r} must be one of {_PRECISIONS}")
    if o.name != "adamw":
        problems.append(f"optim.name={o.name!r}: only 'adamw' is available")
    _check_number(problems, "optim.lr", o.lr, low=0.0, low_inclusive=False)
    _check_int(problems, "optim.warmup_steps", o.warmup_steps, minimum=0)
    _check_number(problems, "optim.min_lr_ratio", o.min_lr_ratio, low=0.0, high=1.0)
    _check_int(problems, "checkpoint.interval", c.interval, minimum=1)
    _check_int(problems, "checkpoint.keep_last_n", c.keep_last_n, minimum=1)
    _check_int(problems, "logging.log_every", cfg.logging.log_every, minimum=1)
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("logging.tensorboard=true needs the 'tensorboard' package "
                        "(pip install tensorboard), or set logging.tensorboard=false")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return dims


def _compile_backends() -> List[str]:
    import torch

    return torch.compiler.list_backends(exclude_tags=())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(problems: List[str], name: str, value: Any, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        problems.append(f"{name}={value!r} must be {what}")


def _check_number(problems: List[str], name: str, value: Any, *, low: float,
                  high: Optional[float] = None, low_inclusive: bool = True, note: str = "") -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    in_range = is_number and (value >= low if low_inclusive else value > low) and (high is None or value <= high)
    if not in_range:
        bound = (">= " if low_inclusive else "> ") + str(low) if high is None else f"in [{low}, {high}]"
        problems.append(f"{name}={value!r} must be a number {bound}{note}")
