"""fully_shard(): shard a module's parameters over a data-parallel mesh (FSDP / HSDP / FSDP+TP)."""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel._torch_compat import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult, module_parameters
from hyper_parallel.core.fully_shard.mesh import DataParallelMesh, resolve_mesh, resolve_mesh_info
from hyper_parallel.core.fully_shard.mesh_subgroup import MeshSubgroup
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.module_api import FSDPModule
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.core.fully_shard.policy import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy,
                                                   as_offload_policy)
from hyper_parallel.core.fully_shard.state import HSDPState

# id(original or sharded parameter) -> the state owning its group, to keep tied parameters
# tied. No weak references to the parameters themselves: those would block to_empty()'s
# swap_tensors.
_OWNERS: "weakref.WeakValueDictionary[int, HSDPState]" = weakref.WeakValueDictionary()


def _owner(param: nn.Parameter) -> Optional[Tuple[HSDPParam, HSDPState]]:
    """The managed parameter (and the state owning its group) that ``param`` is, or was
    before sharding."""
    owner = _OWNERS.get(id(param))
    if owner is None:
        return None
    for hsdp_param in owner.group.params:
        if hsdp_param.sharded_param is param or hsdp_param.original() is param:
            return hsdp_param, owner
    return None


_CLASS_CACHE: Dict[type, type] = {}


_PlacementFn = Callable[[nn.Parameter], Optional[Union[Shard, ShardPlacementResult]]]
# (shard group, replicate group): a parameter's sub-group within its fully_shard call, as FSDP2
# groups its parameters per mesh.
_MeshKey = Tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]


def _placement(param: nn.Parameter, shard_placement_fn: Optional[_PlacementFn], default: DataParallelMesh,
               meshes: Dict[_MeshKey, DataParallelMesh]) -> Tuple[DataParallelMesh, int]:
    """The mesh (one of ``meshes``, added there if new) and the shard dim that
    ``shard_placement_fn`` gives ``param``: ``Shard(d)`` or None on ``default``, or a
    ``ShardPlacementResult``'s placement on its own mesh."""
    result = None if shard_placement_fn is None else shard_placement_fn(param)
    dp = default
    if isinstance(result, ShardPlacementResult):
        dp, result = resolve_mesh_info(result.mesh_info), result.placement
    if result is not None and type(result) is not Shard:
        raise ValueError("shard_placement_fn must return Shard(dim), a ShardPlacementResult(Shard(dim) or None, "
                         f"mesh_info) or None, got {result!r}")
    known = meshes.setdefault((dp.shard_group, dp.replicate_group), dp)
    if known.mesh != dp.mesh:
        raise ValueError(f"mesh {dp.mesh} has the same process groups as {known.mesh}, used by other parameters "
                         "of this fully_shard call: give them the same mesh")
    return known, 0 if result is None else result.dim


def shard_on(mesh: DeviceMesh, placement: Optional[Shard] = None) -> ShardPlacementResult:
    """What ``shard_placement_fn`` returns to shard a parameter over ``mesh`` instead of the
    ``fully_shard`` call's mesh: torch's ``ShardPlacementResult`` with an ``FSDPMeshInfo``
    (1-D ``mesh``: FSDP) or ``HSDPMeshInfo`` (2-D: dim 0 replicates, dim 1 shards).

    Args:
        mesh: the parameter's data-parallel mesh.
        placement: ``Shard(d)`` on that mesh; None: ``Shard(0)``.

    Raises:
        ValueError: ``mesh`` is not 1-D or 2-D.
    """
    if mesh.ndim == 1:
        info = FSDPMeshInfo(mesh=mesh, shard_mesh_dim=0)
    elif mesh.ndim == 2:
        info = HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        raise ValueError(f"shard_on expects a 1-D (FSDP) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D {mesh}")
    return ShardPlacementResult(placement=placement, mesh_info=info)


def _check_param(name: str, param: nn.Parameter, dp: DataParallelMesh, offload: bool) -> None:
    """Raise a ValueError naming ``name`` if the parameter cannot be sharded over ``dp``."""
    if param.ndim == 0:
        raise ValueError(f"fully_shard cannot shard the 0-dim parameter {name!r}. Change {name} to "
                         "a 1D tensor with numel equal to 1, or pass it in ignored_params")
    device = param.device
    allowed = {dp.mesh.device_type, "meta"} | ({"cpu"} if offload else set())
    if device.type not in allowed:
        raise ValueError(f"parameter {name!r} is on {device}, but the mesh is on "
                         f"{dp.mesh.device_type!r}: move the module to that device (or meta) first")


