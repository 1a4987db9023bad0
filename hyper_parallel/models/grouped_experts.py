"""The routed experts of a mixture of experts as grouped GEMM: SwiGLU experts held as 3-D
weights (expert on dim 0), multiplied in one grouped GEMM per weight where the device and dtype
have it, else by one split fallback; the choice is made in :func:`expert_matmul`."""

from __future__ import annotations

import enum
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel._torch_compat import grouped_mm, grouped_mm_dtypes

__all__ = ["ExpertMatmul", "GroupedExperts", "expert_matmul"]


class ExpertMatmul(enum.Enum):
    """How :class:`GroupedExperts` multiplies each expert's rows by its weights."""

    GROUPED_MM = "grouped_mm"  # one grouped GEMM per weight, offsets on the device (no host sync)
    SPLIT = "split"            # the rows split on the host counts, one matmul per expert with rows (any dtype)


def expert_matmul(x: torch.Tensor, *weights: torch.Tensor) -> ExpertMatmul:
    """The one place the experts' matmul is chosen: grouped GEMM where the device and dtype
    have it (``x`` and every weight of one dtype, every row stride a multiple of 16 bytes, as
    its kernels load rows with TMA), else the split fallback (e.g. float64, or odd sizes)."""
    dtype = x.dtype
    if dtype not in grouped_mm_dtypes(x.device) or any(w.dtype != dtype for w in weights):
        return ExpertMatmul.SPLIT
    align = 16 // x.element_size()
    aligned = all(t.shape[-1] % align == 0 and t.is_contiguous() and t.storage_offset() % align == 0
                  for t in (x, *weights))
    return ExpertMatmul.GROUPED_MM if aligned else ExpertMatmul.SPLIT


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts, their weights stacked on dim 0: ``w1``, ``w3``
    ``[num_experts, hidden_dim, dim]`` and ``w2`` ``[num_experts, dim, hidden_dim]`` (each
    expert's slice is laid out as an ``nn.Linear`` weight, out x in).

    Expert ``e`` computes ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))`` for each of its rows, all
    experts at once with grouped GEMM (:func:`expert_matmul` chooses; ``matmul`` set to an
    :class:`ExpertMatmul` forces one, e.g. for a benchmark). Neither path indexes a weight per
    expert, so the backward writes each weight's gradient once, whatever the number of experts.
    """

    matmul: Optional[ExpertMatmul]

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.matmul = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x``: ``[N, dim]``, rows sorted by expert; ``num_tokens_per_expert``: integer, one
        count per expert of dim 0 (on ``x``'s device), summing to ``N`` (the grouped path reads
        them on the device only: their values are not checked there). Returns ``[N, dim]`` in
        the rows' order.

        Raises:
            ValueError: ``x`` is not 2-D or the counts are not one per expert.
        """
        w1, w2, w3 = self.w1, self.w2, self.w3
        if x.dim() != 2 or num_tokens_per_expert.shape != (w1.shape[0],):
            raise ValueError(f"GroupedExperts needs x [tokens, dim] and one count per expert ({w1.shape[0]}), got "
                             f"x {tuple(x.shape)} and num_tokens_per_expert {tuple(num_tokens_per_expert.shape)}")
        matmul = self.matmul or expert_matmul(x, w1, w2, w3)
        if matmul is ExpertMatmul.GROUPED_MM:
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        return _split_experts(x, num_tokens_per_expert, w1, w2, w3)


def _split_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """The experts without grouped GEMM: the rows split by the counts (read on the host: one
    sync on an accelerator), the weights by ``unbind`` (one view per expert, whose backward
    stacks the experts' gradients into one tensor), a matmul chain per expert with rows.

    Raises:
        ValueError: the counts are negative or do not sum to the rows.
    """
    sizes = counts.tolist()
    if sum(sizes) != x.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(f"num_tokens_per_expert must hold non-negative counts summing to the {x.shape[0]} rows "
                         f"of x, got {sizes}")
    rows, w1s, w2s, w3s = x.split(sizes), w1.unbind(0), w2.unbind(0), w3.unbind(0)
    # Experts without rows are skipped; with no rows at all, expert 0 runs on the empty rows so
    # that the weights still take part in autograd (zero gradients).
    active = [e for e, size in enumerate(sizes) if size] or [0]
    outs = [F.linear(F.silu(F.linear(rows[e], w1s[e])) * F.linear(rows[e], w3s[e]), w2s[e]) for e in active]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
