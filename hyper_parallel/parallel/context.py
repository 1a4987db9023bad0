"""Context parallelism (CP): attention over a sequence split across the ranks of a CP group.

Each rank of the group holds a part of every sequence (:class:`Layout`); attention runs as ring
attention: every rank computes its queries against one block of keys/values at a time while the
K/V blocks travel round the group (``rotate="ring"``: send/recv to the neighbours; or
``"allgather"``: all blocks gathered at once), and the partial results are merged exactly with
their log-sum-exp. It runs (and is tested) on CPU with gloo. ``documents=`` adds document masks
for packed sequences (each token attends within its document only).

    with context_parallel(mesh["cp"]) as cp:          # tells the model's attention it runs under CP
        loss = mean_token_loss(model(cp.shard(inputs)), cp.shard(labels), group=dp_cp_group)
        loss.backward()                                # inside the context too (see below)

Memory: the ring saves only this rank's queries, keys, values, output and log-sum-exp for the
backward, which recomputes the attention block by block and sends the K/V gradients round the
ring back to their owners, so a rank's activation memory is ~1/cp of the whole sequence's. The
block math is in ``hyper_parallel.parallel.block_attention``: torch's fused attention kernel where one
applies (``block_kernel``: CPU flash attention, CUDA memory-efficient attention), which never
materialises the scores; else plain torch ops, whose scores are computed in tiles of query rows
(``_TILE_SCORES``), so their transient memory does not grow with the sequence.
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
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel import _torch_compat as compat
from hyper_parallel.parallel.block_attention import (BlockKernel, BlockMask, accumulation_dtype, block_attention,
                                                     block_attention_backward, block_kernel, merge_attention,
                                                     new_kernel_layout)
from hyper_parallel.chunked_loss import summed_token_loss

__all__ = [
    "BlockKernel", "BlockMask", "ContextParallel", "Layout", "Rotate", "block_attention", "context_parallel",
    "cp_attention", "current_context", "document_ids", "gather_sequence", "mean_token_loss", "merge_attention",
    "rope_rows", "sequence_positions", "shard_sequence", "token_loss_scale",
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


def _check_divisible(length: int, size: int, layout: Layout, what: str) -> int:
    n = layout.n_chunks(size)
    if length % n:
        raise ValueError(f"{what} {length} is not divisible by the {n} chunks of the {layout.value} "
                         f"layout over {size} context-parallel rank(s)")
    return length // n


def sequence_positions(local_len: int, rank: int, size: int, layout: Layout = Layout.HEAD_TAIL,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions (int64, ``local_len``) of the tokens ``rank`` holds."""
    chunk = _check_divisible(local_len * size, size, layout, "sequence length")
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in layout.chunks(rank, size)])


