"""Range and choice checks of the keys for data splits, evaluation, observability and operations
(called by :func:`hyper_parallel.trainer.config.validate_config`)."""

from __future__ import annotations

from typing import Any, List

from omegaconf import DictConfig

from hyper_parallel.trainer.operations import EXCLUDABLE, EXPORT_DTYPES


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def extra_problems(cfg: DictConfig) -> List[str]:
    """Every problem with these keys, as readable lines (empty: all fine)."""
    problems: List[str] = []
    t, c, e, p = cfg.training, cfg.checkpoint, cfg.eval, cfg.profiling

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(t.stop_after_steps is None or (_is_int(t.stop_after_steps) and t.stop_after_steps >= 1),
         f"training.stop_after_steps={t.stop_after_steps!r} must be null or a positive integer")
    need(t.time_limit_minutes is None or (_is_number(t.time_limit_minutes) and t.time_limit_minutes > 0),
         f"training.time_limit_minutes={t.time_limit_minutes!r} must be null or a number > 0")
    need(t.peak_tflops is None or (_is_number(t.peak_tflops) and t.peak_tflops > 0),
         f"training.peak_tflops={t.peak_tflops!r} must be null or a number > 0")
    need(_is_int(e.every) and e.every >= 0, f"eval.every={e.every!r} must be an integer >= 0 (0 disables eval)")
    need(_is_int(e.steps) and e.steps >= 1, f"eval.steps={e.steps!r} must be a positive integer")
    fraction = cfg.data.get("val_fraction", 0.0)
    need(_is_number(fraction) and 0 <= fraction < 1, f"data.val_fraction={fraction!r} must be in [0, 1)")
    need(_is_int(p.start_step) and p.start_step >= 1, f"profiling.start_step={p.start_step!r} must be >= 1")
    need(_is_int(p.steps) and p.steps >= 1, f"profiling.steps={p.steps!r} must be a positive integer")
    need(c.load_step is None or (_is_int(c.load_step) and c.load_step >= 0),
         f"checkpoint.load_step={c.load_step!r} must be null or an integer >= 0")
    need(not c.load_only or bool(c.load_from),
         "checkpoint.load_only=true needs checkpoint.load_from (the checkpoint to take the model from)")
    bad = [k for k in (c.exclude or []) if k not in EXCLUDABLE]
    need(not bad, f"checkpoint.exclude: {bad} not among {list(EXCLUDABLE)} (the model is always loaded)")
    need(c.export_dtype in EXPORT_DTYPES,
         f"checkpoint.export_dtype={c.export_dtype!r} must be one of {list(EXPORT_DTYPES)}")
    return problems
