"""The pieces the training recipes share: config, mesh + model setup, LR schedule, metrics, loop."""

from hyper_parallel.trainer.config import (ConfigError, ParallelDims, TrainConfig, ValidConfig, compose_config,
                                           typed_config, validate_config)
from hyper_parallel.trainer.job import RunSummary, TrainingJob
from hyper_parallel.trainer.loop import build_job, run_training, train_loop
from hyper_parallel.trainer.schedule import WarmupCosineSchedule, warmup_cosine_lr
from hyper_parallel.trainer.step import train_step

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
