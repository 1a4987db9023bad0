"""hyper_parallel: FSDP/HSDP training runtime for PyTorch on DTensor, with checkpointing built in.

Public names are resolved lazily, so ``import hyper_parallel.checkpoint`` does not pull in
the fully_shard runtime and vice versa.

May import every package below it (lazily, for its public names); nothing imports it back but
for the lazy names.
"""

from importlib import import_module
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hyper_parallel.platform import get_platform, init_distributed

__version__ = "0.1.0"

_LAZY = {
    "fully_shard": "hyper_parallel.core.fully_shard",
    "FSDPModule": "hyper_parallel.core.fully_shard",
    "HSDPModule": "hyper_parallel.core.fully_shard",
    "MixedPrecisionPolicy": "hyper_parallel.core.fully_shard",
    "OffloadPolicy": "hyper_parallel.core.fully_shard",
    "CPUOffloadPolicy": "hyper_parallel.core.fully_shard",
    "register_fsdp_forward_method": "hyper_parallel.core.fully_shard",
    "patch_torch_fsdp": "hyper_parallel.core.fully_shard",
    "clip_grad_norm_": "hyper_parallel.core.grad_norm",
    "ExpertParallel": "hyper_parallel.parallel.expert",
    "expert_meshes": "hyper_parallel.parallel.expert",
    "checkpoint": "hyper_parallel.checkpoint",
    "models": "hyper_parallel.models",
    "parallel": "hyper_parallel.parallel",
}
_SUBMODULES = {"checkpoint", "models", "parallel"}  # attributes that are the module itself

__all__ = [
    "DeviceMesh", "DTensor", "Partial", "Replicate", "Shard", "init_device_mesh",
    "get_platform", "init_distributed", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")
    mod = import_module(module)
    value = mod if name in _SUBMODULES else getattr(mod, name)
    globals()[name] = value
    return value
