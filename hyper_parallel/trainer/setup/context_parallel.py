"""Context parallelism (``parallel.cp``) in the recipe: the meshes, and the loss of a batch
whose sequences are split over the CP ranks.

The ``cp`` ranks of one data-parallel index read the same samples (the loader is sharded over
the data-parallel ranks only); each keeps its head-tail part of every sequence
(:meth:`ContextParallel.shard`) and the model's attention runs as ring attention under
:func:`context_parallel`. For the parameters the CP ranks are data-parallel ranks: FSDP
shards over ``dp_shard x cp`` flattened into one dim (``dp_shard_cp``, as torchtitan does) and
averages the gradients over every data-parallel and CP rank, so each rank's loss is its share
of the mean over every token of the global batch (:func:`mean_token_loss`).

With tensor parallelism (mesh ``... x cp x tp``) the ``tp`` ranks of a CP rank hold the same
part of the sequences: attention runs on their local heads (ring attention exchanges those
heads' K/V with the same tp rank of the other CP ranks), the sequence-parallel norms split the
CP part further over ``tp``, and the logits stay sharded on the vocabulary (the loss goes
through torch's ``loss_parallel``, entered by :meth:`SequenceSplit.context`). With pipeline
parallelism each pipeline micro-batch is the CP part of its sequences and the schedule runs
inside :meth:`SequenceSplit.context`; the last stage's loss is :meth:`SequenceSplit.token_loss`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel._torch_compat import flatten_mesh, unflatten_mesh
from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.parallel.context import (ContextParallel, Rotate, context_parallel, document_ids,
                                             document_masks, mean_token_loss, token_loss_scale)
from hyper_parallel.parallel.tensor import loss_parallel
from hyper_parallel.trainer.config.compose import ConfigError

_MODEL_PARALLEL_DIMS = ("pp", "tp")


def _data_parallel_names(mesh: DeviceMesh) -> tuple:
    return tuple(name for name in mesh.mesh_dim_names if name not in _MODEL_PARALLEL_DIMS)


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP shards over when ``mesh`` has a ``cp`` dim: ``dp_shard x cp`` as one dim
    ``dp_shard_cp`` (1-D), with ``replicate`` before it for HSDP (2-D)."""
    names = _data_parallel_names(mesh)
    if "replicate" not in names:
        return flatten_mesh(mesh[names], "dp_shard_cp")
    replicate = mesh["replicate"].size()
    everyone = flatten_mesh(mesh[names], "dp_cp")
    return unflatten_mesh(everyone, 0, (replicate, everyone.size() // replicate), ("replicate", "dp_shard_cp"))


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's CP group, the group its loss is averaged over, and the K/V exchange."""

    cp_mesh: DeviceMesh  # 1-D: the ranks sharing this rank's samples
    loss_group: dist.ProcessGroup  # every rank whose gradients FSDP averages (data parallel x CP)
    rotate: Rotate

    @property
    def size(self) -> int:
        return self.cp_mesh.size()

    @contextlib.contextmanager
    def context(self, documents: Optional[torch.Tensor] = None) -> Iterator[ContextParallel]:
        """The :func:`context_parallel` a step, a pipeline schedule call or an evaluation
        (forward and backward) runs in, with torch's ``loss_parallel`` (vocab-parallel logits
        under tensor parallelism; nothing changes for plain logits). ``documents``: the whole
        sequences' document ids (document masks)."""
        with context_parallel(self.cp_mesh, rotate=self.rotate, documents=documents) as cp, loss_parallel():
            yield cp

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mean loss over every token of :attr:`loss_group`: ``logits``
        and ``labels`` of this rank's part of some sequences (e.g. one pipeline micro-batch's).
        A collective over :attr:`loss_group`; inside :meth:`context`."""
        return mean_token_loss(logits, labels, group=self.loss_group)

    def summed_token_loss(self, summed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:meth:`token_loss` from ``summed``, the sum of the token losses of ``labels``
        (:class:`ChunkedLoss`'s result). A collective over :attr:`loss_group`."""
        return summed * token_loss_scale(labels, self.loss_group)

    def loss(self, model: nn.Module, batch: torch.Tensor, cp: ContextParallel, loss_chunks: int = 1) -> torch.Tensor:
        """This rank's share of the mean next-token loss of ``batch`` ``(samples, seq_len + 1)``
        (the whole sequences; the model sees this rank's part of each), the logits computed
        ``loss_chunks`` pieces of that part at a time (:class:`ChunkedLoss`). Inside :meth:`context`."""
        targets = cp.shard(batch[:, 1:])
        if loss_chunks == 1:
            return self.token_loss(model(cp.shard(batch[:, :-1])), targets)
        return self.summed_token_loss(model(cp.shard(batch[:, :-1]), loss=ChunkedLoss(targets, loss_chunks)), targets)


@contextlib.contextmanager
def micro_batch_context(cp: Optional[SequenceSplit], batch: torch.Tensor,
                        document_eos: Optional[int] = None) -> Iterator[Optional[ContextParallel]]:
    """What the forward and backward of ``batch`` ``(samples, seq_len + 1)`` run in: under CP its
    :meth:`SequenceSplit.context` (yielded), else torch's ``loss_parallel`` (None yielded); with
    ``document_eos``, the document masks of the inputs' packed documents, each ending at that
    token (``training.document_mask``)."""
    documents = None if document_eos is None else document_ids(batch[:, :-1], document_eos)
    if cp is not None:
        with cp.context(documents) as context:
            yield context
        return
    with loss_parallel(), (document_masks(documents) if documents is not None else contextlib.nullcontext()):
        yield None


def data_parallel_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """The process group of every data-parallel rank of ``mesh`` (replicate x shard x cp: the
    ranks whose gradients FSDP averages; not pp or tp), None when there is only this rank."""
    names = _data_parallel_names(mesh)
    if not names or mesh[names].size() == 1:
        return None
    if len(names) == 1:
        return mesh[names[0]].get_group()
    return flatten_mesh(mesh[names], "dp_cp" if "cp" in names else "dp").get_group()


def split_sequences(mesh: DeviceMesh, rotate: str) -> Optional[SequenceSplit]:
    """The :class:`SequenceSplit` of a mesh with a ``cp`` dim (see ``build_mesh``); None without one."""
    if "cp" not in mesh.mesh_dim_names:
        return None
    names = _data_parallel_names(mesh)
    return SequenceSplit(mesh["cp"], flatten_mesh(mesh[names], "dp_cp").get_group(), Rotate(rotate))


def use_ring_attention(model: RecipeModel) -> None:
    """Make ``model``'s attention run as ring attention under CP
    (:meth:`RecipeModel.use_ring_attention`).

    Raises:
        ConfigError: a block it cannot run (the model's one line).
    """
    try:
        model.use_ring_attention()
    except ValueError as err:
        raise ConfigError(str(err)) from None
