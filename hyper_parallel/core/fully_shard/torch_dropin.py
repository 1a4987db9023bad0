"""``patch_torch_fsdp()``: hyper_parallel's fully_shard under torch's FSDP2 names, for programs
written against ``torch.distributed.fsdp.fully_shard`` (torchtitan, accelerate), in one line."""

from __future__ import annotations

import sys
from types import ModuleType, TracebackType
from typing import Any, Dict, List, Optional, Tuple, Type

from hyper_parallel._torch_compat import fsdp2_export_modules
from hyper_parallel.core.fully_shard.api import fully_shard
from hyper_parallel.core.fully_shard.module_api import FSDPModule, register_fsdp_forward_method
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

# torch's FSDP2 name -> ours
REPLACEMENTS: Dict[str, Any] = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "register_fsdp_forward_method": register_fsdp_forward_method,
}

# The patches not yet undone, and torch's values of the names they replaced (saved by the
# first): the names stay ours until every patch is undone, in whatever order.
_ACTIVE: List["TorchFSDPPatch"] = []
_TORCH_VALUES: List[Tuple[ModuleType, str, Any]] = []


class TorchFSDPPatch:
    """A :func:`patch_torch_fsdp` call; :meth:`undo` (or leaving the ``with`` block) ends it.
    Patches nest: torch's names come back when the last active patch is undone."""

    def __init__(self) -> None:
        self._active = True
        _ACTIVE.append(self)

    @property
    def active(self) -> bool:
        """Not yet undone (the names are ours while any patch is active)."""
        return self._active

    def undo(self) -> None:
        """End this patch (idempotent); the last active one restores torch's names."""
        if not self._active:
            return
        self._active = False
        _ACTIVE.remove(self)
        if not _ACTIVE:
            for module, name, original in reversed(_TORCH_VALUES):
                setattr(module, name, original)
            _TORCH_VALUES.clear()

    def __enter__(self) -> "TorchFSDPPatch":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.undo()


def patch_torch_fsdp() -> TorchFSDPPatch:
    """Make torch's public FSDP2 names hyper_parallel's: ``fully_shard``, ``FSDPModule``,
    ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy`` and
    ``register_fsdp_forward_method`` in ``torch.distributed.fsdp`` and torch's deprecated path
    to them (the modules of ``_torch_compat.fsdp2_export_modules``). Code importing these names
    afterwards (at module import or inside functions, as accelerate does) gets ours; a module
    imported before the call (not torch's) that bound one of them under the same name (e.g.
    ``from torch.distributed.fsdp import fully_shard``, as ``transformers`` does) has that global
    rebound to ours too. Torch's own modules are left alone, so torch's ``fully_shard`` reached
    through them, or bound by a function before the call, keeps working as torch's.

    Our ``FSDPModule`` subclasses torch's, so ``isinstance`` checks with either class hold for
    our modules; torch's policy objects created before the patch are converted by ``fully_shard``.

    Returns:
        A :class:`TorchFSDPPatch`: ``.undo()`` ends it (the last active patch restores every name
        it replaced); also a context manager (``with hp.patch_torch_fsdp(): ...`` ends it on exit).
    """
    if not _ACTIVE:
        exports = fsdp2_export_modules()
        torch_values = {name: vars(exports[0])[name] for name in REPLACEMENTS}
        for module in [*exports, *_modules_holding(torch_values)]:
            for name, ours in REPLACEMENTS.items():
                if name in vars(module) and (module in exports or vars(module)[name] is torch_values[name]):
                    _TORCH_VALUES.append((module, name, vars(module)[name]))
                    setattr(module, name, ours)
    return TorchFSDPPatch()


def _modules_holding(torch_values: Dict[str, Any]) -> List[ModuleType]:
    """The imported modules, other than torch's and hyper_parallel's, holding one of torch's
    FSDP2 objects as a global of the same name."""
    return [module for name, module in list(sys.modules.items())
            if name.split(".")[0] not in ("torch", "hyper_parallel")
            and isinstance(getattr(module, "__dict__", None), dict)
            and any(module.__dict__.get(key) is value for key, value in torch_values.items())]
