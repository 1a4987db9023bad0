"""Context parallelism (CP): a sequence split across the ranks of a CP group, and the context
attention runs under.

Each rank of the group holds a part of every sequence (:class:`Layout`: its chunks, their global
positions, sharding and gathering whole sequences); :func:`context_parallel` declares the group
(and how K/V blocks travel round it, :class:`Rotate`) to the model's attention, which then runs
as ring attention (:mod:`hyper_parallel.parallel.ring_attention`). ``documents=`` adds document
masks for packed sequences (each token attends within its document only; :func:`document_ids`);
without CP, :func:`document_masks` does.
The loss of a rank's tokens is its share of the global mean (:func:`mean_token_loss`).

    with context_parallel(mesh["cp"]) as cp:          # tells the model's attention it runs under CP
        loss = mean_token_loss(model(cp.shard(inputs)), cp.shard(labels), group=dp_cp_group)
        loss.backward()                                # inside the context too

Activation checkpointing recomputes forwards during the backward: run the backward inside the
context as well.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.chunked_loss import summed_token_loss

__all__ = [
    "ContextParallel", "Layout", "Rotate", "chunk_length", "context_parallel", "current_context",
    "current_documents", "document_ids", "document_masks", "gather_sequence", "mean_token_loss", "rope_rows", "sequence_positions", "shard_sequence", "token_loss_scale",
]


class Layout(enum.Enum):
    """How a sequence of length S is split over a CP group of ``cp`` ranks."""

    CONTIGUOUS = "contiguous"  # S cut in cp chunks; rank r holds chunk r
    HEAD_TAIL = "head_tail"  # S cut in 2*cp chunks; rank r holds chunks r and 2*cp-1-r (causal load balance)

    def chunks(self, rank: int, size: int) -> Tuple[int, ...]:
        """The (increasing) indices of the chunks ``rank`` holds, out of :meth:`n_chunks`."""
        return (rank,) if self is Layout.CONTIGUOUS else (rank, 2 * size - 1 - rank)

    def n_chunks(self, size: int) -> int:
        return size if self is Layout.CONTIGUOUS else 2 * size


class Rotate(enum.Enum):
    """How the K/V blocks reach every rank."""

    RING = "ring"  # each step sends the block to the next rank (batch_isend_irecv): two blocks in memory
    ALLGATHER = "allgather"  # one all-gather of every rank's block (backward: a reduce-scatter)


# --------------------------------------------------------------------------- sequence layout


def chunk_length(length: int, size: int, layout: Layout, what: str) -> int:
    """The length of one chunk of ``length`` under ``layout`` over ``size`` ranks.

    Raises:
        ValueError: ``length`` does not split into the layout's chunks (``what`` names it).
    """
    n = layout.n_chunks(size)
    if length % n:
        raise ValueError(f"{what} {length} is not divisible by the {n} chunks of the {layout.value} "
                         f"layout over {size} context-parallel rank(s)")
    return length // n


def sequence_positions(local_len: int, rank: int, size: int, layout: Layout = Layout.HEAD_TAIL,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions (int64, ``local_len``) of the tokens ``rank`` holds."""
    chunk = chunk_length(local_len * size, size, layout, "sequence length")
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in layout.chunks(rank, size)])