def shard_sequence(x: torch.Tensor, rank: int, size: int, layout: Layout = Layout.HEAD_TAIL,
                   dim: int = 1) -> torch.Tensor:
    """The part of the whole-sequence ``x`` (sequence on ``dim``) that ``rank`` holds."""
    chunk = _check_divisible(x.shape[dim], size, layout, "sequence length")
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
    """Run attention (:func:`cp_attention`, e.g. the Llama model's) under CP over ``mesh``.

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


# --------------------------------------------------------------------------- ring attention


def _plan(rank: int, size: int, src: int, layout: Layout, causal: bool, n: int
          ) -> List[Tuple[slice, int, BlockMask]]:
    """The block computations of this rank's ``n`` queries against the K/V block of rank ``src``:
    (query rows, number of leading keys seen, mask); none for queries that see none of its keys."""
    if not causal:
        return [(slice(0, n), n, BlockMask.FULL)]
    if src == rank:  # a rank's chunks are in increasing order: its own block is causal as a whole
        return [(slice(0, n), n, BlockMask.CAUSAL)]
    q_chunks, k_chunks = layout.chunks(rank, size), layout.chunks(src, size)
    chunk = n // len(q_chunks)
    plan: List[Tuple[slice, int, BlockMask]] = []
    for i, qc in enumerate(q_chunks):
        seen = sum(kc < qc for kc in k_chunks) * chunk  # the earlier chunks are the leading ones
        if not seen:
            continue
        if plan and plan[-1][0].stop == i * chunk and plan[-1][1] == seen:  # one call for both
            plan[-1] = (slice(plan[-1][0].start, (i + 1) * chunk), seen, BlockMask.FULL)
        else:
            plan.append((slice(i * chunk, (i + 1) * chunk), seen, BlockMask.FULL))
    return plan


# Scores computed at once (per batch x head): bounds a block's transient memory (2 MiB of float32
# for a batch x heads of 1) however long the sequence; larger tiles are fewer, faster matmuls.
_TILE_SCORES = 2**19
_MIN_TILE_ROWS = 16


# The block kernel of the ring (None: block_kernel's choice); tests and benchmarks/cp_gpu_checks.py force one here.
_KERNEL: Optional[BlockKernel] = None


def _tiles(plan: List[Tuple[slice, int, BlockMask]], budget: Optional[int]
           ) -> Iterator[Tuple[slice, int, BlockMask, int]]:
    """The plan's computations cut into tiles of query rows of at most ``budget`` scores each
    (None: uncut, for a fused kernel): (rows, keys seen, mask, first row within the causal
    block). A causal tile sees only the keys up to its last row."""
    for rows, seen, mask in plan:
        step = rows.stop - rows.start if budget is None else max(_MIN_TILE_ROWS, budget // seen)
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            if mask is BlockMask.CAUSAL:  # the whole diagonal block: rows and keys start together
                yield slice(start, stop), stop, mask, start
            else:
                yield slice(start, stop), seen, mask, 0


@dataclass
class _Shift:
    """A started ring shift: its send/recv works, the buffer being sent (kept alive until the
    wait) and the one being received."""

    works: List[dist.Work]
    sent: torch.Tensor
    received: torch.Tensor
    tag: int

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _shift(flat: torch.Tensor, cp: ContextParallel, tag: int) -> _Shift:
    """Start sending ``flat`` to the next rank of the ring and receiving the previous one's."""
    received = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, group=cp.group, group_peer=(cp.rank + 1) % cp.size, tag=tag),
           dist.P2POp(dist.irecv, received, group=cp.group, group_peer=(cp.rank - 1) % cp.size, tag=tag)]
    return _Shift(dist.batch_isend_irecv(ops), flat, received, tag)


_KV_TAG, _GRAD_TAG = 0, 1  # the K/V blocks' shifts and their gradients'


def _kv_blocks(flat: torch.Tensor, cp: ContextParallel) -> Iterator[Tuple[int, torch.Tensor]]:
    """(source rank, its flat K/V block) for every rank: own first, then rank-1, rank-2, ...
    (ring: the next block is received while the caller works on the current one)."""
    rank, size = cp.rank, cp.size
    if cp.rotate is Rotate.ALLGATHER and size > 1:
        gathered = flat.new_empty((size, flat.numel()))
        compat.all_gather_single(gathered.view(-1), flat, group=cp.group)
        for i in range(size):
            yield (rank - i) % size, gathered[(rank - i) % size]
        return
    for i in range(size):
        pending = _shift(flat, cp, _KV_TAG) if i < size - 1 else None
        yield (rank - i) % size, flat
        if pending is not None:
            flat = pending.wait()