def _root_modules(module: Union[nn.Module, Sequence[nn.Module]]) -> List[nn.Module]:
    """The modules of one ``fully_shard`` call: ``module`` itself, or the listed modules that
    are not inside another listed module."""
    if isinstance(module, nn.Module):
        modules = [module]
    elif isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        modules = list(dict.fromkeys(module))
        inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
        modules = [m for m in modules if id(m) not in inner]
    else:
        got = type(module).__name__
        if isinstance(module, (list, tuple)):
            bad = [type(m).__name__ for m in module if not isinstance(m, nn.Module)]
            got = f"an empty {got}" if not module else f"a {got} holding {', '.join(dict.fromkeys(bad))}"
        raise TypeError(f"fully_shard(module=...) takes an nn.Module or a non-empty list of nn.Modules, "
                        f"got {got}")
    for mod in modules:
        if isinstance(mod, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(mod).__name__}")
        _refuse_torch_wrapped(mod, "this module")
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and type(mod).forward is nn.Module.forward:
            raise ValueError(f"fully_shard cannot wrap a {type(mod).__name__}: it has no forward to "
                             "hook; wrap its items, or the module that runs them")
    return modules


def _collect(modules: List[nn.Module], ignored: set) -> Tuple[Dict[int, Tuple[nn.Parameter, str, list]], list]:
    """This call's parameters (id -> (param, qualified name, slots)) and slots of parameters
    already owned by another group (tied across groups), skipping wrapped submodules."""
    own: Dict[int, Tuple[nn.Parameter, str, list]] = {}
    foreign: List[Tuple[nn.Module, str, nn.Parameter]] = []
    prefixes = [f"[{i}]." for i in range(len(modules))] if len(modules) > 1 else [""]
    stack: List[Tuple[str, nn.Module]] = list(zip(prefixes, modules))[::-1]
    while stack:
        prefix, mod = stack.pop()
        for name, param in module_parameters(mod).items():
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
                _refuse_torch_wrapped(child, f"submodule {prefix + child_name!r}")
                stack.append((f"{prefix}{child_name}.", child))
    return own, foreign


def _refuse_torch_wrapped(module: nn.Module, what: str) -> None:
    """Raise a ValueError if torch's own fully_shard wrapped ``module`` (its parameters are
    torch FSDP2's sharded DTensors, driven by torch's hooks)."""
    if isinstance(module, TorchFSDPModule) and not isinstance(module, FSDPModule):
        raise ValueError(f"hyper_parallel's fully_shard cannot wrap {what} ({type(module).__name__}): torch's "
                         "fully_shard (torch.distributed.fsdp.fully_shard) already wrapped it; wrap the model "
                         "with one of them only (hp.patch_torch_fsdp() before the program's imports makes "
                         "torch's name ours)")


def _check_post_forward_size(value: Optional[Union[bool, int]], dps: List[DataParallelMesh]) -> None:
    """Raise a ValueError unless ``reshard_after_forward`` is a bool, None or an int dividing
    the shard world size of every mesh in ``dps`` (the call's mesh first, then the
    parameters' own)."""
    if value is None or isinstance(value, bool):
        return
    for i, dp in enumerate(dps):
        if value < 1 or dp.shard_size % value:
            raise ValueError(f"reshard_after_forward={value} must divide the shard world size {dp.shard_size}"
                             + (f" of the parameters' mesh {dp.mesh}" if i else ""))


def _post_forward_group(value: Optional[Union[bool, int]], dp: DataParallelMesh
                        ) -> Optional[Tuple[int, dist.ProcessGroup]]:
    """The smaller group of ``dp`` whose shards are kept after forward for an int
    ``reshard_after_forward`` (None: reshard fully or not at all)."""
    if value is None or isinstance(value, bool) or value in (1, dp.shard_size):
        return None
    return value, dp.shard_subgroup(value)


def _register_full_state_dict_loading(slots: List[Tuple[nn.Module, str, HSDPParam]]) -> None:
    """load_state_dict may hold full (plain) tensors for sharded params: slice them locally."""
    by_module: Dict[nn.Module, List[Tuple[str, HSDPParam]]] = {}
    for mod, name, param in slots:
        by_module.setdefault(mod, []).append((name, param))
    for mod, entries in by_module.items():
        def hook(_module, state_dict, prefix, *_, entries=entries):
            for name, param in entries:
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    state_dict[prefix + name] = param.shard_full(value)
        mod.register_load_state_dict_pre_hook(hook)


