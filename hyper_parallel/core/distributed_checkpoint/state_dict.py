"""Model state dicts keyed by parameter FQN, sharded (DTensor) or full, and the options and
tensor helpers the optimizer's (``optimizer_state_dict.py``) share.

``get_*`` return state dicts whose tensors keep the parameters' layout (DTensors for sharded
parameters) or, with ``StateDictOptions(full_state_dict=True)``, gathered plain tensors.
``set_*`` accept either form and copy the values in place into the model's / optimizer's
current layout, so a state saved on one mesh loads into a model sharded differently.

``model`` is one module or a sequence of model parts with disjoint FQNs (the pipeline stages a
rank holds: ``hyper_parallel.models.llama_parallel.split_stage`` keeps the full model's
names), whose state dicts are merged: a checkpoint saved by pipeline stages loads into the
whole model and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint.errors import short_repr
from hyper_parallel.core.layout import local_part
from hyper_parallel.utils.ranks import rank_and_world

__all__ = [
    "StateDictOptions",
    "IncompatibleKeys",
    "get_model_state_dict",
    "set_model_state_dict",
    "ModelState",
]

# Module attribute names that wrappers (activation checkpointing, torch.compile, FSDP1) insert
# into FQNs; they are dropped so a checkpoint does not depend on how the model was wrapped.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

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
        raise KeyError(  # the first few of each (a model of 48 MoE blocks differs in hundreds of keys)
            f"{what} does not match: missing keys {short_repr(result.missing_keys, 400)}, "
            f"unexpected keys {short_repr(result.unexpected_keys, 400)}"
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
