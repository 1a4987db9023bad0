"""How the ranks agree: sums over all ranks, the votes after each step, and failing together
(the ranks that found a problem report it, the others stop quietly).

A problem found on one rank only (a bad token id in its slice of the data) must not leave the
other ranks waiting in a collective or dying on "Connection closed by peer". Each check is
followed by one all-reduce of a failure flag, so every rank learns that some rank failed and
all raise :class:`JobFailed` at the same point. In the training loop the flags ride on the
all-reduce each step does anyway (:func:`step_votes`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from hyper_parallel.trainer.config.compose import ConfigError

T = TypeVar("T")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values


class JobFailed(Exception):
    """Some rank found a problem; raised on every rank at the same point.

    Args:
        error: this rank's problem, or None when only other ranks found one.
        failed_ranks: how many ranks found a problem.
    """

    def __init__(self, error: Optional[ConfigError], failed_ranks: int):
        super().__init__(str(error) if error else f"{failed_ranks} other rank(s) failed")
        self.error, self.failed_ranks = error, failed_ranks

    def report(self, rank: int, world_size: int) -> Optional[str]:
        """The line this rank prints, or None to stay quiet.

        Ranks that found the problem print it with their rank; when every rank found one (the
        same problem everywhere, e.g. a checkpoint that does not fit), rank 0 prints it alone.
        """
        if self.error is None or (self.failed_ranks == world_size and rank != 0):
            return None
        if world_size == 1 or self.failed_ranks == world_size:
            return str(self.error)
        return f"(rank {rank} of {world_size}) {self.error}"


def count_ranks(flag: bool, device: torch.device) -> int:
    """How many ranks pass a true ``flag`` (one all-reduce: every rank calls at the same point)."""
    return int(all_reduce_sum(torch.tensor([float(flag)], device=device)).item())


def fail_together(error: Optional[ConfigError], device: torch.device) -> None:
    """Raise :class:`JobFailed` on every rank if ``error`` is set on any (one all-reduce).

    Every rank must call this at the same point.
    """
    failed = count_ranks(error is not None, device)
    if failed:
        raise JobFailed(error, failed)


class StepVotes(NamedTuple):
    """What the ranks say after a step, summed over all of them (:func:`step_votes`)."""

    loss_sum: float   # the ranks' losses
    sigterm: int      # ranks that got SIGTERM: stop at this step
    out_of_time: int  # ranks whose next step would end past the time limit: stop at this step
    bad_batch: int    # ranks that cannot read their next batch: fail together
    snapshot_busy: int = 0  # ranks whose last memory snapshot is still in flight: defer the next
    extra: Tuple[float, ...] = ()  # the ranks' ``extra`` values, summed (empty without)


def step_votes(loss: torch.Tensor, *, sigterm: bool, out_of_time: bool, bad_batch: bool,
               snapshot_busy: bool = False, extra: Optional[torch.Tensor] = None) -> StepVotes:
    """This rank's ``loss`` (a 0-dim tensor), votes and ``extra`` step statistics (a 1-D float
    tensor, the same length on every rank), summed over all ranks in one all-reduce.

    Every rank calls it after each step, at the same point.
    """
    flags = torch.tensor([float(sigterm), float(out_of_time), float(bad_batch), float(snapshot_busy)],
                         device=loss.device)
    parts = [loss.reshape(1), flags] + ([extra.to(loss.device, loss.dtype)] if extra is not None else [])
    summed = all_reduce_sum(torch.cat(parts)).tolist()
    return StepVotes(summed[0], *(int(votes) for votes in summed[1:5]), extra=tuple(summed[5:]))


def together(device: torch.device, action: Callable[[], T]) -> T:
    """``action()`` on every rank; a :class:`ConfigError` on any rank fails all of them."""
    error, result = None, None
    try:
        result = action()
    except ConfigError as err:
        error = err
    fail_together(error, device)
    return result
