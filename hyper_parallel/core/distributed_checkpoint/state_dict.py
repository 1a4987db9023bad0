"""Model and optimizer state dicts keyed by parameter FQN, sharded (DTensor) or full.

``get_*`` return state dicts whose tensors keep the parameters' layout (DTensors for sharded
parameters) or, with ``StateDictOptions(full_state_dict=True)``, gathered plain tensors.
``set_*`` accept either form and copy the values in place into the model's / optimizer's
current layout, so a state saved on one mesh loads into a model sharded differently.

Optimizer state is keyed by the parameter's FQN (``{"state": {fqn: {...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``) instead of torch's integer ids, so it reshards like the
parameters themselves.

``model`` is one module or a sequence of model parts with disjoint FQNs (the pipeline stages a
rank holds: ``hyper_parallel.pipeline.split_stage`` keeps the full model's names), whose state
dicts are merged: a checkpoint saved by pipeline stages loads into the whole model and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.layout import local_part
from hyper_parallel.utils.ranks import rank_and_world

__all__ = [
    "StateDictOptions",
    "IncompatibleKeys",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "ModelState",
    "OptimizerState",
]

# Module attribute names that wrappers (activation checkpointing, torch.compile, FSDP1) insert
# into FQNs; they are dropped so a checkpoint does not depend on how the model was wrapped.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"

#: One model, or its parts (e.g. the pipeline stages of one rank) with disjoint FQNs.
Model = Union[nn.Module, Sequence[nn.Module]]


@dataclass(frozen=True)
class StateDictOptions:
    """How state dicts are produced and applied.

    Attributes:
        full_state_dict: ``get_*`` gather DTensors into full plain tensors (a collective: every
            rank must call).
        cpu_offload: tensors are returned on CPU; with ``full_state_dict`` only rank 0 gets
            the values (other ranks get an empty dict), which bounds memory to one copy.
        strict: ``set_*`` raise on missing/unexpected keys; otherwise they are reported in
            the returned :class:`IncompatibleKeys`.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True


class IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def canonical_fqn(name: str) -> str:
    """``name`` without wrapper segments (``_orig_mod``, ``_checkpoint_wrapped_module``, ...)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _options(options: StateDictOptions | None) -> StateDictOptions:
    return options if options is not None else StateDictOptions()


def _export_tensor(value: torch.Tensor, options: StateDictOptions) -> torch.Tensor:
    """One tensor of a state dict as ``options`` want it (collective when gathering)."""
    value = value.detach()
    if isinstance(value, DTensor):
        if options.full_state_dict:
            value = value.full_tensor()
        elif options.cpu_offload:
            return DTensor.from_local(
                value.to_local().cpu(), value.device_mesh, value.placements,
                shape=value.shape, stride=value.stride(), run_check=False,
            )
    return value.cpu() if options.cpu_offload else value


def _rank0_only(options: StateDictOptions) -> bool:
    # Full + offloaded state lives on rank 0 only: one host copy for the whole job.
    return options.full_state_dict and options.cpu_offload


def _export(values: Dict[str, Any], options: StateDictOptions) -> Dict[str, Any]:
    """Apply ``options`` to every tensor of a (nested) dict, in a fixed order on all ranks.

    Ranks that do not keep the values (rank-0-only state) drop each gathered tensor at once.
    """
    keep = not _rank0_only(options) or rank_and_world()[0] == 0
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out[key] = _export(value, options)
        elif isinstance(value, torch.Tensor):
            exported = _export_tensor(value, options)
            if keep:
                out[key] = exported
        else:
            out[key] = value
    return out


def _finish(state: Dict[str, Any], options: StateDictOptions) -> Dict[str, Any]:
    return {} if _rank0_only(options) and rank_and_world()[0] != 0 else state


def _check_keys(missing: Iterable[str], unexpected: Iterable[str], what: str,
                strict: bool) -> IncompatibleKeys:
    result = IncompatibleKeys(sorted(missing), sorted(unexpected))
    if strict and (result.missing_keys or result.unexpected_keys):
        raise KeyError(
            f"{what} does not match: missing keys {result.missing_keys}, "
            f"unexpected keys {result.unexpected_keys}"
        )
    return result


def _local_part(value: torch.Tensor, like: DTensor, key: str) -> torch.Tensor:
    """This rank's part of ``value`` laid out like ``like`` (no communication for a full value)."""
    if isinstance(value, DTensor):
        if value.device_mesh != like.device_mesh:
            raise ValueError(
                f"{key}: DTensor value is on mesh {value.device_mesh}, the target on "
                f"{like.device_mesh}; pass a full tensor (full_state_dict=True) instead"
            )
        if tuple(value.placements) != tuple(like.placements):
            value = value.redistribute(like.device_mesh, like.placements)
        return value.to_local()
    return local_part(value, like)  # a full value: every rank takes its own part, no communication


