"""The training job the recipes run, one folder per part of it, in layers (each imports only
the ones above it in this list; ``tests/recipes/test_trainer_layers.py`` holds them to it):

- ``config/``: the recipe's config, its schema, validation and typed sections.
- ``observability/``: metrics, their sinks, throughput, memory and profiling.
- ``setup/``: the mesh, the model sharded and split over it, the optimizer.
- ``step/``: one training step, the schedule, evaluation, the ranks' agreement after a step.
- ``checkpointing/``: the training state, saves, where a job starts from, in-memory snapshots.
- ``job.py``: the built job (:class:`TrainingJob`) and what it did (:class:`RunSummary`).
- ``launch/``: the pre-start checks, the restart from snapshots, SIGTERM, the reports.
- ``loop.py``: ``run_training``: builds the job from the config and runs its steps.

May import every other package; nothing imports it. Its own folders' layers are checked by
``tests/recipes/test_trainer_layers.py``.
"""

from hyper_parallel.trainer.config import (ConfigError, ParallelDims, TrainConfig, ValidConfig, compose_config,
                                           typed_config, validate_config)
from hyper_parallel.trainer.job import RunSummary, TrainingJob
from hyper_parallel.trainer.loop import build_job, run_training, train_loop
from hyper_parallel.trainer.step.schedule import WarmupCosineSchedule, warmup_cosine_lr
from hyper_parallel.trainer.step.train_step import train_step

__all__ = [
    "ConfigError",
    "ParallelDims",
    "RunSummary",
    "TrainConfig",
    "TrainingJob",
    "ValidConfig",
    "WarmupCosineSchedule",
    "build_job",
    "compose_config",
    "run_training",
    "train_loop",
    "train_step",
    "typed_config",
    "validate_config",
    "warmup_cosine_lr",
]
