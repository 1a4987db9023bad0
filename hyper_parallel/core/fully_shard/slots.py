"""The module attributes a parameter group writes on every unshard and reshard."""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch

from hyper_parallel.core.fully_shard.param import HSDPParam


class ParamSlot(NamedTuple):
    """A module attribute holding a managed parameter, and the parameter that a reshard (or
    unshard) registers there."""

    # The module's ``_parameters``, written directly (FSDP2's unsafe_setattr_param): no
    # ``__setattr__`` of the module runs for every unshard and reshard.
    registry: Dict[str, Optional[torch.nn.Parameter]]
    name: str
    param: torch.nn.Parameter

    def register(self) -> None:
        self.registry[self.name] = self.param


class UnshardedSlot(NamedTuple):
    """A module attribute that an unshard points at its parameter's unsharded tensor. It holds
    the parameter, not that tensor: a tensor-subclass extension's is built by its first gather."""

    registry: Dict[str, Optional[torch.nn.Parameter]]
    name: str
    param: HSDPParam

    def register(self) -> None:
        self.registry[self.name] = self.param.unsharded_param
