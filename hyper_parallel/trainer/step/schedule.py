"""Linear warm-up then cosine decay, as a checkpointable learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any, Dict

import torch


def warmup_cosine_lr(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int,
                     min_lr_ratio: float) -> float:
    """The learning rate for optimizer step ``step`` (1-based).

    Rises linearly to ``peak_lr`` over ``warmup_steps``, then follows a half cosine down to
    ``peak_lr * min_lr_ratio`` at ``total_steps`` (and stays there after).
    """
    if step <= warmup_steps:
        return peak_lr * step / max(warmup_steps, 1)
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosineSchedule:
    """Sets the optimizer's learning rate before each step; its state is the step count.

    Call :meth:`step` once per optimizer step, before ``optimizer.step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, peak_lr: float, warmup_steps: int,
                 total_steps: int, min_lr_ratio: float):
        self.optimizer = optimizer
        self.params = dict(peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps,
                           min_lr_ratio=min_lr_ratio)
        self.steps_done = 0

    @property
    def lr(self) -> float:
        """The learning rate of the most recent step (0 before the first)."""
        return warmup_cosine_lr(self.steps_done, **self.params) if self.steps_done else 0.0

    def step(self) -> float:
        self.steps_done += 1
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> Dict[str, Any]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
