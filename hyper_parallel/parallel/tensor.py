"""Tensor parallelism with torch's own ``parallelize_module``: the loss over vocabulary-sharded
logits (:func:`cross_entropy` inside torch's ``loss_parallel``, re-exported here). The plans
that shard a model live with the model: Llama's in :mod:`hyper_parallel.models.llama_parallel`
(``apply_tensor_parallel``, ``block_plan``, ``root_plan``). The MoE model
(``hyper_parallel.models.moe``) has no tensor-parallel plan: shard its experts with expert
parallelism instead (:mod:`hyper_parallel.parallel.expert`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

__all__ = ["cross_entropy", "loss_parallel"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, seq, vocab) against ``targets`` (batch, seq), in
    at least float32, as a plain tensor (the same value on every tensor-parallel rank).

    Logits sharded over the vocabulary (a DTensor from the output projection of Llama's
    ``root_plan``) are reduced by torch's ``loss_parallel`` (no rank gathers the full logits):
    call this, and the loss's backward, inside ``with loss_parallel():`` (re-exported here; it
    changes nothing for plain tensors, and does not nest: leaving an inner one disables the
    outer one).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
