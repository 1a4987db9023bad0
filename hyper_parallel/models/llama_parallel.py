"""The decoder's parallel layouts: the Megatron-style tensor-parallel plan of the Llama
(dense) decoder (applied with torch's own ``parallelize_module``) and the pipeline-stage
split of every :class:`~hyper_parallel.models.decoder.Decoder` (Llama's and the mixtures of
experts'). The generic pieces are in ``hyper_parallel.parallel``: ``tensor`` (``cross_entropy``,
``loss_parallel``) and ``pipeline`` (the sharded stage, schedules, stage ranges).

Tensor parallelism: column-parallel ``wq``/``wk``/``wv`` and ``w1``/``w3``, row-parallel ``wo``
and ``w2`` (each rank holds ``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value
heads), sequence parallelism on the norms (activations between blocks are sharded over the
sequence), a vocab-parallel embedding, and an output projection whose logits stay sharded over
the vocabulary for ``hyper_parallel.parallel.tensor.cross_entropy`` (torch's ``loss_parallel``). Apply
it before ``fully_shard``, which then shards the tensor-parallel parameters over the
data-parallel mesh::

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

import copy
from typing import Dict, TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from hyper_parallel.core.fully_shard import FSDPModule
from hyper_parallel.models.decoder import Decoder
from hyper_parallel.models.moe import NO_TENSOR_PARALLEL_PLAN, MoETransformer

__all__ = ["apply_tensor_parallel", "block_plan", "root_plan", "split_stage"]

Model = TypeVar("Model", bound=Decoder)  # what split_stage splits


# Activations between blocks stay DTensors sharded over the sequence (use_local_output=False on
# the embedding, wo and w2): a torch.compile'd block whose input is the local tensor of a
# redistribute gets a plain gradient where that redistribute's backward needs a DTensor.


def root_plan(*, vocab_parallel_loss: bool = True) -> Dict[str, ParallelStyle]:
    """The plan of the model outside its blocks: the embedding's output sharded over the
    sequence, the final norm sequence-parallel, and the logits sharded over the vocabulary (a
    DTensor, for ``hyper_parallel.parallel.tensor.cross_entropy``) or, with ``vocab_parallel_loss=False``,
    gathered."""
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
    sharded over the vocabulary). A pipeline stage (:func:`split_stage`)
    gets the plan of the modules it holds; between stages the hidden state stays a DTensor
    sharded over the sequence. Returns ``model``.

    Raises:
        ValueError: ``model`` is not a Llama ``Transformer`` (the MoE model has no plan), or
            ``tp_mesh`` is not 1-D.
    """
    if not isinstance(model, Decoder) or isinstance(model, MoETransformer):
        raise ValueError(f"apply_tensor_parallel plans hyper_parallel.models.llama.Transformer (or a stage of it), "
                         f"not {type(model).__name__}; {NO_TENSOR_PARALLEL_PLAN}")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got mesh dims {tp_mesh.mesh_dim_names}")
    tied = model.output is not None and model.tok_embeddings is not None and \
        model.output.weight is model.tok_embeddings.weight
    # A pipeline stage (split_stage) lacks some of the root's modules.
    plan = {name: style for name, style in root_plan(vocab_parallel_loss=vocab_parallel_loss).items()
            if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    if tied:  # each style replaced its module's weight: share the embedding's again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
    return model


def split_stage(model: Model, layers: range, *, first: bool, last: bool) -> Model:
    """A deep copy of ``model`` (``model`` itself is left whole) holding only the blocks in
    ``layers``, under the same names (``layers.3.attention.wq.weight``), with the embedding
    only if ``first`` and the final norm and output projection only if ``last`` (see
    :class:`~hyper_parallel.models.decoder.Decoder`: Llama's and the mixtures of experts', their
    dense and MoE blocks alike). Call it before tensor parallelism and
    ``fully_shard`` (on the meta device, the copy allocates nothing); ``init_weights`` then
    gives every parameter the value it has in the full model.

    Raises:
        ValueError: ``model`` ties its embeddings and the stage is not the whole model (the
            embedding and the output projection would live on different stages), or
            ``layers`` is not a non-empty range of the model's blocks.
    """
    n_layers = len(model.layers)
    if not layers or layers.step != 1 or layers.start < 0 or layers.stop > n_layers:
        raise ValueError(f"stage layers {layers} are not a non-empty range within the model's {n_layers} layers")
    if model.cfg.tie_embeddings and not (first and last):
        raise ValueError("tie_embeddings cannot be pipelined: the embedding and the output projection "
                         "would be on different stages; untie them or use pipeline size 1")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("split_stage needs the model before fully_shard; shard each stage module instead")
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if int(name) not in layers:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage
