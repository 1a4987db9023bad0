"""Where rank 0's per-step scalars go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

Each sink implements :class:`MetricsSink`; :class:`~hyper_parallel.trainer.metrics.MetricsLogger`
builds the configured ones on rank 0 and feeds every step's numeric values to each.
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from hyper_parallel._optional import install_hint
from hyper_parallel.utils.fileio import write_file_atomically

WANDB_RUN_ID_FILE = "wandb_run_id"  # in output_dir: a resumed job continues the same W&B run


class MetricsSink(ABC):
    """A destination for the scalars of each optimizer step."""

    @abstractmethod
    def log(self, scalars: Dict[str, float], step: int) -> None:
        """Record ``scalars`` (name -> value, ``step`` itself left out) at ``step``."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release (called once, at the end of the run)."""


class TensorBoardSink(MetricsSink):
    """TensorBoard event files in ``folder``.

    Raises:
        RuntimeError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, folder: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(f"{install_hint('tensorboard', 'logging.tensorboard=true')}, "
                               "or set logging.tensorboard=false") from None
        self._writer = SummaryWriter(folder)

    def log(self, scalars: Dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class WandbSettings:
    """``logging.wandb_project``, ``logging.wandb_run_name`` (None: the name of ``output_dir``)
    and the run's config, shown on the W&B run page."""

    project: str
    run_name: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)


def wandb_settings(cfg: DictConfig) -> Optional[WandbSettings]:
    """The W&B run of ``logging.wandb`` (the resolved config shown on its page), or None."""
    if not cfg.logging.wandb:
        return None
    return WandbSettings(project=cfg.logging.wandb_project, run_name=cfg.logging.wandb_run_name,
                         config=OmegaConf.to_container(cfg, resolve=True))


class WandbSink(MetricsSink):
    """A Weights & Biases run, its files under ``output_dir/wandb``. ``WANDB_MODE=offline``
    records locally (``wandb sync`` uploads later). The run's id is kept in
    ``output_dir/wandb_run_id``, so a resumed job continues the same W&B run.

    Raises:
        RuntimeError: the ``wandb`` package is not installed.
    """

    def __init__(self, output_dir: str, settings: WandbSettings):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(f"{install_hint('wandb', 'logging.wandb=true')}, or set logging.wandb=false") from None
        id_path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
        if os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            write_file_atomically(id_path, f"{run_id}\n".encode())
        name = settings.run_name or os.path.basename(os.path.abspath(output_dir))
        self._run = wandb.init(project=settings.project, name=name, id=run_id, resume="allow",
                               dir=output_dir, config=settings.config)

    def log(self, scalars: Dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
