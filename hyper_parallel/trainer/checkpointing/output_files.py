"""The files and folders a job writes into ``output_dir`` and ``checkpoint.folder``, checked
before any rank starts: each is a regular file (never a symbolic link, whose target would be
written or read) or a writable folder where the job needs one. A problem is one line naming
the path and the way out."""

from __future__ import annotations

import os
from typing import List, Optional

from hyper_parallel.checkpoint import LOCK_FILE
from hyper_parallel.trainer.config.schema import TrainConfig
from hyper_parallel.trainer.observability.metrics import METRICS_FILE
from hyper_parallel.trainer.observability.sinks import TENSORBOARD_FOLDER, WANDB_FOLDER, SinkError, read_wandb_run_id
from hyper_parallel.utils.fileio import RefusedFileError, open_regular, unusable_folder, url_scheme


def _refused(path: str, flags: int, *, unopenable_ok: bool = False) -> Optional[str]:
    """Why the job could not open ``path`` with ``flags`` (as it will, through
    :func:`open_regular`: not a regular file, a symbolic link, another file's hard link); None
    when it can, when there is no such file yet, or (``unopenable_ok``) when the OS refuses."""
    try:
        os.close(open_regular(path, flags))
    except FileNotFoundError:
        return None
    except RefusedFileError as err:
        return str(err)
    except OSError as err:
        return None if unopenable_ok else f"{path} cannot be opened ({err.strerror or err})"
    return None


def output_file_problems(cfg: TrainConfig) -> List[str]:
    """``metrics.jsonl`` and the checkpoint folder's lock file (when they exist), the
    TensorBoard folder (``logging.tensorboard``), the W&B folder and run id file
    (``logging.wandb``). Run after the output folders themselves passed."""
    problems = []
    refused = _refused(os.path.join(cfg.output_dir, METRICS_FILE), os.O_WRONLY | os.O_APPEND)
    if refused:
        problems.append(f"output_dir: {refused}; remove it or choose another output_dir")
    if not url_scheme(cfg.checkpoint.folder):  # (an object store's lock is a lease object)
        # (A lock the OS refuses, e.g. in a read-only folder, is used unlocked, with a warning.)
        refused = _refused(os.path.join(cfg.checkpoint.folder, LOCK_FILE), os.O_RDWR, unopenable_ok=True)
        if refused:
            problems.append(f"checkpoint.folder: {refused}; remove it (it is the folder's lock file)")
    sinks = ((TENSORBOARD_FOLDER, cfg.logging.tensorboard), (WANDB_FOLDER, cfg.logging.wandb))
    for folder, on in sinks:
        path = os.path.join(cfg.output_dir, folder)
        why = unusable_folder(path) if on else None
        if why:
            problems.append(f"logging.{folder}=true: {path} cannot be used: {why}; fix or remove it, choose another "
                            f"output_dir, or set logging.{folder}=false")
    if cfg.logging.wandb:
        try:
            read_wandb_run_id(cfg.output_dir)
        except SinkError as err:
            problems.append(str(err))
    return problems
