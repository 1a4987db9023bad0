"""Operations: where a job starts from (``checkpoint.load_step`` / ``load_from`` / ``load_only``
/ ``exclude``; the config's optimizer hyper-parameters over the checkpoint's), what the last checkpoint holds (``last_save_model_only``, ``export_dtype``), and
when a job stops early (``training.stop_after_steps``, ``training.time_limit_minutes``)."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import (CheckpointError, checkpoint_step, committed_steps, is_checkpoint,
                                       read_checkpoint_metadata)
from hyper_parallel.checkpoint import load as load_checkpoint
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.trainer.config.schema import EXPORT_DTYPE_NAMES, CheckpointConfig, OptimConfig

EXPORT_DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPE_NAMES}


class LoadPlan(NamedTuple):
    """The checkpoint to start from, the state entries to read from it, and the step to continue at."""

    path: str
    keys: List[str]
    start_step: int
    description: str
    newest_own: bool = False  # the job's own newest checkpoint: if corrupt, an older one stands in


def _pick(folder: str, steps: Sequence[int], load_step: Optional[int]) -> str:
    if load_step is None:
        return os.path.join(folder, f"step-{steps[-1]}")
    if load_step not in steps:
        raise ConfigError(f"checkpoint.load_step={load_step}: {folder} has no committed step-{load_step} "
                          f"(it has {list(steps) or 'none'})")
    return os.path.join(folder, f"step-{load_step}")


def plan_load(c: CheckpointConfig, state_keys: Sequence[str]) -> Optional[LoadPlan]:
    """What to load at start-up; None: start from scratch.

    The job's own ``checkpoint.folder`` wins (a restarted job resumes its own run, fully, minus
    ``exclude``); when it holds no checkpoint, ``checkpoint.load_from`` (a ``step-N`` directory
    or a folder of them) is read: with ``load_only`` the model alone and training starts at
    step 0, else the full state minus ``exclude``, continuing at its step.

    Raises:
        ConfigError: ``load_step`` not found, ``load_from`` not a checkpoint.
    """
    keys = [k for k in state_keys if k not in c.exclude]
    own = committed_steps(c.folder) if c.resume else []
    if own:
        path = _pick(c.folder, own, c.load_step)
        return LoadPlan(path, keys, checkpoint_step(path), f"resumed from {path}", newest_own=c.load_step is None)
    if not c.load_from:
        if c.load_step is not None and c.resume:
            _pick(c.folder, own, c.load_step)  # raises: the requested step is not there
        return None
    source = os.path.expanduser(str(c.load_from))
    if is_checkpoint(source):
        path = source
    else:
        found = committed_steps(source)
        if not found:
            raise ConfigError(f"checkpoint.load_from={source} is neither a committed checkpoint nor "
                              "a folder of step-N checkpoints")
        path = _pick(source, found, c.load_step)
    if c.load_only:
        return LoadPlan(path, ["model"], 0, f"initialised the model from {path} (model only)")
    return LoadPlan(path, keys, checkpoint_step(path) or 0, f"continued from {path}")


def load(plan: LoadPlan, state: Dict[str, Any]) -> None:
    """Read ``plan.keys`` of ``state`` from ``plan.path`` in place (collective).

    Raises:
        ConfigError: the checkpoint lacks an entry (e.g. a model-only final checkpoint) or
            does not fit the model.
    """
    stored = {key.split(".", 1)[0] for key in read_checkpoint_metadata(plan.path).state_dict_metadata}
    missing = [k for k in plan.keys if k not in stored]
    if missing:
        raise ConfigError(f"{plan.path} holds no {missing} (a model-only checkpoint?); add them to "
                          "checkpoint.exclude, or use checkpoint.load_only=true with checkpoint.load_from")
    try:
        load_checkpoint({k: state[k] for k in plan.keys}, checkpoint_id=plan.path, no_dist=not dist.is_initialized())
    except CheckpointError as err:
        raise ConfigError(f"{plan.path}: {err}") from None


def final_state(c: CheckpointConfig, state: Dict[str, Any]) -> Dict[str, Any]:
    """What the checkpoint after the last step holds: everything, or with
    ``last_save_model_only`` the model alone, cast to ``export_dtype``."""
    if not c.last_save_model_only:
        return state
    dtype = EXPORT_DTYPES[c.export_dtype]
    model = state["model"].state_dict()
    return {"model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}}


# AdamW hyper-parameters of the ``optim`` config. A checkpoint's optimizer state carries its own
# (torch's load_state_dict restores them); on resume the config's win, like ``lr`` (the schedule
# sets it from the config every step).
OPTIM_HYPERPARAMETERS = ("betas", "eps", "weight_decay")


def apply_optim_config(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig) -> List[str]:
    """Set the config's optimizer hyper-parameters after a resume; one line per value that
    replaced the checkpoint's (empty when they agree)."""
    lines = []
    configured = {"betas": tuple(float(v) for v in optim_cfg.betas), "eps": float(optim_cfg.eps),
                  "weight_decay": float(optim_cfg.weight_decay)}
    for key in OPTIM_HYPERPARAMETERS:
        wanted = configured[key]
        saved = [tuple(g[key]) if key == "betas" else g[key] for g in optimizer.param_groups]
        if any(value != wanted for value in saved):
            for group in optimizer.param_groups:
                group[key] = wanted
            lines.append(f"optim.{key}: the config's {_shown(wanted)} replaces the checkpoint's {_shown(saved[0])} "
                         "(on resume the config wins for optimizer hyper-parameters)")
    return lines


def _shown(value: Any) -> str:
    return f"[{', '.join(map(repr, value))}]" if isinstance(value, tuple) else repr(value)


class StopRule:
    """Early stop after ``stop_after_steps`` steps of this job, or when the next step would end
    past ``time_limit_minutes`` after ``started_at`` (``time.monotonic()``, default now; the step
    time estimated by the slowest step so far). The LR schedule keeps its horizon at
    ``training.steps``."""

    def __init__(self, *, start_step: int, stop_after_steps: Optional[int], time_limit_minutes: Optional[float],
                 started_at: Optional[float] = None):
        self.start_step, self.stop_after_steps = start_step, stop_after_steps
        started_at = time.monotonic() if started_at is None else started_at
        self.deadline = None if time_limit_minutes is None else started_at + 60.0 * time_limit_minutes
        self._slowest = 0.0

    def out_of_time(self, step_time_s: float) -> bool:
        """This rank's vote, after a step (all ranks agree through the step's all-reduce)."""
        self._slowest = max(self._slowest, step_time_s)
        return self.deadline is not None and time.monotonic() + self._slowest >= self.deadline

    def steps_done(self, step: int) -> bool:
        return self.stop_after_steps is not None and step - self.start_step >= self.stop_after_steps