def fully_shard(
    module: Union[nn.Module, List[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[_PlacementFn] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    dp_mesh_dims: None = None,
) -> Union[nn.Module, List[nn.Module]]:
    """Shard ``module``'s parameters (those not already managed by a wrapped submodule) as one
    parameter group over ``mesh`` (and over the parameters' own meshes, see
    ``shard_placement_fn``).

    Args:
        module: the module, or a list of modules sharing one group (e.g. ``[model.norm,
            model.output]``: one all-gather when the first of them runs forward, reshard after
            the last); each one's class becomes a subclass of :class:`FSDPModule`.
        mesh: 1-D (FSDP) or 2-D (HSDP: replicate, shard) data-parallel mesh; None = the
            unnamed 1-D world mesh (torch's default).
        reshard_after_forward: free the unsharded parameters after forward (all-gather again
            in backward); None = True except for the root module. An int ``k`` dividing the
            shard world size keeps the parameters sharded over groups of ``k`` ranks after
            forward, so backward all-gathers only within them (e.g. within a node).
        shard_placement_fn: ``param -> Shard(d)`` (any dim, uneven sizes padded), None (dim 0),
            or torch's ``ShardPlacementResult(placement, mesh_info)``: the parameter shards
            over a mesh of its own (``FSDPMeshInfo`` on a 1-D mesh, ``HSDPMeshInfo`` on a 2-D
            one; e.g. routed experts over the expert-data mesh, see :func:`shard_on`). The
            call's parameters then form one sub-group per mesh, each all-gathered and reduced
            over its own mesh and divided by that mesh's data-parallel size, as FSDP2 does.
        mp_policy: mixed-precision dtypes (:class:`MixedPrecisionPolicy`; torch's
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` is converted to it).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards and gradients on CPU (torch's
            ``OffloadPolicy`` / ``CPUOffloadPolicy`` are converted).
        ignored_params: parameters left untouched (not sharded, not reduced).
        dp_mesh_dims: torch's full-SPMD-mesh form; not supported (must be None): pass the
            data-parallel sub-mesh as ``mesh`` instead (see Raises).

    Returns:
        ``module`` (same object).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or a non-empty list of them, or a policy
            is neither ours nor torch's.
        RuntimeError: no process group is initialised.
        ValueError: the module is already wrapped (or it or a submodule by torch's fully_shard),
            or is a ModuleList/ModuleDict without forward, the mesh is not 1-D/2-D or on another device
            type, a parameter is on the wrong device, ``shard_placement_fn`` returned a
            non-``Shard`` placement or an unsupported mesh, or ``reshard_after_forward`` is not
            a bool, None or a divisor of every mesh's shard world size, or ``dp_mesh_dims`` is
            given.
    """
    if dp_mesh_dims is not None:
        raise ValueError(f"fully_shard(dp_mesh_dims={dp_mesh_dims!r}) is not supported: pass the data-parallel "
                         "sub-mesh instead, mesh=full_mesh[\"dp_shard\"] (FSDP) or "
                         "mesh=full_mesh[\"dp_replicate\", \"dp_shard\"] (HSDP), after tensor parallelism")
    mp_policy, offload_policy = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    modules = _root_modules(module)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ValueError("reshard_after_forward must be a bool, an int or None, "
                         f"got {reshard_after_forward!r}")
    dp = resolve_mesh(mesh)
    _check_post_forward_size(reshard_after_forward, [dp])
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    ignored = {id(p) for p in (ignored_params or ())}
    own, foreign = _collect(modules, ignored)
    meshes: Dict[_MeshKey, DataParallelMesh] = {}
    by_mesh: Dict[_MeshKey, List[HSDPParam]] = {}
    for param, name, slots in own.values():
        _check_param(name, param, dp, offload)
        try:
            param_dp, shard_dim = _placement(param, shard_placement_fn, dp, meshes)
            hsdp_param = HSDPParam(param, slots, param_dp, shard_dim)
        except ValueError as err:
            raise ValueError(f"parameter {name!r}: {err}") from err
        by_mesh.setdefault((param_dp.shard_group, param_dp.replicate_group), []).append(hsdp_param)
    _check_post_forward_size(reshard_after_forward, list(meshes.values()))
    subgroups = []
    for key, mesh_params in by_mesh.items():
        post_forward_group = _post_forward_group(reshard_after_forward, meshes[key])
        if post_forward_group is not None and any(p.extension for p in mesh_params):
            raise ValueError(f"reshard_after_forward={reshard_after_forward} (an int) is not supported for "
                             "parameters with all-gather extensions (fsdp_pre_all_gather, e.g. torchao float8 "
                             "weights): use True or False")
        subgroups.append(MeshSubgroup(meshes[key], mesh_params, mp_policy, post_forward_group))
    params = [p for sub in subgroups for p in sub.params]
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = reshard_after_forward != 1  # 1: a group of one rank keeps everything
    group = HSDPParamGroup(subgroups, mp_policy, offload_policy, reshard_after_forward)
    for hsdp_param in params:
        hsdp_param.use_sharded()
    load_slots = [(mod, name, p) for p in params for mod, name in p.slots]
    borrowed: List[HSDPState] = []  # (foreign parameters are owned by earlier calls' groups)
    for mod, name, param in foreign:
        owner_param, owner = _owner(param)
        owner.group.add_slot(owner_param, mod, name)
        load_slots.append((mod, name, owner_param))
        if owner not in borrowed:
            borrowed.append(owner)
    _register_full_state_dict_loading(load_slots)
    state = HSDPState(modules, group, mp_policy, borrowed)
    for hsdp_param in params:
        _OWNERS[id(hsdp_param.original())] = _OWNERS[id(hsdp_param.sharded_param)] = state
    for mod in modules:
        mod.__dict__["_hsdp_state"] = state  # on mod itself, even if it forwards setattr (torch.compile)
        cls = type(mod)
        if cls not in _CLASS_CACHE:
            _CLASS_CACHE[cls] = type(f"HSDP{cls.__name__}", (FSDPModule, cls), {})
        mod.__class__ = _CLASS_CACHE[cls]
    return module
