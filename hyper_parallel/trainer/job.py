"""The job and what it did: everything a run needs, built from the config (``loop.build_job``),
and its summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.data import DistributedBatchLoader
from hyper_parallel.platform import Platform
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.schema import TrainConfig
from hyper_parallel.trainer.setup.context_parallel import SequenceSplit
from hyper_parallel.trainer.step.evaluation import Evaluator
from hyper_parallel.trainer.checkpointing.memory_snapshots import MemorySnapshots
from hyper_parallel.trainer.observability.metrics import MetricsLogger
from hyper_parallel.trainer.observability.performance import ProfilerWindow, Throughput
from hyper_parallel.trainer.setup.pipeline_parallel import Pipeline
from hyper_parallel.trainer.step.schedule import WarmupCosineSchedule


@dataclass
class TrainingJob:
    """Everything a run needs, built from the config (see :func:`~hyper_parallel.trainer.loop.build_job`)."""

    cfg: TrainConfig
    dims: ParallelDims
    platform: Platform
    device: torch.device
    mesh: DeviceMesh
    model_parts: List[nn.Module]  # the model, or with pipeline parallelism this rank's stage modules
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosineSchedule
    loader: DistributedBatchLoader
    manager: Any  # hyper_parallel.checkpoint.CheckpointManager
    state: Dict[str, Any]
    log: MetricsLogger
    loss_floor: Optional[float]
    throughput: Throughput
    started_at: float  # time.monotonic() when setup began (training.time_limit_minutes counts from it)
    evaluator: Optional[Evaluator] = None
    profiler: Optional[ProfilerWindow] = None
    pipeline: Optional[Pipeline] = None  # parallel.pp > 1
    cp: Optional[SequenceSplit] = None  # parallel.cp > 1
    snapshots: Optional[MemorySnapshots] = None  # checkpoint.memory_interval > 0

    @property
    def model(self) -> Union[nn.Module, Pipeline]:
        """What a step or an evaluation runs: the model, or the pipeline."""
        return self.pipeline if self.pipeline is not None else self.model_parts[0]


@dataclass
class RunSummary:
    """What a run did (returned to the recipe, printed on rank 0)."""

    start_step: int
    end_step: int
    losses: List[float] = field(default_factory=list)
    loss_floor: Optional[float] = None
    stopped_by_signal: bool = False
    stop_reason: Optional[str] = None  # SIGTERM, time limit or stop_after_steps
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
