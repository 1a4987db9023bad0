"""fully_shard: FSDP / HSDP runtime on torch DTensors. See ``docs/fully_shard.md``.

Map of the package, along the route of one training step::

    api.py            fully_shard(): collects a call's parameters, asks shard_placement_fn for
                      each one's mesh and dim (mesh.py), builds the parameters (param.py), one
                      MeshSubgroup per mesh (mesh_subgroup.py), the HSDPParamGroup
                      (param_group.py) and the module's HSDPState (state.py); the module's class
                      becomes an FSDPModule (module_api.py, torch_methods.py)
    mesh.py           DataParallelMesh: a 1-D (FSDP) or 2-D (HSDP) mesh and its process groups
    param.py          HSDPParam: one parameter's sharded DTensor, shard slot, unsharded view
    mesh_subgroup.py  the parameters of a group on one mesh: buckets, divisor, groups
    flat_bucket.py    FlatBucket: one dtype's flat shard / unsharded buffers, copy-in/out
    extension_bucket.py, extension_protocol.py   parameters gathered through
                      fsdp_pre/post_all_gather (torchao float8 weights)
    collectives.py    the only calls into torch.distributed (counted, profiler-labelled)

    forward   state.py HSDPState._pre_forward: the root starts the step (root_context.py:
              RootContext.begin_step, order_all_gathers) -> HSDPParamGroup.unshard issues one
              all-gather per bucket of every mesh (in_flight.py: InFlightGather), then waits
              and copies out; slots.py registers the unsharded parameters -> the implicit or
              explicit prefetch of the next module -> the inputs pass through
              hooks.FullyShardModuleInputs -> _post_forward reshards (fully, or keeping a
              smaller group's pieces) and hooks the outputs for backward
    backward  HSDPState._pre_backward unshards again and prefetches the previous module ->
              autograd accumulates the unsharded gradients -> FullyShardModuleInputs'
              backward (every forward call's inputs done) -> HSDPState.post_backward:
              RootContext.advance_reductions moves the reductions in flight one stage on, then
              HSDPParamGroup.reduce_grads issues one reduce-scatter per bucket of every mesh
              (PendingReduce); finish_scatter issues the HSDP all-reduces; _set_grads divides
              and sets the sharded gradients (FlatBucket.assign_grads; offload.py copies them
              to host memory with CPUOffloadPolicy) -> the end-of-backward callback
              (RootContext._final_callback) finishes the reductions (unless
              set_is_last_backward(False) leaves them in flight) and reshards
    step_phase.py     StepPhase (a module's phase in the step), GroupBackward (when a group
                      reduces), ShardState (where a group's parameters are)
    policy.py, tree.py   MixedPrecisionPolicy / OffloadPolicy; casting nested inputs/outputs
    torch_dropin.py   patch_torch_fsdp(): ours under torch's FSDP2 names

May import (beside torch): ``_torch_compat`` and ``platform`` (streams); never
``distributed_checkpoint``, ``parallel``, ``models``, ``trainer`` or ``data``.
"""

from hyper_parallel._torch_compat import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from hyper_parallel.core.fully_shard.api import fully_shard, shard_on
from hyper_parallel.core.fully_shard.module_api import FSDPModule, HSDPModule, register_fsdp_forward_method
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.torch_dropin import TorchFSDPPatch, patch_torch_fsdp

__all__ = ["fully_shard", "shard_on", "ShardPlacementResult", "FSDPMeshInfo", "HSDPMeshInfo", "FSDPModule", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "register_fsdp_forward_method", "patch_torch_fsdp", "TorchFSDPPatch"]
