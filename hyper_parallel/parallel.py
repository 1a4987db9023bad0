"""Tensor parallelism for Llama-style models with torch's own ``parallelize_module``.

The Megatron-style plan (the one torchtitan applies to Llama): column-parallel ``wq``/``wk``/
``wv`` and ``w1``/``w3``, row-parallel ``wo`` and ``w2`` (each rank holds ``n_heads / tp`` query
heads and ``n_kv_heads / tp`` key/value heads), sequence parallelism on the norms (activations
between blocks are sharded over the sequence), a vocab-parallel embedding, and an output
projection whose logits stay sharded over the vocabulary for :func:`cross_entropy` (torch's
``loss_parallel``). Apply it before ``fully_shard``, which then shards the tensor-parallel
parameters over the data-parallel mesh::

    mesh = hp.init_device_mesh(device_type, (dp, tp), mesh_dim_names=("shard", "tp"))
    apply_tensor_parallel(model, mesh["tp"])
    for block in model.layers.values():
        hp.fully_shard(block, mesh=mesh["shard"])
    hp.fully_shard(model, mesh=mesh["shard"])
    with loss_parallel():  # the loss's backward too
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

The model must follow ``hyper_parallel.models.llama``'s names (``tok_embeddings``, ``layers``
of blocks with ``attention_norm``, ``attention.{wq,wk,wv,wo}``, ``ffn_norm``,
``feed_forward.{w1,w2,w3}``, then ``norm`` and ``output``), take the block input as the first
argument of ``attention`` and ``feed_forward``, and reshape heads with the local head count
(``view(bsz, seq, -1, head_dim)``). Another model adapts :func:`block_plan` / :func:`root_plan`.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

__all__ = ["apply_tensor_parallel", "block_plan", "cross_entropy", "loss_parallel", "root_plan"]


# Activations between blocks stay DTensors sharded over the sequence (use_local_output=False on
# the embedding, wo and w2): a torch.compile'd block whose input is the local tensor of a
# redistribute gets a plain gradient where that redistribute's backward needs a DTensor.


def root_plan(*, vocab_parallel_loss: bool = True) -> Dict[str, ParallelStyle]:
    """The plan of the model outside its blocks: the embedding's output sharded over the
    sequence, the final norm sequence-parallel, and the logits sharded over the vocabulary
    (a DTensor, for :func:`cross_entropy`) or, with ``vocab_parallel_loss=False``, gathered."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
                                  use_local_output=not vocab_parallel_loss),
    }


def block_plan() -> Dict[str, ParallelStyle]:
    """The plan of one transformer block (its input and output sharded over the sequence)."""
    return {
        "attention_norm": SequenceParallel(),
        # attention(x, cos, sin): x is gathered over the sequence, the RoPE tables stay plain.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, vocab_parallel_loss: bool = True) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` with :func:`root_plan` and :func:`block_plan`
    (on the meta device too: initialise afterwards). Tied embeddings stay tied (both are
    sharded over the vocabulary). A pipeline stage (``hyper_parallel.pipeline.split_stage``)
    gets the plan of the modules it holds; between stages the hidden state stays a DTensor
    sharded over the sequence. Returns ``model``.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got mesh dims {tp_mesh.mesh_dim_names}")
    tied = model.output is not None and model.tok_embeddings is not None and \
        model.output.weight is model.tok_embeddings.weight
    # A pipeline stage (hyper_parallel.pipeline.split_stage) lacks some of the root's modules.
    plan = {name: style for name, style in root_plan(vocab_parallel_loss=vocab_parallel_loss).items()
            if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    if tied:  # each style replaced its module's weight: share the embedding's again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
    return model


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``targets`` (batch, seq), in
    at least float32, as a plain tensor (the same value on every tensor-parallel rank).

    Logits sharded over the vocabulary (a DTensor from :func:`root_plan`) are reduced by
    torch's ``loss_parallel`` (no rank gathers the full logits): call this, and the loss's
    backward, inside ``with loss_parallel():`` (re-exported here; it changes nothing for plain
    tensors, and does not nest: leaving an inner one disables the outer one).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
