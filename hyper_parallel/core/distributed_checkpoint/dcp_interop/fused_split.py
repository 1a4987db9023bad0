"""Fused attention projections cut into their parts at import (``import-dcp --split-fused``).

A fused ``wqkv`` weight (or bias, or an optimizer moment of either) holds the query, key and
value projections stacked along dim 0, in one of two known layouts:

- ``grouped`` (torchtitan 0.3.0's ``FusedQKVLinear``): one block per key/value head, each
  ``n_heads // n_kv_heads`` query heads, then that key head, then that value head;
- ``concat``: all query heads, then all key heads, then all value heads (``[q; k; v]``).

Each part is a list of row ranges of the fused tensor (head_dim follows from its rows:
``rows / (n_heads + 2 * n_kv_heads)``); :func:`part_chunks` cuts a stored chunk of the fused
tensor into the chunks of a part, so a split streams chunk by chunk like any import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import ChunkStorageMetadata

__all__ = ["FusedLayout", "FusedSplit", "PartChunk", "part_chunks", "part_sizes"]

Rows = Tuple[Tuple[int, int], ...]
"""Row ranges ``(start, length)`` of a fused tensor along dim 0, in the order of the part's rows."""


class FusedLayout(enum.Enum):
    """How the parts of a fused projection are stacked along dim 0 (see the module docstring)."""

    GROUPED = "grouped"
    CONCAT = "concat"


@dataclass(frozen=True)
class FusedSplit:
    """``--split-fused FUSED=Q,K,V:N_HEADS:N_KV_HEADS[:grouped|concat]``: every key with the
    dotted component ``fused`` is imported as three keys with ``parts`` in its place; tensors
    of one or more dims are cut along dim 0, values and 0-dim tensors (Adam's ``step``) are
    copied to each part."""

    fused: str
    parts: Tuple[str, str, str]
    n_heads: int
    n_kv_heads: int
    layout: FusedLayout = FusedLayout.GROUPED

    def __post_init__(self) -> None:
        names = (self.fused, *self.parts)
        if any(not n or "." in n or "*" in n for n in names) or len(set(names)) != 4:
            raise ValueError(f"--split-fused names {names} must be four different dotted components")
        if self.n_kv_heads < 1 or self.n_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"--split-fused: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (both at least 1)")

    @classmethod
    def parse(cls, text: str) -> "FusedSplit":
        """``FUSED=Q,K,V:N_HEADS:N_KV_HEADS[:LAYOUT]``, e.g. ``wqkv=wq,wk,wv:32:8``.

        Raises:
            ValueError: anything else (says the expected form).
        """
        form = (f"--split-fused takes FUSED=Q,K,V:N_HEADS:N_KV_HEADS[:grouped|concat] (e.g. wqkv=wq,wk,wv:32:8), "
                f"not {text!r}")
        fused, sep, rest = text.partition("=")
        fields = rest.split(":")
        parts = tuple(fields[0].split(","))
        if not sep or len(parts) != 3 or len(fields) not in (3, 4) or not all(f.isdigit() for f in fields[1:3]):
            raise ValueError(form)
        layouts = {layout.value: layout for layout in FusedLayout}
        if len(fields) == 4 and fields[3] not in layouts:
            raise ValueError(f"{form}: unknown layout {fields[3]!r}")
        return cls(fused, parts, int(fields[1]), int(fields[2]), layouts[fields[3]] if len(fields) == 4
                   else FusedLayout.GROUPED)

    def part_keys(self, key: str) -> List[str]:
        """The three keys ``key`` is split into (its first ``fused`` component replaced), or
        ``[]`` when it has no such component."""
        components = key.split(".")
        if self.fused not in components:
            return []
        at = components.index(self.fused)
        return [".".join(components[:at] + [part] + components[at + 1:]) for part in self.parts]

    def part_rows(self, rows: int, key: str) -> List[Rows]:
        """Per part, its row ranges of a fused tensor of ``rows`` rows.

        Raises:
            CheckpointError: ``rows`` is not a multiple of ``n_heads + 2 * n_kv_heads`` (names ``key``).
        """
        heads = self.n_heads + 2 * self.n_kv_heads
        if rows % heads or not rows:
            raise CheckpointError(f"cannot split {key!r} ({rows} rows on dim 0) into {list(self.parts)}: "
                                  f"it is not n_heads + 2 * n_kv_heads = {heads} heads of one size; "
                                  "check N_HEADS and N_KV_HEADS of --split-fused")
        hd, per_kv = rows // heads, self.n_heads // self.n_kv_heads
        if self.layout is FusedLayout.CONCAT:
            q, kv = self.n_heads * hd, self.n_kv_heads * hd
            return [((0, q),), ((q, kv),), ((q + kv, kv),)]
        block = (per_kv + 2) * hd
        return [tuple((g * block, per_kv * hd) for g in range(self.n_kv_heads)),
                tuple((g * block + per_kv * hd, hd) for g in range(self.n_kv_heads)),
                tuple((g * block + (per_kv + 1) * hd, hd) for g in range(self.n_kv_heads))]


@dataclass(frozen=True)
class PartChunk:
    """One chunk of a part: where it lies in the part (``chunk``), the stored chunk of the
    fused tensor it comes from (``source_offsets``) and that chunk's rows it takes, in order
    (``rows``, relative to the stored chunk)."""

    chunk: ChunkStorageMetadata
    source_offsets: Tuple[int, ...]
    rows: Rows


def part_chunks(rows: Rows, stored: Sequence[ChunkStorageMetadata]) -> List[PartChunk]:
    """The chunks of the part made of ``rows`` of a tensor stored as ``stored``: each stored
    chunk gives one chunk per run of the part's rows that it holds and that lie next to each
    other in the part (one per stored chunk for both layouts), at the same offsets on the
    other dims."""
    out: List[PartChunk] = []
    for chunk in stored:
        start, stop = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        run: List[Tuple[int, int]] = []
        run_at, at = None, 0  # run_at: the part row the current run starts at
        for begin, length in rows:
            lo, hi = max(begin, start), min(begin + length, stop)
            if lo < hi:
                part_row = at + lo - begin
                if run_at is not None and part_row != run_at + sum(n for _, n in run):
                    out.append(_part_chunk(chunk, run_at, run))
                    run = []
                if not run:
                    run_at = part_row
                run.append((lo - start, hi - lo))
            at += length
        if run:
            out.append(_part_chunk(chunk, run_at, run))
    return out


def _part_chunk(chunk: ChunkStorageMetadata, part_row: int, run: List[Tuple[int, int]]) -> PartChunk:
    rows = sum(n for _, n in run)
    return PartChunk(ChunkStorageMetadata((part_row, *chunk.offsets[1:]), (rows, *chunk.sizes[1:])),
                     tuple(chunk.offsets), tuple(run))


def part_sizes(rows: Rows, size: Sequence[int]) -> Tuple[int, ...]:
    """The size of the part made of ``rows`` of a tensor of ``size``."""
    return (sum(n for _, n in rows), *size[1:])

