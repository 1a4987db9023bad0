"""Compose the Hydra config from the command line and validate it before anything starts."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set

from omegaconf import DictConfig, OmegaConf

from hyper_parallel._optional import available, install_hint
from hyper_parallel.models.llama import LlamaConfig
from hyper_parallel.trainer.schema import SCHEMA, all_keys, schema_problems, unknown_key_message

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
# Hydra's message for an override of a key the config lacks.
_UNKNOWN_OVERRIDE = re.compile(r"Could not override '([^']+)'\.\s*To append to your config")
# Keys of the ``model`` group that are recipe options, not LlamaConfig fields.
MODEL_RECIPE_KEYS = ("name", "activation_checkpointing", "init_from")


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
    return LlamaConfig(**{k: v for k, v in model_cfg.items() if k not in MODEL_RECIPE_KEYS})


def model_overrides(model_cfg: DictConfig, config_dir: str = CONFIG_DIR) -> Dict[str, Any]:
    """The model-shape keys that differ from the preset ``configs/model/<name>.yaml`` (empty
    when there is no such preset)."""
    path = os.path.join(config_dir, "model", f"{model_cfg.name}.yaml")
    if not os.path.isfile(path):
        return {}
    preset = OmegaConf.load(path)
    return {k: v for k, v in model_cfg.items()
            if k not in MODEL_RECIPE_KEYS and k in preset and preset[k] != v}


def compose_config(overrides: Sequence[str], config_dir: str = CONFIG_DIR,
                   config_name: str = "train") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with Hydra command-line ``overrides``.

    Uses Hydra's compose API, so nothing changes the working directory or writes ``.hydra``
    folders. The result is resolved and in struct mode. Keys added with ``+`` are accepted
    here and refused by :func:`validate_config`, like every other key the schema lacks.

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
        unknown = _UNKNOWN_OVERRIDE.match(str(err))
        if unknown:  # Hydra's own hint ("use +key=...") leads to a key nothing reads
            raise ConfigError(unknown_key_message(unknown.group(1), all_keys())) from None
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
    """Check every key against the schema and the keys against each other; return the
    data-parallel layout.

    Raises:
        ConfigError: listing all problems found (unknown keys, types, ranges, mesh, batch
            split, model shape).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("required value(s) not set: " + ", ".join(missing)
                          + " (pass them as overrides, e.g. " + missing[0] + "=...)")
    problems = schema_problems(cfg)
    dims, relations = _relation_problems(cfg, world_size, bad=set(problems))
    listing = list(problems.values()) + relations
    if listing:
        raise ConfigError(problems_message("invalid configuration", listing))
    return dims


def problems_message(header: str, problems: Sequence[str]) -> str:
    """One problem on one line; several as ``header:`` and one ``- problem`` line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{header}:\n  - " + "\n  - ".join(problems)


def _relation_problems(cfg: DictConfig, world_size: int,
                       bad: Set[str]) -> tuple[Optional[ParallelDims], List[str]]:
    """Checks between keys, each made only when the keys it reads passed the schema."""
    def valid(*keys: str) -> bool:
        return not bad.intersection(keys)

    problems: List[str] = []
    dims = None
    t, m = cfg.training, cfg.model
    if valid("parallel.dp_replicate", "parallel.dp_shard"):
        try:
            dims = resolve_parallel(cfg, world_size)
        except ConfigError as err:
            problems.append(str(err))
    if dims is not None and valid("training.global_batch_size", "training.grad_accum_steps"):
        ranks_x_accum = dims.dp_size * t.grad_accum_steps
        if t.global_batch_size % ranks_x_accum:
            problems.append(
                f"training.global_batch_size={t.global_batch_size} does not divide over "
                f"{dims.dp_size} data-parallel ranks x training.grad_accum_steps={t.grad_accum_steps}"
                f" (needs a multiple of {ranks_x_accum})"
            )
    if valid(*(key for key in SCHEMA if key.startswith("model."))):
        try:
            llama = llama_config(m)
            if llama.head_dim % 2:
                problems.append(f"model: dim/n_heads = {llama.head_dim} must be even (RoPE rotates pairs)")
        except (ValueError, TypeError) as err:
            problems.append(f"model: {err}")
    if valid("training.seq_len", "model.max_seq_len") and t.seq_len > m.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if (cfg.data.kind == "synthetic" and valid("data.branching", "model.vocab_size")
            and cfg.data.branching > m.vocab_size):
        problems.append(f"data.branching={cfg.data.branching} exceeds model.vocab_size={m.vocab_size}")
    if t.compile is True and valid("training.compile_backend") and t.compile_backend not in _compile_backends():
        problems.append(f"training.compile_backend={t.compile_backend!r} is not a torch.compile backend; "
                        f"known: {', '.join(_compile_backends())}")
    if cfg.checkpoint.load_only is True and not cfg.checkpoint.load_from:
        problems.append("checkpoint.load_only=true needs checkpoint.load_from (the checkpoint to take the model from)")
    for sink in ("tensorboard", "wandb"):
        if cfg.logging[sink] is True and not available(sink):
            problems.append(f"{install_hint(sink, f'logging.{sink}=true')}, or set logging.{sink}=false")
    return dims, problems


def _compile_backends() -> List[str]:
    import torch  # only when training.compile is on: the rest of validation needs no torch

    return torch.compiler.list_backends(exclude_tags=())
