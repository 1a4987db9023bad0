"""Zero-element DTensors sharded on a non-empty dim save and load (sync and async)."""

from __future__ import annotations

import torch

from tests.multirank import run_on_ranks

T = 120


def _zero_element_round_trip(path, use_async):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel import checkpoint as hdcp

    mesh = init_device_mesh("cpu", (2,))
    state = {"a": distribute_tensor(torch.zeros(4, 0), mesh, (Shard(0),)),
             "b": distribute_tensor(torch.zeros(0, 6, dtype=torch.float64), mesh, (Shard(1),)),
             "c": distribute_tensor(torch.arange(6.0), mesh, (Shard(0),))}
    if use_async:
        hdcp.async_save(state, checkpoint_id=path).result(timeout=T)
    else:
        hdcp.save(state, checkpoint_id=path)
    target = {"a": distribute_tensor(torch.ones(4, 0), mesh, (Shard(1),)),
              "b": distribute_tensor(torch.ones(0, 6, dtype=torch.float64), mesh, (Shard(0),)),
              "c": distribute_tensor(torch.zeros(6), mesh, (Shard(0),))}
    hdcp.load(target, checkpoint_id=path)
    plain = {"a": torch.ones(4, 0), "b": torch.ones(0, 6, dtype=torch.float64), "c": torch.zeros(6)}
    hdcp.load(plain, checkpoint_id=path, no_dist=True)
    hdcp.verify_checkpoint(path)
    return ([tuple(t.shape) for t in target.values()], torch.equal(target["c"].full_tensor(), torch.arange(6.0)),
            [tuple(t.shape) for t in plain.values()], torch.equal(plain["c"], torch.arange(6.0)))


def test_zero_element_dtensors_sharded_on_a_non_empty_dim_round_trip(tmp_path):
    for use_async in (False, True):
        results = run_on_ranks(2, _zero_element_round_trip, str(tmp_path / f"ckpt{use_async}"), use_async,
                               timeout=T)
        for shapes, c_ok, plain_shapes, plain_ok in results:
            assert shapes == [(4, 0), (0, 6), (6,)] and c_ok
            assert plain_shapes == [(4, 0), (0, 6), (6,)] and plain_ok