@torch.no_grad()
def copy_into(target: torch.Tensor, value: torch.Tensor, key: str) -> None:
    """Copy ``value`` (sharded DTensor or full tensor) into ``target`` in place, keeping its layout.

    Raises:
        ValueError: global shapes differ, or a DTensor value lives on another mesh.
    """
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"{key}: shape mismatch, checkpoint has {tuple(value.shape)}, "
            f"model expects {tuple(target.shape)}"
        )
    if isinstance(target, DTensor):
        target.to_local().copy_(_local_part(value, target, key))
    else:
        target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


# ----------------------------------------------------------------------------- model


def model_parts(model: Model) -> List[nn.Module]:
    """``model`` as a list of parts (one module: a list of one)."""
    return [model] if isinstance(model, nn.Module) else list(model)


def _merge_parts(named: Iterable[Iterable[tuple]]) -> Dict[str, Any]:
    """Canonical FQN -> value over every part's ``(name, value)`` pairs; within a part the
    first name wins (tied parameters), across parts a name may appear only once."""
    merged: Dict[str, Any] = {}
    for pairs in named:
        own: Dict[str, Any] = {}
        for name, value in pairs:
            own.setdefault(canonical_fqn(name), value)
        shared = own.keys() & merged.keys()
        if shared:
            raise ValueError(f"model parts must have disjoint names, {sorted(shared)[0]!r} is in two of them")
        merged.update(own)
    return merged


def _model_tensors(model: Model) -> Dict[str, torch.Tensor]:
    """Canonical FQN -> the model's own parameter/buffer tensor (what ``state_dict`` covers)."""
    return _merge_parts(part.state_dict(keep_vars=True).items() for part in model_parts(model))


def get_model_state_dict(model: Model, *, options: StateDictOptions | None = None) -> Dict[str, Any]:
    """The model's parameters and persistent buffers keyed by FQN (wrapper segments removed).

    Sharded by default: tensors share storage with the model (DTensors stay DTensors).
    """
    options = _options(options)
    return _finish(_export(_model_tensors(model), options), options)


def set_model_state_dict(model: Model, state_dict: Dict[str, Any], *,
                         options: StateDictOptions | None = None) -> IncompatibleKeys:
    """Copy ``state_dict`` (sharded DTensors or full tensors) into the model in place.

    Full values are split into each parameter's current layout locally, so every rank must
    hold them.

    Raises:
        KeyError: with ``strict``, missing or unexpected keys (all of them named).
        ValueError: a value's shape differs from the parameter's (the key is named).
    """
    options = _options(options)
    targets = _model_tensors(model)
    result = _check_keys(targets.keys() - state_dict.keys(), state_dict.keys() - targets.keys(),
                         "model state dict", options.strict)
    for key, target in targets.items():
        if key in state_dict:
            copy_into(target, state_dict[key], key)
    return result


# ------------------------------------------------------------------------- optimizer


def _param_fqns(model: Model) -> Dict[nn.Parameter, str]:
    """Parameter -> its first canonical FQN (tied parameters get one name)."""
    fqns: Dict[nn.Parameter, str] = {}
    named = _merge_parts(part.named_parameters(remove_duplicate=False) for part in model_parts(model))
    for name, param in named.items():
        fqns.setdefault(param, name)
    return fqns


def _optimizer_fqns(model: Model, optim: torch.optim.Optimizer) -> Dict[nn.Parameter, str]:
    fqns = _param_fqns(model)
    for group in optim.param_groups:
        for param in group[_PARAMS]:
            if param not in fqns:
                raise ValueError(
                    f"optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                    "a parameter of the model"
                )
    return fqns


@torch.no_grad()
def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state so it can be saved or loaded into.

    Runs one ``step`` with zero gradients and ``lr=0`` (parameters do not change), then
    resets ``step`` counters to 0 so the next real step behaves like the first one.
    Existing gradients are left untouched. Does nothing once any state exists.
    """
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group[_PARAMS] if p.requires_grad]
    zeroed = [p for p in params if p.grad is None]
    saved = {p: p.grad for p in params if p.grad is not None}
    for param in params:
        param.grad = torch.zeros_like(param)
    lrs = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for param in zeroed:
            param.grad = None
        for param, grad in saved.items():
            param.grad = grad
    for state in optim.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def get_optimizer_state_dict(model: Model, optim: torch.optim.Optimizer, *,
                             options: StateDictOptions | None = None) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter FQN (initialised first if no step was taken).

    Returns ``{"state": {fqn: {name: tensor}}, "param_groups": [{..., "params": [fqn]}]}``;
    per-parameter tensors keep the parameter's layout (DTensors) unless ``full_state_dict``.
    """
    options = _options(options)
    fqns = _optimizer_fqns(model, optim)
    init_optimizer_state(optim)
    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    for group in optim.param_groups:
        for param in group[_PARAMS]:
            if optim.state.get(param):
                state[fqns[param]] = dict(optim.state[param])
        groups.append({**{k: v for k, v in group.items() if k != _PARAMS},
                       _PARAMS: [fqns[p] for p in group[_PARAMS]]})
    return _finish({_STATE: _export(state, options), _GROUPS: groups}, options)


