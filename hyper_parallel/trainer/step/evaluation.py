"""Held-out data and the periodic validation loss.

The validation split is ``data.val_fraction`` of the training corpus (its last samples, never
trained on), a separate ``data.val_path``, or (synthetic data) samples from another seed. Every
evaluation reads the same first ``eval.steps`` global batches in a fixed order, each rank its
slice, so the result depends only on the model: deterministic, and identical after a resume
on any number of ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, NamedTuple, Optional, Union

import torch
from torch import nn

from hyper_parallel.data import DistributedBatchLoader, TokenSource, TokenWindows, build_source, split_windows
from hyper_parallel.trainer.step.agreement import all_reduce_sum
from hyper_parallel.trainer.config.data import DataConfig
from hyper_parallel.trainer.setup.context_parallel import SequenceSplit, micro_batch_context
from hyper_parallel.trainer.setup.pipeline_parallel import Pipeline
from hyper_parallel.trainer.step.train_step import next_token_loss

# Synthetic validation samples are drawn with this offset added to training.seed.
SYNTHETIC_VAL_SEED_OFFSET = 1_000_003


class DataSources(NamedTuple):
    train: TokenSource
    val: Optional[TokenSource]


def build_sources(data: DataConfig, *, seq_len: int, seed: int, vocab_size: int, with_val: bool) -> DataSources:
    """The training source and (when ``with_val``) the validation source, from a validated
    ``data`` group (a corpus with evaluation on has ``val_fraction`` or ``val_path``: see
    ``TrainConfig.problems``), in samples of ``seq_len`` tokens, ``seed`` the training seed.

    Raises:
        ValueError / FileNotFoundError: unreadable data.
    """
    options = dataclasses.asdict(data)
    kind = options.pop("kind")
    options.pop("shuffle", None)
    val_fraction = float(options.pop("val_fraction", 0.0) or 0.0)
    val_path = options.pop("val_path", None)
    if kind == "synthetic":
        options.setdefault("chain_seed", seed)
        train = build_source(kind, seq_len=seq_len, vocab_size=vocab_size, seed=seed, **options)
        val = (build_source(kind, seq_len=seq_len, vocab_size=vocab_size,
                            seed=seed + SYNTHETIC_VAL_SEED_OFFSET, **options) if with_val else None)
        return DataSources(train, val)
    train = build_source(kind, seq_len=seq_len, vocab_size=vocab_size, seed=seed, **options)
    if val_fraction:
        if not isinstance(train, TokenWindows):
            raise ValueError(f"data.val_fraction needs a finite corpus, not data={kind}")
        held_in, held_out = split_windows(train, val_fraction)
        return DataSources(held_in, held_out if with_val else None)
    if not with_val:
        return DataSources(train, None)
    path_key = "paths" if kind == "text" else "path"
    val = build_source(kind, seq_len=seq_len, vocab_size=vocab_size, seed=seed, **{**options, path_key: val_path})
    return DataSources(train, val)


def check_eval_steps(source: TokenSource, global_batch_size: int, steps: int) -> None:
    """A finite validation source (a corpus) holds ``steps`` global batches.

    Raises:
        ValueError: it holds fewer (naming how many it holds and the fix).
    """
    if not isinstance(source, TokenWindows):
        return  # synthetic: unbounded
    available = source.num_samples // global_batch_size
    holds = f"the validation data ({source.name}) holds {source.num_samples} samples"
    if available < 1:
        raise ValueError(f"{holds}, fewer than one global batch of {global_batch_size}; hold out more "
                         "(data.val_fraction) or use a larger data.val_path")
    if steps > available:
        raise ValueError(f"eval.steps={steps} needs {steps} global batches of {global_batch_size} samples, "
                         f"but {holds}: {available} batch(es); set eval.steps<={available}")


class Evaluator:
    """Mean next-token loss over the first ``steps`` global batches of the validation source.

    Checks this rank's part (``dp_rank`` of ``dp_size``) of the validation data, token by
    token, on construction. With tensor parallelism (``tp_size`` ranks per data-parallel
    rank, all of them reading the same slice) the logits stay sharded over the vocabulary.

    Raises:
        ValueError: the validation source holds fewer than ``steps`` global batches, a token id
            >= the model's vocab_size, or bad ranges.
    """

    def __init__(self, source: TokenSource, *, global_batch_size: int, dp_rank: int, dp_size: int,
                 every: int, steps: int, device: torch.device, tp_size: int = 1):
        if every < 1 or steps < 1:
            raise ValueError(f"eval.every={every} and eval.steps={steps} must be >= 1")
        check_eval_steps(source, global_batch_size, steps)
        source.validate(dp_rank, dp_size)
        self.source, self.global_batch_size = source, global_batch_size
        self.dp_rank, self.dp_size, self.every, self.steps, self.device = dp_rank, dp_size, every, steps, device
        self.tp_size = tp_size

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after ``step`` (every ``every`` steps and after the last one)."""
        return step % self.every == 0 or step == last_step

    @torch.no_grad()
    def evaluate(self, model: Union[nn.Module, Pipeline], cp: Optional[SequenceSplit] = None,
                 loss_chunks: int = 1, document_eos: Optional[int] = None) -> Dict[str, float]:
        """``val_loss`` (nats/token, averaged over every token of the data-parallel group) and
        ``val_ppl``. Collective: every rank calls.

        Every rank scores the same number of tokens, so the group's mean is the mean of the
        ranks' means (accumulated in float64 on the host, reduced as one float32 per rank; the
        ``tp_size`` ranks of a data-parallel rank hold the same mean). Through a pipeline, the
        last stage's ranks hold it and the others add 0. ``cp``: context parallelism (each CP
        rank scores its part of the same samples' sequences, the same number of tokens).
        ``loss_chunks``: the logits computed that many pieces of each sequence at a time.
        ``document_eos``: document masks, each packed document ending at this token.
        """
        loader = DistributedBatchLoader(self.source, self.global_batch_size, dp_rank=self.dp_rank,
                                        dp_size=self.dp_size, shuffle=False)
        local = 0.0
        for _ in range(self.steps):
            batch = loader.next_batch().to(self.device)
            if isinstance(model, Pipeline):
                local += model.mean_loss(batch, train=False).item()
                continue
            with micro_batch_context(cp, batch, document_eos) as context:
                if cp is not None:
                    local += cp.loss(model, batch, context, loss_chunks).item()
                else:
                    local += next_token_loss(model, batch, loss_chunks).item()
        mean = torch.tensor([local / self.steps], device=self.device)
        cp_size = cp.size if cp is not None else 1
        val_loss = all_reduce_sum(mean).item() / (self.dp_size * cp_size * self.tp_size)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}
