"""CPU offload of a parameter group's reduced gradients: copied to host memory on the
reduce-scatter stream without the host waiting, waited for once at the end of backward (the
FSDP2 design; docs/fully_shard.md, "Streams")."""

from __future__ import annotations

from typing import List

import torch
from torch.profiler import record_function

from hyper_parallel._torch_compat import post_accumulate_grad_hooks
from hyper_parallel.core.fully_shard.collectives import profiler_label
from hyper_parallel.core.fully_shard.flat_bucket import FlatBucket
from hyper_parallel.core.fully_shard.in_flight import OffloadedGrads
from hyper_parallel.platform import Streams, get_platform


class GradOffload:
    """One group's gradient copies to host memory in flight."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams
        self._copies: List[OffloadedGrads] = []

    @property
    def pending(self) -> bool:
        return bool(self._copies)

    def copy(self, bucket: FlatBucket, reduced: torch.Tensor, pin: bool, module_fqn: str = "") -> None:
        """Copy ``bucket``'s reduced gradients (written on the compute stream) to host memory on
        the reduce-scatter stream: into pinned memory without blocking the host when ``pin``.
        A post-accumulate-grad hook reads the gradient on the host as soon as it is set, so such
        a bucket's copy is waited for at once. ``module_fqn`` labels the profiler range."""
        streams = self._streams
        streams.wait_for_current(streams.reduce_scatter)
        with record_function(profiler_label("offload_grads", module_fqn)), streams.use(streams.reduce_scatter):
            host = reduced.to("cpu", non_blocking=pin)
            event = streams.record_host_event()
        self._copies.append(OffloadedGrads(bucket, host, reduced, bucket.take_local_grads(), event))
        if any(post_accumulate_grad_hooks(p.sharded_param) for p in bucket.trainable):
            self.finish()

    def release_sources(self) -> None:
        """Order the compute stream after the copies issued so far and drop their device
        sources (the compute stream allocated them), as FSDP2's next post-backward waits for the
        previous group's post-reduce event: about one group's copies hold device memory."""
        for i, item in enumerate(self._copies):
            if item.source is not None:
                self._streams.wait_event(item.event)
                self._copies[i] = item._replace(source=None)

    def finish(self, waited: bool = False) -> None:
        """Wait for the copies (unless ``waited``: the caller did, see :func:`finish_offloads`)
        and set the sharded gradients from them."""
        items, self._copies = self._copies, []
        if items and not waited:
            self._streams.synchronize(items[-1].event)
        for item in items:
            item.bucket.assign_grads(item.host, item.local)

    def discard(self) -> None:
        """After an aborted step: wait for the copies and drop them."""
        for item in self._copies:
            self._streams.synchronize(item.event)
        self._copies = []


def finish_offloads(offloads: List[GradOffload]) -> None:
    """End of backward: the host waits once for every gradient copy to host memory (they run
    in order on the reduce-scatter stream), then the groups set their sharded gradients."""
    pending = [offload for offload in offloads if offload.pending]
    if not pending:
        return
    streams = get_platform().streams()
    with streams.use(streams.reduce_scatter):
        done = streams.record_host_event()
    streams.synchronize(done)
    for offload in pending:
        offload.finish(waited=True)
