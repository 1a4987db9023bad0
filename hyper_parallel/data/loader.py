"""A stateful loader whose data order is defined on the global batch, not on the rank layout."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import torch

from hyper_parallel.data.sources import TokenSource


class DistributedBatchLoader:
    """Yields this data-parallel rank's slice of each global batch.

    Global batch ``b`` holds the samples at global positions ``b*G .. b*G+G-1`` (``G`` =
    ``global_batch_size``). For finite sources, position ``p`` maps to sample
    ``perm_e[p mod N]`` with ``perm_e`` a permutation seeded by ``(seed, epoch e = p // N)``
    (identity when ``shuffle`` is off); unbounded sources use ``p`` directly. Rank ``r`` of
    ``D`` takes rows ``r*G/D .. (r+1)*G/D`` of every global batch, so any rank layout sees the
    same global batches, and a loader restored from :meth:`state_dict` continues exactly where
    the saved one stopped, whatever the new number of ranks.

    ``micro_batches`` ``M`` (the steps' gradient accumulation): the global batch is cut into
    ``M`` global micro-batches of ``G/M`` consecutive rows first, and rank ``r`` takes its
    ``1/D`` of each, in order; so the ``m``-th ``1/M`` of every rank's slice (the ``m``-th
    micro-step) holds, over all ranks, the same rows whatever ``D`` (what a mixture of experts
    balances over: see :meth:`~hyper_parallel.models.moe_layer.MoE.set_balance_group`).

    Raises:
        ValueError: ``global_batch_size`` not divisible by ``dp_size x micro_batches`` or a rank
            out of range.
    """

    def __init__(self, source: TokenSource, global_batch_size: int, *, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, micro_batches: int = 1):
        if global_batch_size % (dp_size * micro_batches):
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by {dp_size} data-parallel ranks"
                             + (f" x {micro_batches} micro-batches" if micro_batches > 1 else ""))
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside dp_size={dp_size}")
        self.source, self.global_batch_size = source, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.micro_batches = micro_batches
        self.batches_consumed = 0
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[torch.Tensor] = None

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    def _sample_index(self, position: int) -> int:
        n = self.source.num_samples
        if n is None:
            return position
        epoch, offset = divmod(position, n)
        if not self.shuffle:
            return offset
        if self._perm_epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(n, generator=gen), epoch
        return int(self._perm[offset])

    def peek(self) -> torch.Tensor:
        """This rank's ``(local_batch_size, seq_len + 1)`` slice of the next global batch,
        without moving past it (see :meth:`advance`)."""
        micro = self.global_batch_size // self.micro_batches  # rows of one global micro-batch
        part = micro // self.dp_size  # this rank's rows of it
        start = self.batches_consumed * self.global_batch_size + self.dp_rank * part
        positions = [start + m * micro + i for m in range(self.micro_batches) for i in range(part)]
        return self.source.samples([self._sample_index(p) for p in positions])

    def advance(self) -> None:
        """Count the next global batch as consumed (the position a checkpoint records)."""
        self.batches_consumed += 1

    def next_batch(self) -> torch.Tensor:
        """This rank's slice of the next global batch; moves past it."""
        batch = self.peek()
        self.advance()
        return batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "batches_consumed": self.batches_consumed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.source.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position.

        Raises:
            ValueError: the saved loader used another global batch, sequence length, seed or
                shuffle setting (the data order would silently differ).
        """
        mine = self.state_dict()
        changed = [k for k in ("global_batch_size", "seq_len", "seed", "shuffle")
                   if k in state and state[k] != mine[k]]
        if changed:
            detail = ", ".join(f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(f"cannot resume the data loader with a different data order ({detail})")
        self.batches_consumed = int(state["batches_consumed"])
