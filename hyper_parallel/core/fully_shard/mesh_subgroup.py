"""MeshSubgroup: the parameters of one fully_shard group that live on one data-parallel mesh.

A group's parameters normally all use the mesh given to ``fully_shard``; ``shard_placement_fn``
may put some on a mesh of their own (FSDP2's ``ShardPlacementResult``: routed experts on the
expert-data mesh). The group (``param_group.py``) keeps one sub-group per mesh, in the order
the meshes first appear among its parameters (the same on every rank). Each sub-group buckets
its parameters by dtype (``flat_bucket.py``) and reduces them over its own process groups,
divided by its own data-parallel size, as FSDP2 divides each of its per-mesh groups.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.core.fully_shard.extension_bucket import ExtensionBucket
from hyper_parallel.core.fully_shard.flat_bucket import FlatBucket
from hyper_parallel.core.fully_shard.mesh import DataParallelMesh
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy


def divide_factors(world: float) -> Tuple[float, float]:
    """Split 1/world into a pre-reduce and post-reduce factor (both near sqrt(world)) so
    low-precision gradient sums neither overflow nor underflow."""
    pre = 1
    while world % (pre * 2) == 0 and world // (pre * 2) >= pre * 2:
        pre *= 2
    if pre == 1 and world > 1:
        pre = world
    return float(pre), world / pre


class MeshSubgroup:
    """The parameters of a group on one mesh, their buckets and that mesh's reduction settings.

    Attributes:
        dp: the mesh and its process groups.
        params: the parameters (in the group's order).
        buckets: one per (dtype, compute dtype, extension), bound by :meth:`bind_buckets`.
        post_forward_group: ``(size, process group)`` of the smaller group whose shards are
            kept after forward (``reshard_after_forward=<int>``), or None.
        reduce_scatter_group: the reduce-scatters' process group (the shard group unless
            ``set_separate_reduce_scatter_group``).
        pre_factor, post_factor: gradients are divided by these before / after the reduction.
    """

    def __init__(self, dp: DataParallelMesh, params: List[HSDPParam], mp_policy: MixedPrecisionPolicy,
                 post_forward_group: Optional[Tuple[int, dist.ProcessGroup]] = None):
        self.dp = dp
        self.params = params
        self.mp_policy = mp_policy
        self.post_forward_group = post_forward_group
        self.reduce_scatter_group: dist.ProcessGroup = dp.shard_group
        self.buckets: List[FlatBucket] = []
        self.pre_factor, self.post_factor = divide_factors(dp.dp_size)
        override = mp_policy.param_dtype_override_fn  # sees the parameters before sharding
        self._compute_dtypes = [(override and override(p.original())) or mp_policy.param_dtype for p in params]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients by ``factor`` instead of the data-parallel size."""
        self.pre_factor, self.post_factor = divide_factors(factor)

    def bind_buckets(self, device_of: Callable[[HSDPParam], torch.device], pin: bool, offload: bool) -> None:
        """Bucket the parameters by their current dtype and bind their shards into flat buffers
        on ``device_of(param)`` of each bucket's first parameter (CPU when offloading)."""
        by_dtype: Dict[Tuple[torch.dtype, Optional[torch.dtype], bool], List[HSDPParam]] = {}
        for param, compute_dtype in zip(self.params, self._compute_dtypes):
            by_dtype.setdefault((param.dtype, compute_dtype, param.extension), []).append(param)
        self.buckets = []
        world = self.dp.shard_size
        for (_, compute_dtype, extension), params in by_dtype.items():
            if extension:  # gathered through the parameters' fsdp_pre/post_all_gather
                bucket = ExtensionBucket(params, world, self.mp_policy, compute_dtype, self.dp.shard_mesh())
            else:
                bucket = FlatBucket(params, world, self.mp_policy, compute_dtype)
            device = device_of(params[0])
            bucket.bind_shards(torch.device("cpu") if offload and device.type != "meta" else device, pin)
            self.buckets.append(bucket)
