"""The next-token loss computed in chunks of the sequence, so the logits never exist whole.

At long sequences the logits (batch x seq x vocab, in at least float32 for the loss) are the
largest activation of a language model: 128k tokens x a 128k vocabulary is 64 GiB in float32.
:class:`ChunkedLoss` computes the final norm, the output projection and the cross entropy one
chunk of the sequence at a time under activation checkpointing: the forward keeps no chunk's
logits, and the backward recomputes each chunk's before its gradients (the idea of
torchtitan's chunked loss). The result is the sum of every token's loss, exactly the unchunked
sum (summed in another order): callers scale it as their mean needs.

    loss = model(tokens, loss=ChunkedLoss(targets, chunks=8)) / targets.numel()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from hyper_parallel import _torch_compat as compat

__all__ = ["ChunkedLoss", "summed_token_loss"]


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The sum of the cross entropy of each token of ``logits`` (..., vocab) against ``targets``
    (...), ``ignore_index`` excluded, in at least float32. Vocabulary-sharded logits (a DTensor
    under torch's ``loss_parallel``) give the same plain tensor on every tensor-parallel rank."""
    flat = logits.flatten(0, -2)
    total = F.cross_entropy(flat.to(torch.promote_types(flat.dtype, torch.float32)), targets.flatten(),
                            ignore_index=ignore_index, reduction="sum")
    return total.full_tensor() if isinstance(total, DTensor) else total


@dataclass(frozen=True)
class ChunkedLoss:
    """What a model returns instead of its logits when given one (``model(tokens, loss=...)``):
    the summed token loss of ``targets`` (batch, seq), the logits computed ``chunks`` pieces
    of the sequence at a time (the last pieces shorter when ``chunks`` does not divide it).

    Call it from inside the model's forward with the last hidden states (batch, seq, dim) and
    ``head``, what makes logits of them (final norm and output projection), so that a wrapper
    that gathers parameters for the forward (``fully_shard``) has them for the recomputation
    too. Run the backward before the model's parameters are resharded (as any backward).

    A pytree node (``targets`` a leaf): torch's pipeline schedules split it into micro-batches
    like the inputs when it is passed to ``schedule.step(..., loss=ChunkedLoss(...))``."""

    targets: torch.Tensor
    chunks: int
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"ChunkedLoss: chunks must be at least 1, got {self.chunks}")

    def __call__(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if hidden.shape[:2] != self.targets.shape:
            raise ValueError(f"ChunkedLoss: hidden states {tuple(hidden.shape[:2])} and targets "
                             f"{tuple(self.targets.shape)} differ in (batch, seq)")

        def piece(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return summed_token_loss(head(h), targets, self.ignore_index)
        pieces = zip(hidden.chunk(self.chunks, dim=1), self.targets.chunk(self.chunks, dim=1))
        if self.chunks == 1:
            return piece(hidden, self.targets)
        return torch.stack([checkpoint(piece, h, t, use_reentrant=False) for h, t in pieces]).sum()


# ``targets`` the one child; chunks and ignore_index travel in the context.
compat.register_pytree_node(ChunkedLoss, lambda loss: ([loss.targets], (loss.chunks, loss.ignore_index)),
                            lambda children, context: ChunkedLoss(children[0], *context))
