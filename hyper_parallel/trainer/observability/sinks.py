"""Where rank 0's per-step scalars go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

Each sink implements :class:`MetricsSink`; :class:`~hyper_parallel.trainer.observability.metrics.MetricsLogger`
builds the configured ones on rank 0 and feeds every step's numeric values to each.
"""

from __future__ import annotations

import os
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from hyper_parallel._optional import install_hint
from hyper_parallel.utils.fileio import RefusedFileError, open_regular, write_file_atomically

TENSORBOARD_FOLDER = "tensorboard"  # in output_dir
WANDB_FOLDER = "wandb"  # in output_dir (wandb.init's dir=output_dir makes it)
WANDB_RUN_ID_FILE = "wandb_run_id"  # in output_dir: a resumed job continues the same W&B run
# What the recipe accepts as a W&B run id (it makes 12 hex digits itself).
WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RUN_ID_FILE_BYTES = 256  # a run id and white space; more is not a run id file


class SinkError(RuntimeError):
    """A sink cannot start (its package is missing, its folder or run id is unusable); one line
    naming the problem and the way out."""


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
        SinkError: the ``tensorboard`` package is not installed, or ``folder`` cannot be made.
    """

    def __init__(self, folder: str):
        try:  # an optional package (hyper_parallel[tensorboard]): imported only when the sink is on
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SinkError(f"{install_hint('tensorboard', 'logging.tensorboard=true')}, "
                            "or set logging.tensorboard=false") from None
        try:
            self._writer = SummaryWriter(folder)
        except OSError as err:
            raise SinkError(f"logging.tensorboard=true: cannot write TensorBoard events to {folder} "
                            f"({err.strerror or err})") from None

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


def read_wandb_run_id(output_dir: str) -> Optional[str]:
    """The W&B run id kept in ``output_dir/wandb_run_id`` (None: no such file yet), read
    without following a symbolic link (its target's content would become the run id sent to
    the W&B server), and at most a few hundred bytes of it.

    Raises:
        SinkError: the file is not a regular file, is unreadable or too large, or does not
            hold a run id (:data:`WANDB_RUN_ID`); one line naming it and the way out.
    """
    path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
    fix = "delete it to start a new W&B run, or write into it the id of the run to continue"
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except RefusedFileError as err:
        raise SinkError(f"logging.wandb=true: {err}; {fix}") from None
    except OSError as err:
        raise SinkError(f"logging.wandb=true: cannot read {path} ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(_RUN_ID_FILE_BYTES + 1)
    text = data.decode("ascii", errors="replace").strip()
    if len(data) > _RUN_ID_FILE_BYTES or not WANDB_RUN_ID.fullmatch(text):
        held = f"over {_RUN_ID_FILE_BYTES} bytes" if len(data) > _RUN_ID_FILE_BYTES else repr(text[:40])
        raise SinkError(f"logging.wandb=true: {path} does not hold a W&B run id (1 to 64 letters, digits, - or _; "
                        f"it holds {held}): {fix}")
    return text


class WandbSink(MetricsSink):
    """A Weights & Biases run, its files under ``output_dir/wandb``. ``WANDB_MODE=offline``
    records locally (``wandb sync`` uploads later). The run's id is kept in
    ``output_dir/wandb_run_id`` (:func:`read_wandb_run_id`), so a resumed job continues the
    same W&B run.

    Raises:
        SinkError: the ``wandb`` package is not installed, the run id file is unusable, or
            ``wandb.init`` fails (the first line of its message).
    """

    def __init__(self, output_dir: str, settings: WandbSettings):
        try:  # an optional package (hyper_parallel[wandb]): imported only when the sink is on
            import wandb
        except ImportError:
            raise SinkError(f"{install_hint('wandb', 'logging.wandb=true')}, or set logging.wandb=false") from None
        run_id = read_wandb_run_id(output_dir)
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            write_file_atomically(os.path.join(output_dir, WANDB_RUN_ID_FILE), f"{run_id}\n".encode())
        name = settings.run_name or os.path.basename(os.path.abspath(output_dir))
        try:
            self._run = wandb.init(project=settings.project, name=name, id=run_id, resume="allow",
                                   dir=output_dir, config=settings.config)
        except (wandb.errors.Error, OSError) as err:
            detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise SinkError(f"logging.wandb=true: the W&B run in {os.path.join(output_dir, WANDB_FOLDER)} did not "
                            f"start ({detail})") from None

    def log(self, scalars: Dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
