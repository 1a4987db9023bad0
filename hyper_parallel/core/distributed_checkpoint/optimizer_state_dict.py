"""Optimizer state dicts keyed by parameter FQN (``{"state": {fqn: {...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``) instead of torch's integer ids, so they reshard like the
parameters themselves; sharded (DTensor) or full as the model's (``state_dict.py``), and with
the same ``model``: one module or the pipeline stages a rank holds.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint.state_dict import (
    IncompatibleKeys,
    Model,
    StateDictOptions,
    _check_keys,
    _export,
    _finish,
    _local_part,
    _merge_parts,
    _options,
    copy_into,
    model_parts,
)

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict", "OptimizerState"]

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


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
