"""Shared pieces of the fully_shard tests: a tiny Llama, data, and the reference comparison."""

from __future__ import annotations

import copy
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from hyper_parallel._torch_compat import lookup_compile_backend
from hyper_parallel.models import build_llama

VOCAB, SEQ = 32, 8

# [Note: parity in float64]
# Parity tests train in float64 against a single-process reference on the global batch. The
# sharded run sums per-rank gradients in another order than the reference's one big matmul;
# in float32 that is ~1e-7 relative noise, and AdamW multiplies noise in a gradient smaller
# than its eps (1e-8) by lr / eps = 1e6, so fp32 parameters differ by ~1e-5 depending on the
# CPU's kernels. In float64 the same noise is ~1e-16 * 1e6 = 1e-10 at worst: TOL leaves two
# orders of magnitude, while any real defect (a missing reduction, a wrong scale, a stale
# shard) shows up at 1e-4 or more.
DTYPE = torch.float64
TOL = 1e-8


class CountingBackend:
    """A torch.compile backend (e.g. ``"aot_eager"``, ``"inductor"``) that counts the calls of
    the graphs it compiled (proof that the compiled code ran, rather than an eager fallback)."""

    def __init__(self, name: str):
        self.calls = 0
        self._inner = lookup_compile_backend(name)

    def __call__(self, gm, example_inputs):
        compiled = self._inner(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)
        return run


def tiny_llama(dtype: torch.dtype = DTYPE, **overrides) -> nn.Module:
    cfg = dict(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=16)
    cfg.update(overrides)
    return build_llama("llama_debug", **cfg).to(dtype)


def global_batch(step: int, batch_size: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def float64_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy with the logits cast to float64 (bf16 / fp32 models)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).to(torch.float64), tokens[:, 1:].flatten())


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD (lr 0.5): no optimizer state, so parameters follow the gradients directly."""
    return torch.optim.SGD(params, lr=0.5)


def shard_layers_and_root(model: nn.Module, **kw) -> nn.Module:
    """``fully_shard(layer, **kw)`` for each of ``model.layers``, then for ``model``."""
    for layer in model.layers.values():
        hp.fully_shard(layer, **kw)
    return hp.fully_shard(model, **kw)


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full parameter values by name (".block" of checkpointing wrappers dropped), read via
    ``state_dict()`` (which reshards; parameters may be left unsharded after backward)."""
    out = {}
    for name, param in model.state_dict().items():
        value = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
        out[name.replace(".block.", ".")] = value
    return out


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train(model: nn.Module, batches: List[torch.Tensor], loss_fn: Callable = lm_loss,
          micro_batches: int = 1, before_micro: Optional[Callable[[nn.Module, int, int], None]] = None,
          lr: float = 1e-2, eps: float = 1e-8,
          make_optimizer: Optional[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = None) -> List[float]:
    """Optimizer steps (AdamW(lr, eps, weight_decay=0.1) unless ``make_optimizer`` is given); each
    batch is split into ``micro_batches`` accumulated micro-batches."""
    opt = (make_optimizer(model.parameters()) if make_optimizer is not None
           else torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.1))
    losses = []
    for batch in batches:
        for i, micro in enumerate(batch.chunk(micro_batches)):
            if before_micro is not None:
                before_micro(model, i, micro_batches)
            loss = loss_fn(model, micro) / micro_batches
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def parity(wrap: Callable[[nn.Module], nn.Module], dp_rank: int, dp_size: int, *, steps: int = 2,
           model_fn: Callable[[], nn.Module] = tiny_llama, batch_size: int = 4, **train_kw) -> float:
    """Max abs diff of full parameters after ``steps`` AdamW steps: wrapped model fed this
    rank's slice of each global batch vs. the unwrapped model on the whole batch."""
    torch.manual_seed(0)
    reference = model_fn()
    model = wrap(copy.deepcopy(reference))
    batches = [global_batch(s, batch_size) for s in range(steps)]
    train(reference, batches, **{k: v for k, v in train_kw.items() if k != "before_micro"})
    train(model, [b.chunk(dp_size)[dp_rank] for b in batches], **train_kw)
    return max_diff(full_params(model), full_params(reference))