def _restore_hyperparams(group: Dict[str, Any], saved: Dict[str, Any]) -> None:
    for key, value in saved.items():
        if key == _PARAMS:
            continue
        current = group.get(key)
        if isinstance(current, tuple) and isinstance(value, list):
            value = tuple(value)  # JSON has no tuples (betas)
        if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
            current.fill_(value)
        else:
            group[key] = value


def _set_param_state(param: nn.Parameter, current: Dict[str, Any], saved: Dict[str, Any],
                     fqn: str) -> None:
    for name, value in saved.items():
        target = current.get(name)
        key = f"{fqn}.{name}"
        if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
            copy_into(target, value, key)
        elif isinstance(value, torch.Tensor) and isinstance(param, DTensor) and value.shape == param.shape:
            current[name] = DTensor.from_local(
                _local_part(value, param, key).clone(), param.device_mesh, param.placements,
                shape=param.shape, stride=param.stride(), run_check=False,
            )
        elif isinstance(value, torch.Tensor):
            current[name] = value.detach().clone()
        else:
            current[name] = value


def set_optimizer_state_dict(model: Model, optim: torch.optim.Optimizer, state_dict: Dict[str, Any],
                             *, options: StateDictOptions | None = None) -> IncompatibleKeys:
    """Load an FQN-keyed optimizer state dict (sharded or full) into ``optim`` in place.

    Hyper-parameters of each param group are restored from the saved group that holds the
    same parameters.

    Raises:
        KeyError: with ``strict``, parameters without saved state / saved state of unknown
            parameters (named as ``state.<fqn>`` / ``param_groups.<fqn>``).
        ValueError: a saved tensor's shape differs from the parameter's (the key is named).
    """
    options = _options(options)
    fqns = _optimizer_fqns(model, optim)
    init_optimizer_state(optim)
    saved_state: Dict[str, Any] = state_dict.get(_STATE, {})
    saved_groups = {fqn: group for group in state_dict.get(_GROUPS, []) for fqn in group[_PARAMS]}
    owned = {fqns[p]: p for group in optim.param_groups for p in group[_PARAMS]}
    expected_state = {fqn for fqn, p in owned.items() if optim.state.get(p)}
    missing = [f"{_STATE}.{f}" for f in expected_state - saved_state.keys()]
    missing += [f"{_GROUPS}.{f}" for f in owned.keys() - saved_groups.keys()]
    unexpected = [f"{_STATE}.{f}" for f in saved_state.keys() - owned.keys()]
    unexpected += [f"{_GROUPS}.{f}" for f in saved_groups.keys() - owned.keys()]
    result = _check_keys(missing, unexpected, "optimizer state dict", options.strict)
    for fqn, param in owned.items():
        if fqn in saved_state:
            _set_param_state(param, optim.state[param], saved_state[fqn], fqn)
    for group in optim.param_groups:
        names = [fqns[p] for p in group[_PARAMS]]
        if names and names[0] in saved_groups:
            _restore_hyperparams(group, saved_groups[names[0]])
    return result


# ------------------------------------------------------------------- Stateful wrappers


class ModelState:
    """Stateful view of a model for checkpointing (``CheckpointManager``, ``save``/``load``).
    ``model``: one module or a sequence of parts with disjoint FQNs (pipeline stages)."""

    def __init__(self, model: Model, options: StateDictOptions | None = None):
        self.model, self.options = model, options

    @property
    def parts(self) -> List[nn.Module]:
        """The model's parts (one module: a list of one)."""
        return model_parts(self.model)

    def state_dict(self) -> Dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


class OptimizerState:
    """Stateful view of an optimizer, keyed by the FQNs of ``model``'s parameters (``model``:
    one module or a sequence of parts, as for :class:`ModelState`).

    With pipeline parallelism pass ``pp_group`` (the ranks holding the other stages): each
    rank's ``param_groups`` list only its stages' parameters, so ``state_dict`` gathers the
    stages' lists over the group (a checkpoint holds one value for the whole job: the groups of
    every stage, in stage order), and ``load_state_dict`` keeps the saved groups' entries for
    this rank's parameters. A collective: every rank of ``pp_group`` calls both together.
    """

    def __init__(self, model: Model, optim: torch.optim.Optimizer,
                 options: StateDictOptions | None = None, *, pp_group: Optional[dist.ProcessGroup] = None):
        self.model, self.optim, self.options, self.pp_group = model, optim, options, pp_group

    def state_dict(self) -> Dict[str, Any]:
        state_dict = get_optimizer_state_dict(self.model, self.optim, options=self.options)
        if self.pp_group is not None and _GROUPS in state_dict:
            gathered: List[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, state_dict[_GROUPS], group=self.pp_group)
            state_dict[_GROUPS] = [group for stage_groups in gathered for group in stage_groups]
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.pp_group is not None and _GROUPS in state_dict:
            own = set(_param_fqns(self.model).values())
            groups = [{**group, _PARAMS: [fqn for fqn in group[_PARAMS] if fqn in own]}
                      for group in state_dict[_GROUPS]]
            state_dict = {**state_dict, _GROUPS: [group for group in groups if group[_PARAMS]]}
        set_optimizer_state_dict(self.model, self.optim, state_dict, options=self.options)
