"""The loss in chunks of the sequence: exactly the unchunked loss (float64), and the logits
never whole, forward or backward. Under CP and fully_shard: tests/test_context_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.models import build_llama
from hyper_parallel.trainer.step.train_step import train_step

TOL = 1e-12
VOCAB, SEQ, DIM = 256, 24, 64  # llama_debug's vocabulary and dim


def _model():
    model = build_llama("llama_debug", max_seq_len=SEQ).to(torch.float64)
    model.init_weights(seed=1)
    return model


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _loss_and_grads(model, tokens, chunks):
    model.zero_grad(set_to_none=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100  # ignored tokens: the count is the caller's, the sum skips them
    if chunks is None:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    else:
        loss = model(inputs, loss=ChunkedLoss(targets, chunks)) / (targets != -100).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 3, 5, SEQ])  # 5 does not divide the sequence
def test_chunked_loss_equals_the_whole_loss(chunks):
    model = _model()
    ref_loss, ref_grads = _loss_and_grads(model, _tokens(), None)
    loss, grads = _loss_and_grads(model, _tokens(), chunks)
    assert (loss - ref_loss).abs() < TOL
    assert max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()) < TOL
    assert ref_grads["output.weight"].abs().max() > 1e-3  # the comparison is not vacuous


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor of logits an op produced: a vocabulary-sized last dim,
    not the output weight's (dim, vocab) (whose gradient has the weight's size)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB and t.shape[-2] != DIM:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunks", [None, 4])
def test_the_logits_never_exist_whole(chunks):
    """Forward and backward (which recomputes each chunk's logits): no tensor holds more than
    one chunk's logits; without chunks, the whole logits (the measure sees them)."""
    model = _model()
    with _LargestLogits() as seen:
        _loss_and_grads(model, _tokens(), chunks)
    whole = 2 * SEQ * VOCAB
    assert seen.largest == (whole if chunks is None else whole // chunks), seen.largest


def test_train_step_with_loss_chunks_takes_the_same_step():
    model, tokens = _model(), _tokens()
    results = []
    for chunks in (1, 3):
        replica = copy.deepcopy(model)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
        with _LargestLogits() as seen:
            loss = train_step(replica, tokens, optimizer, grad_accum_steps=2, max_grad_norm=0,
                              loss_chunks=chunks)["loss"]
        assert seen.largest == SEQ * VOCAB // chunks  # one sample per micro-batch, one chunk at a time
        results.append((loss, [p.detach().clone() for p in replica.parameters()]))
    (loss_a, params_a), (loss_b, params_b) = results
    assert (loss_a - loss_b).abs() < TOL
    assert max((a - b).abs().max().item() for a, b in zip(params_a, params_b)) < TOL
    assert max((a - b).abs().max().item() for a, b in zip(params_a, model.parameters())) > 1e-4  # it stepped


def test_bad_chunked_loss_arguments_raise_one_line_errors():
    with pytest.raises(ValueError, match="ChunkedLoss: chunks must be at least 1, got 0"):
        ChunkedLoss(torch.zeros(2, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"ChunkedLoss: hidden states \(2, 5\) and targets \(2, 4\) differ"):
        _model()(torch.zeros(2, 5, dtype=torch.long), loss=ChunkedLoss(torch.zeros(2, 4, dtype=torch.long), 2))
