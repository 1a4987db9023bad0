"""``patch_torch_fsdp()``: hyper_parallel's fully_shard under torch's FSDP2 names, for programs
written against ``torch.distributed.fsdp.fully_shard`` (torchtitan, accelerate), in one line."""

from __future__ import annotations

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


class TorchFSDPPatch:
    """The names :func:`patch_torch_fsdp` replaced; :meth:`undo` (or leaving the ``with``
    block) puts torch's back. Patches nest: undo them in reverse order."""

    def __init__(self, saved: List[Tuple[ModuleType, str, Any]]):
        self._saved = saved

    @property
    def active(self) -> bool:
        """The replaced names are still ours (not yet undone)."""
        return bool(self._saved)

    def undo(self) -> None:
        """Restore the names this patch replaced (idempotent)."""
        saved, self._saved = self._saved, []
        for module, name, original in reversed(saved):
            setattr(module, name, original)

    def __enter__(self) -> "TorchFSDPPatch":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.undo()


def patch_torch_fsdp() -> TorchFSDPPatch:
    """Make torch's FSDP2 names hyper_parallel's: ``fully_shard``, ``FSDPModule``,
    ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy`` and
    ``register_fsdp_forward_method`` in ``torch.distributed.fsdp`` and in the private torch modules
    that also export them (``_torch_compat.fsdp2_export_modules``). Code importing these names afterwards (at module
    import or inside functions, as accelerate does) gets ours; names a module bound before the
    call stay torch's, so patch before importing the client's training code.

    Our ``FSDPModule`` subclasses torch's, so ``isinstance`` checks with either class hold for
    our modules; torch's policy objects created before the patch are converted by ``fully_shard``.

    Returns:
        A :class:`TorchFSDPPatch`: ``.undo()`` restores torch's names; also a context manager
        (``with hp.patch_torch_fsdp(): ...`` restores them on exit).
    """
    saved: List[Tuple[ModuleType, str, Any]] = []
    for module in fsdp2_export_modules():
        for name, ours in REPLACEMENTS.items():
            if name in vars(module):
                saved.append((module, name, vars(module)[name]))
                setattr(module, name, ours)
    return TorchFSDPPatch(saved)
