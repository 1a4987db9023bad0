"""``Stateful``: objects checkpointed through ``state_dict()`` / ``load_state_dict()``."""

from __future__ import annotations

from typing import Any, Dict, Protocol, Tuple, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object saved as its ``state_dict()`` and restored with ``load_state_dict()``
    (modules, optimizers, :class:`ModelState`, :class:`OptimizerState`, data loaders).

    Runtime-checkable so that a top-level value of a state dict can be recognised by
    ``isinstance`` (methods present), as torch DCP does.
    """

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...


def resolve_stateful(state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Stateful]]:
    """``state_dict`` with its top-level Stateful values replaced by their ``state_dict()``,
    and those Stateful objects by key (the same dict and ``{}`` when there are none)."""
    stateful = {key: value for key, value in state_dict.items() if isinstance(value, Stateful)}
    if not stateful:
        return state_dict, {}
    return {key: value.state_dict() if key in stateful else value for key, value in state_dict.items()}, stateful
