"""fully_shard: FSDP / HSDP runtime on torch DTensors."""

from hyper_parallel.core.fully_shard.api import FSDPModule, HSDPModule, fully_shard
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy"]