def shard_sequence(x: torch.Tensor, rank: int, size: int, layout: Layout = Layout.HEAD_TAIL,
                   dim: int = 1) -> torch.Tensor:
    """The part of the whole-sequence ``x`` (sequence on ``dim``) that ``rank`` holds."""
    chunk = chunk_length(x.shape[dim], size, layout, "sequence length")
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in layout.chunks(rank, size)], dim=dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, layout: Layout = Layout.HEAD_TAIL,
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part ``x`` (inverse of :func:`shard_sequence`)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks: List[Optional[torch.Tensor]] = [None] * layout.n_chunks(size)
    for rank, part in enumerate(parts):
        mine = layout.chunks(rank, size)
        for c, piece in zip(mine, part.chunk(len(mine), dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Packed sequences' document ids (same shape as ``tokens``, int64): each ``eos_id`` token
    ends its document (it belongs to it) and the next token starts a new one."""
    ends = (tokens == eos_id).long()
    return ends.cumsum(-1) - ends


# --------------------------------------------------------------------------- the CP context


@dataclass(frozen=True)
class ContextParallel:
    """A CP group and how sequences are laid out and K/V blocks exchanged over it."""

    group: dist.ProcessGroup
    layout: Layout = Layout.HEAD_TAIL
    rotate: Rotate = Rotate.RING
    documents: Optional[torch.Tensor] = field(default=None, compare=False)  # (B, S) ids: see context_parallel

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of the whole-sequence ``x``."""
        return shard_sequence(x, self.rank, self.size, self.layout, dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part (a collective over the group)."""
        return gather_sequence(x, self.group, self.layout, dim)

    def positions(self, local_len: int, device: Optional[torch.device] = None, rank: Optional[int] = None
                  ) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens of this rank (or of ``rank``)."""
        return sequence_positions(local_len, self.rank if rank is None else rank, self.size, self.layout, device)

    def same_document(self, rows: torch.Tensor, keys: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, len(rows), len(keys)) bool: which of the queries at global positions ``rows`` and
        keys at ``keys`` are in the same document; None without :attr:`documents`."""
        if self.documents is None:
            return None
        return self.documents[:, rows].unsqueeze(-1) == self.documents[:, keys].unsqueeze(-2)


_ACTIVE: List[ContextParallel] = []  # a stack; module-level (not a ContextVar), so autograd threads see it


def current_context() -> Optional[ContextParallel]:
    """The innermost active :func:`context_parallel`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def context_parallel(mesh: Union[DeviceMesh, dist.ProcessGroup], *, layout: Union[Layout, str] = Layout.HEAD_TAIL,
                     rotate: Union[Rotate, str] = Rotate.RING,
                     documents: Optional[torch.Tensor] = None) -> Iterator[ContextParallel]:
    """Run attention (:func:`~hyper_parallel.parallel.ring_attention.cp_attention`, the
    models') under CP over ``mesh``.

    ``mesh``: a 1-D DeviceMesh (e.g. ``mesh["cp"]``) or a process group. Inside, the model's
    inputs must be this rank's part of each sequence (``cp.shard(x)``); RoPE uses the tokens'
    global positions (:func:`rope_rows`). Run the backward inside as well.

    ``documents`` (B, S) integer ids of the whole sequences (the same on every rank of the
    group, e.g. :func:`document_ids` of packed samples): document masks, each token attends
    only to tokens of its own document (computed by the plain block ops: a fused kernel takes
    no mask). A one-rank group gives them in one process.
    """
    try:
        layout, rotate = Layout(layout), Rotate(rotate)
    except ValueError as err:
        raise ValueError(f"context_parallel: {err}; layouts: {[m.value for m in Layout]}, "
                         f"rotate: {[m.value for m in Rotate]}") from None
    if documents is not None and (documents.dim() != 2 or documents.is_floating_point()):
        raise ValueError(f"context_parallel: documents must be (batch, sequence) integer ids, got "
                         f"{documents.dtype} of shape {tuple(documents.shape)}")
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(f"context_parallel needs a 1-D mesh (e.g. mesh['cp']), got a {mesh.ndim}-D mesh")
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise ValueError(f"context_parallel needs a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    cp = ContextParallel(group, layout, rotate, documents)
    _ACTIVE.append(cp)
    try:
        yield cp
    finally:
        _ACTIVE.pop()


_DOCUMENTS: List[torch.Tensor] = []  # a stack, as _ACTIVE


def current_documents() -> Optional[torch.Tensor]:
    """The document ids of the innermost active :func:`document_masks`, or None."""
    return _DOCUMENTS[-1] if _DOCUMENTS else None


@contextlib.contextmanager
def document_masks(documents: torch.Tensor) -> Iterator[torch.Tensor]:
    """Document masks without context parallelism: inside, the models' attention
    (:func:`~hyper_parallel.parallel.ring_attention.cp_attention`) lets each token attend only to
    tokens of its own document. ``documents``: (batch, sequence) integer ids of the attention's
    sequences (e.g. :func:`document_ids` of packed samples). Run the backward inside as well
    (activation checkpointing recomputes attention there). Under :func:`context_parallel`, pass
    them as its ``documents`` instead.

    Raises:
        ValueError: ``documents`` is not a (batch, sequence) integer tensor.
    """
    if documents.dim() != 2 or documents.is_floating_point():
        raise ValueError(f"document_masks: documents must be (batch, sequence) integer ids, got "
                         f"{documents.dtype} of shape {tuple(documents.shape)}")
    _DOCUMENTS.append(documents)
    try:
        yield documents
    finally:
        _DOCUMENTS.pop()


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, local_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The RoPE table rows of this rank's ``local_len`` tokens: under CP those of their global
    positions, else the tables unchanged (their first rows are the positions)."""
    cp = current_context()
    if cp is None:
        return cos, sin
    positions = cp.positions(local_len, cos.device)
    if local_len * cp.size > cos.shape[0]:
        raise ValueError(f"the global sequence length {local_len * cp.size} (local {local_len} x cp "
                         f"{cp.size}) exceeds the RoPE tables' {cos.shape[0]} rows (max_seq_len)")
    return cos[positions], sin[positions]


def token_loss_scale(labels: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                     ignore_index: int = -100) -> float:
    """What :func:`mean_token_loss` multiplies this rank's summed token losses by: (group size) /
    (tokens of ``labels`` over ``group``, ``ignore_index`` excluded). A collective over ``group``."""
    count = (labels != ignore_index).sum().to(torch.float64)
    size = 1
    if group is not None:
        dist.all_reduce(count, group=group)
        size = dist.get_world_size(group)
    if count.item() == 0:
        raise ValueError(f"mean_token_loss: no token to average over (every label is ignore_index={ignore_index})")
    return size / count.item()


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                    ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the cross entropy averaged over every token of the global batch.

    ``group``: all the ranks whose gradients are averaged (data parallel x CP: FSDP's mesh), each
    holding some of the batch's tokens; None: this process alone (plain mean). The result is
    (this rank's summed token losses) x :func:`token_loss_scale`, so its mean over the ranks is
    the global mean, and so is the mean of its gradients (what FSDP's reduction computes). A
    collective over ``group``.

    ``logits`` sharded on the vocabulary (a DTensor, tensor parallelism) are reduced by torch's
    ``loss_parallel`` (call this and the backward inside it; no rank gathers the whole
    vocabulary); the result is then the same plain tensor on every tensor-parallel rank.
    """
    return summed_token_loss(logits, labels, ignore_index) * token_loss_scale(labels, group, ignore_index)
