"""Rotary positions: the cos/sin tables (:func:`rope_tables`, with Llama 3.1's frequency
scaling, :class:`RopeScaling`) and their application to query/key heads (:func:`apply_rope`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, List, Mapping, Optional

import torch

from hyper_parallel.models.layers import upcast

__all__ = ["RopeScaling", "apply_rope", "rope_tables"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (``rope_type: llama3`` in ``transformers``).

    Rotary wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, those shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept, and those between are interpolated smoothly. The defaults are
    Llama 3.1's (Llama 3.2 uses ``factor=32``). The field names are ``transformers``' keys.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "RopeScaling":
        """From a mapping of (some of) the field names, e.g. a ``config.json`` entry.

        Raises:
            ValueError: a key that is not a field.
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in values if k not in names)
        if unknown:
            raise ValueError(f"rope_scaling has unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
        return cls(**{str(k): v for k, v in values.items()})

    def problems(self) -> List[str]:
        """What is wrong with the values (empty: nothing)."""
        def real(value: Any) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        found = [f"rope_scaling.{name}={getattr(self, name)!r} must be a finite number > 0"
                 for name in ("factor", "low_freq_factor", "high_freq_factor")
                 if not real(getattr(self, name)) or getattr(self, name) <= 0]
        original = self.original_max_position_embeddings
        if not isinstance(original, numbers.Integral) or isinstance(original, bool) or original < 1:
            found.append(f"rope_scaling.original_max_position_embeddings={original!r} must be a positive integer")
        if found:
            return found
        if self.factor < 1:
            found.append(f"rope_scaling.factor={self.factor!r} must be >= 1 (it stretches wavelengths)")
        if self.low_freq_factor >= self.high_freq_factor:
            found.append(f"rope_scaling.low_freq_factor={self.low_freq_factor!r} must be below "
                         f"rope_scaling.high_freq_factor={self.high_freq_factor!r}")
        return found

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (the computation of Meta's and ``transformers``' Llama 3.1)."""
        wavelen = 2 * math.pi / inv_freq
        original = self.original_max_position_embeddings
        smooth = (original / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        stretched = torch.where(wavelen > original / self.low_freq_factor, inv_freq / self.factor, smoothed)
        return torch.where(wavelen < original / self.high_freq_factor, inv_freq, stretched)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: Optional[RopeScaling] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2); ``scaling``: Llama 3.1's, if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = upcast(x).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)