def _flat_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _split_kv(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views of ``flat`` shaped as ``k`` and ``v``."""
    return flat[:k.numel()].view(k.shape), flat[k.numel():].view(v.shape)


class _RingAttention(torch.autograd.Function):
    """Ring attention; saves only the local q, k, v, output and lse, recomputes in backward."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float):  # type: ignore[override]
        n, acc = q.shape[2], accumulation_dtype(q.dtype)
        mine = cp.positions(n, q.device)
        out = new_kernel_layout(q.shape[:-1] + v.shape[-1:], q, acc).zero_()  # so the kernels' backwards read it as is
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
        kernel = block_kernel(q, k, v) if _KERNEL is None else _KERNEL
        kernel = BlockKernel.PLAIN if cp.documents is not None else kernel  # a fused kernel takes no mask
        budget = _TILE_SCORES // (q.shape[0] * q.shape[1]) if kernel is BlockKernel.PLAIN else None
        for src, block in _kv_blocks(_flat_kv(k, v), cp):
            kb, vb = _split_kv(block, k, v)
            keys = cp.positions(n, q.device, src)
            for rows, seen, mask, first in _tiles(_plan(cp.rank, cp.size, src, cp.layout, causal, n), budget):
                allowed = cp.same_document(mine[rows], keys[:seen])
                o, l = block_attention(q[:, :, rows], kb[:, :, :seen], vb[:, :, :seen], mask, scale, first, kernel,
                                       allowed)
                out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows], o, l)
        out = out.to(q.dtype)  # (keeps the layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale, ctx.kernel, ctx.budget = cp, causal, scale, kernel, budget
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        n, acc, size = q.shape[2], lse.dtype, cp.size
        mine = cp.positions(n, q.device)
        dq = torch.zeros_like(q, dtype=acc)

        def add_block(src: int, block: torch.Tensor, grads: torch.Tensor) -> None:
            (kb, vb), (dkb, dvb) = _split_kv(block, k, v), _split_kv(grads, k, v)
            keys = cp.positions(n, q.device, src)
            for rows, seen, mask, first in _tiles(_plan(cp.rank, size, src, cp.layout, ctx.causal, n), ctx.budget):
                dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], kb[:, :, :seen], vb[:, :, :seen],
                                                            dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                                            mask, ctx.scale, first, ctx.kernel,
                                                            cp.same_document(mine[rows], keys[:seen]))
                dq[:, :, rows] += dq_b
                dkb[:, :, :seen] += dk_b
                dvb[:, :, :seen] += dv_b

        flat = _flat_kv(k, v)
        if cp.rotate is Rotate.ALLGATHER and size > 1:
            grads = flat.new_zeros((size, flat.numel()), dtype=acc)
            for src, block in _kv_blocks(flat, cp):
                add_block(src, block, grads[src])
            own = grads.new_empty(flat.numel())
            compat.reduce_scatter_single(own, grads.view(-1), op=dist.ReduceOp.SUM, group=cp.group)
        else:  # each block's gradients travel with it and reach its owner after the last step
            arriving: Optional[_Shift] = None  # the previous ranks' gradients of the block now here
            for src, block in _kv_blocks(flat, cp):
                own = flat.new_zeros(flat.numel(), dtype=acc)
                add_block(src, block, own)  # overlaps the arriving gradients' transfer (as torch's ring)
                if arriving is not None:
                    own += arriving.wait()
                if size > 1:
                    arriving = _shift(own, cp, _GRAD_TAG)
            if arriving is not None:
                own = arriving.wait()
        dk, dv = _split_kv(own, k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@torch.compiler.disable  # dynamo cannot trace the point-to-point exchange: a graph break
def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, causal: bool,
                    scale: Optional[float]) -> torch.Tensor:
    n = q.shape[2]
    if k.shape[2] != n or v.shape[2] != n:
        raise ValueError(f"context-parallel attention needs queries, keys and values of the same local "
                         f"length, got {n}, {k.shape[2]}, {v.shape[2]}")
    _check_divisible(n * cp.size, cp.size, cp.layout, "sequence length")
    if cp.documents is not None and tuple(cp.documents.shape) != (q.shape[0], n * cp.size):
        raise ValueError(f"context_parallel: documents of shape {tuple(cp.documents.shape)} do not match the "
                         f"(batch, global sequence) {(q.shape[0], n * cp.size)} of the attention's inputs")
    return _RingAttention.apply(q, k, v, cp, causal, q.shape[-1] ** -0.5 if scale is None else scale)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = True,
                 scale: Optional[float] = None, cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """Attention of q (B, H, S, D) over k, v (B, Hkv, S, D), H a multiple of Hkv (GQA).

    Under CP (``cp``, default: the active :func:`context_parallel`), q, k and v hold this rank's
    part of each sequence in the context's layout and the result is this rank's rows of the
    attention over the whole sequence (ring attention; K/V travel with their Hkv heads). Without
    CP: torch's ``scaled_dot_product_attention``.
    """
    cp = cp if cp is not None else current_context()
    if cp is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return _ring_attention(q, k, v, cp, is_causal, scale)


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
