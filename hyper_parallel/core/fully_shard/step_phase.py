"""Where one fully_shard module and its parameter group are in the current step: the module's
phase (StepPhase), the group's backward protocol (GroupBackward) and where its parameters
are (ShardState)."""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any


class StepPhase(enum.Enum):
    """Where one fully_shard module is in the current step (FSDP2's ``TrainingState``, per
    module). Back to ``IDLE`` when the step ends (end-of-backward callback,
    ``reset_iter_state``) and when the root's next forward begins."""

    IDLE = "idle"  # not in this step's forward order: no forward with grad has run it yet
    FORWARD = "forward"  # ran forward with grad (in the step's forward order); backward not reached
    BACKWARD = "backward"  # pre-backward ran: parameters unsharded, gradients arriving
    REDUCED = "reduced"  # post-backward ran: gradients reduced (or issued), resharding pending


@dataclasses.dataclass(eq=False)
class GroupBackward:
    """The backward protocol of one parameter group: when it reduces (see [Note: when a group
    reduces]). Kept by the group's owner state; the forward calls it tracks are those of every
    module using the group's parameters (the owner's and those of modules borrowing them). A
    fresh record starts each backward."""

    # The input-gradient nodes (FullyShardModuleInputs) of those calls that have not run yet;
    # weakly held, so a call whose graph was dropped without a backward does not count. Once
    # empty, the owner reduces the group.
    calls: "weakref.WeakSet[Any]" = dataclasses.field(default_factory=weakref.WeakSet)
    # A call had no input that requires grad: nothing marks the end of its backward, so the
    # group reduces in the end-of-backward callback.
    untracked: bool = False
    # A module using the group started its backward: the end-of-backward callback reduces the
    # group if nothing did before.
    started: bool = False


class ShardState(enum.Enum):
    """Where a group's parameters are (FSDP2's ``ShardedState``, plus the all-gather in flight)."""

    SHARDED = "sharded"  # the modules hold the sharded DTensors; no unsharded storage
    # Sharded, and also holding the shards of a smaller group kept after forward
    # (reshard_after_forward=<int>, PostForwardShards): the backward all-gather runs within it.
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDING = "unsharding"  # all-gather in flight (InFlightGather records); wait_for_unshard ends it
    UNSHARDED = "unsharded"  # the modules hold the unsharded parameters (views of the buffers)
