"""fully_shard(): shard a module's parameters over a data-parallel mesh (FSDP / HSDP / FSDP+TP)."""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel.core.fully_shard.mesh import DataParallelMesh, resolve_mesh
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup, UnshardHandle
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.state import HSDPState

# id(original or sharded parameter) -> owning group, to keep tied parameters tied. No weak
# references to the parameters themselves: those would block to_empty()'s swap_tensors.
_OWNERS: "weakref.WeakValueDictionary[int, HSDPParamGroup]" = weakref.WeakValueDictionary()


def _owner(param: nn.Parameter) -> Optional[Tuple[HSDPParam, HSDPParamGroup]]:
    """The managed parameter (and its group) that ``param`` is, or was before sharding."""
    group = _OWNERS.get(id(param))
    if group is None:
        return None
    for hsdp_param in group.params:
        if hsdp_param.sharded_param is param or hsdp_param.original() is param:
            return hsdp_param, group
    return None
_CLASS_CACHE: Dict[type, type] = {}


class FSDPModule:
    """Mixin added to the class of every module passed to :func:`fully_shard`."""

    @property
    def _state(self) -> HSDPState:
        return self.__dict__["_hsdp_state"]

    def _states(self, recurse: bool) -> List[HSDPState]:
        if not recurse:
            return [self._state]
        return [m._hsdp_state for m in self.modules() if "_hsdp_state" in m.__dict__]

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters; with ``async_op`` return a handle whose
        ``wait()`` completes it (the next forward waits anyway)."""
        state = self._state
        if state.ctx is None:
            state.lazy_init()
        return state.group.unshard(async_op=async_op)

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded DTensors again."""
        self._state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally without any reduction
        (gradient accumulation); the next backward with True reduces the sum."""
        for state in self._states(recurse):
            state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but keeps the result as a partial sum instead of
        all-reducing over the replicate dim; the next all-reduce includes it."""
        for state in self._states(recurse):
            state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters unsharded after backward (saves the next forward's
        all-gather, e.g. between gradient-accumulation micro-batches)."""
        for state in self._states(recurse):
            state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's forward starts (replaces the
        implicit next-module prefetch)."""
        self._state.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's backward starts (replaces the
        implicit previous-module prefetch)."""
        self._state.backward_prefetch = _states_of(modules)


HSDPModule = FSDPModule


def _states_of(modules: Iterable[nn.Module]) -> List[HSDPState]:
    states = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"prefetch targets must be fully_shard modules, got {type(module).__name__}")
        states.append(module._state)
    return states


def _shard_dim(param: nn.Parameter, shard_placement_fn) -> int:
    if shard_placement_fn is None:
        return 0
    placement = shard_placement_fn(param)
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(f"shard_placement_fn must return Shard(dim) or None, got {placement!r}")
    return placement.dim


def _check_device(name: str, param: nn.Parameter, dp: DataParallelMesh, offload: bool) -> None:
    device = param.device
    allowed = {dp.mesh.device_type, "meta"} | ({"cpu"} if offload else set())
    if device.type not in allowed:
        raise ValueError(f"parameter {name!r} is on {device}, but the mesh is on "
                         f"{dp.mesh.device_type!r}: move the module to that device (or meta) first")


def _collect(module: nn.Module, ignored: set) -> Tuple[Dict[int, Tuple[nn.Parameter, str, list]], list]:
    """This call's parameters (id -> (param, qualified name, slots)) and slots of parameters
    already owned by another group (tied across groups), skipping wrapped submodules."""
    own: Dict[int, Tuple[nn.Parameter, str, list]] = {}
    foreign: List[Tuple[nn.Module, str, nn.Parameter]] = []
    stack: List[Tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        for name, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            if _owner(param) is not None:
                foreign.append((mod, name, param))
            elif id(param) in own:
                own[id(param)][2].append((mod, name))
            else:
                own[id(param)] = (param, prefix + name, [(mod, name)])
        for child_name, child in reversed(list(mod._modules.items())):
            if child is not None and not isinstance(child, FSDPModule):
                stack.append((f"{prefix}{child_name}.", child))
    return own, foreign


def _post_forward_resharding(value: Optional[Union[bool, int]], dp: DataParallelMesh
                             ) -> Tuple[Optional[bool], Optional[Tuple[int, dist.ProcessGroup]]]:
    """``reshard_after_forward`` as (bool or None, smaller post-forward group or None)."""
    if value is None or isinstance(value, bool):
        return value, None
    if value < 1 or dp.shard_size % value:
        raise ValueError(f"reshard_after_forward={value} must divide the shard world size {dp.shard_size}")
    if value == 1:
        return False, None  # a group of one rank: keep everything
    if value == dp.shard_size:
        return True, None
    return True, (value, dp.shard_subgroup(value))


def _register_full_state_dict_loading(slots: List[Tuple[nn.Module, str, HSDPParam]]) -> None:
    """load_state_dict may hold full (plain) tensors for sharded params: slice them locally."""
    by_module: Dict[nn.Module, List[Tuple[str, HSDPParam]]] = {}
    for mod, name, param in slots:
        by_module.setdefault(mod, []).append((name, param))
    for mod, entries in by_module.items():
        def hook(state_dict, prefix, *_, entries=entries):
            for name, param in entries:
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    state_dict[prefix + name] = param.shard_full(value)
        mod._register_load_state_dict_pre_hook(hook)


def fully_shard(
    module: nn.Module,
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already managed by a wrapped submodule) as one
    parameter group over ``mesh``.

    Args:
        module: the module; its class becomes a subclass of :class:`FSDPModule`.
        mesh: 1-D (FSDP) or 2-D (HSDP: replicate, shard) data-parallel mesh; None = world.
        reshard_after_forward: free the unsharded parameters after forward (all-gather again
            in backward); None = True except for the root module. An int ``k`` dividing the
            shard world size keeps the parameters sharded over groups of ``k`` ranks after
            forward, so backward all-gathers only within them (e.g. within a node).
        shard_placement_fn: ``param -> Shard(d)`` (any dim, uneven sizes padded) or None (dim 0).
        mp_policy: mixed-precision dtypes (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards and gradients on CPU.
        ignored_params: parameters left untouched (not sharded, not reduced).

    Returns:
        ``module`` (same object).

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: the module is already wrapped, the mesh is not 1-D/2-D or on another device
            type, a parameter is on the wrong device, ``shard_placement_fn`` returned a
            non-``Shard`` placement, or ``reshard_after_forward`` is not a bool, None or a
            divisor of the shard world size.
    """
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ValueError("reshard_after_forward must be a bool, an int or None, "
                         f"got {reshard_after_forward!r}")
    dp = resolve_mesh(mesh)
    reshard_after_forward, post_forward_group = _post_forward_resharding(reshard_after_forward, dp)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    ignored = {id(p) for p in (ignored_params or ())}
    own, foreign = _collect(module, ignored)
    params = []
    for param, name, slots in own.values():
        _check_device(name, param, dp, offload)
        params.append(HSDPParam(param, slots, dp, _shard_dim(param, shard_placement_fn)))
    group = HSDPParamGroup(params, dp, mp_policy, offload_policy, reshard_after_forward, post_forward_group)
    for hsdp_param, (original, _, _) in zip(params, own.values()):
        _OWNERS[id(original)] = _OWNERS[id(hsdp_param.sharded_param)] = group
        hsdp_param.use_sharded()
    load_slots = [(mod, name, p) for p in params for mod, name in p.slots]
    borrowed: List[HSDPParamGroup] = []
    for mod, name, param in foreign:
        owner_param, owner_group = _owner(param)
        owner_group.add_slot(owner_param, mod, name)
        load_slots.append((mod, name, owner_param))
        if owner_group is not group and owner_group not in borrowed:
            borrowed.append(owner_group)
    _register_full_state_dict_loading(load_slots)
    module._hsdp_state = HSDPState(module, group, mp_policy, borrowed)
    cls = type(module)
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"HSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]
    return module
