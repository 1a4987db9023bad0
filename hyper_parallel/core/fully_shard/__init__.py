"""fully_shard: FSDP / HSDP runtime on torch DTensors."""

from hyper_parallel._torch_compat import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from hyper_parallel.core.fully_shard.api import fully_shard, shard_on
from hyper_parallel.core.fully_shard.module_api import FSDPModule, HSDPModule, register_fsdp_forward_method
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.torch_dropin import TorchFSDPPatch, patch_torch_fsdp

__all__ = ["fully_shard", "shard_on", "ShardPlacementResult", "FSDPMeshInfo", "HSDPMeshInfo", "FSDPModule", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "register_fsdp_forward_method", "patch_torch_fsdp", "TorchFSDPPatch"]
