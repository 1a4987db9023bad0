"""Ring attention: attention over a sequence split across the ranks of a context-parallel group
(:func:`~hyper_parallel.parallel.context.context_parallel`, which says how it is laid out).

Every rank computes its queries against one block of keys/values at a time while the K/V blocks
travel round the group (``rotate="ring"``: send/recv to the neighbours; or ``"allgather"``: all
blocks gathered at once), and the partial results are merged exactly with their log-sum-exp. It
runs (and is tested) on CPU with gloo. :func:`cp_attention` is the attention the models call:
the ring under an active context, torch's ``scaled_dot_product_attention`` without one.

Memory: the ring saves only this rank's queries, keys, values, output and log-sum-exp for the
backward, which recomputes the attention block by block and sends the K/V gradients round the
ring back to their owners, so a rank's activation memory is ~1/cp of the whole sequence's. The
block math is in :mod:`hyper_parallel.parallel.block_attention`: torch's fused attention kernel
where one applies (``block_kernel``: CPU flash attention, CUDA memory-efficient attention), which
never materialises the scores; else plain torch ops, whose scores are computed in tiles of query
rows (``_TILE_SCORES``), so their transient memory does not grow with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hyper_parallel import _torch_compat as compat
from hyper_parallel.parallel.block_attention import (BlockKernel, BlockMask, accumulation_dtype, block_attention,
                                                     block_attention_backward, block_kernel, merge_attention,
                                                     new_kernel_layout)
from hyper_parallel.parallel.context import (ContextParallel, Layout, Rotate, chunk_length, current_context,
                                            current_documents)

__all__ = ["cp_attention"]


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
    chunk_length(n * cp.size, cp.size, cp.layout, "sequence length")
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
    CP: torch's ``scaled_dot_product_attention``, under an active
    :func:`~hyper_parallel.parallel.context.document_masks` with each query's keys limited to its
    document.
    """
    cp = cp if cp is not None else current_context()
    if cp is not None:
        return _ring_attention(q, k, v, cp, is_causal, scale)
    documents = current_documents()
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_document_mask(documents, q, k, is_causal),
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _document_mask(documents: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, S, S) bool: query i may attend key j (same document; and j <= i when causal)."""
    if tuple(documents.shape) != (q.shape[0], q.shape[2]) or k.shape[2] != q.shape[2]:
        raise ValueError(f"document_masks: documents of shape {tuple(documents.shape)} do not match the "
                         f"(batch, sequence) {(q.shape[0], q.shape[2])} of the attention's queries "
                         f"(and {k.shape[2]} keys)")
    documents = documents.to(q.device)
    allowed = documents.unsqueeze(-1) == documents.unsqueeze(-2)
    if causal:
        allowed &= torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    return allowed.unsqueeze(1)
