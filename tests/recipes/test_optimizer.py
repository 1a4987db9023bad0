"""The recipe's AdamW: multi-tensor (fused on CPU/CUDA), one parameter group per device mesh,
and the same update as the per-parameter implementation."""

import copy

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import hyper_parallel as hp
from hyper_parallel.trainer.setup.optimizer import build_optimizer, mesh_groups
from tests.fully_shard._helpers import full_params, global_batch, lm_loss, max_diff, tiny_llama
from tests.multirank import run_on_ranks

CFG = OmegaConf.create({"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1})


def _two_meshes_vs_for_loop():
    """Blocks on a 1-D mesh, the root on a (1, 2) HSDP mesh: two groups; three steps equal to
    torch's for-loop AdamW on a copy."""
    flat, hsdp = hp.init_device_mesh("cpu", (2,)), hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("r", "s"))
    torch.manual_seed(0)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    for net in (model, reference):
        for block in net.layers.values():
            hp.fully_shard(block, mesh=flat)
        hp.fully_shard(net, mesh=hsdp)
    optim = build_optimizer(model, CFG)
    loop = torch.optim.AdamW(reference.parameters(), lr=CFG.lr, betas=tuple(CFG.betas), eps=CFG.eps,
                             weight_decay=CFG.weight_decay, foreach=False)
    batch = global_batch(0).chunk(dist.get_world_size())[dist.get_rank()]
    for net, opt in ((model, optim), (reference, loop)):
        for _ in range(3):
            lm_loss(net, batch).backward()
            opt.step()
            opt.zero_grad()
    groups = [len(g) for g in mesh_groups(model)]
    return groups, [g["fused"] for g in optim.param_groups], max_diff(full_params(model), full_params(reference))


def test_adamw_is_fused_with_one_group_per_mesh_and_matches_the_for_loop():
    for groups, fused, diff in run_on_ranks(2, _two_meshes_vs_for_loop, timeout=120):
        assert len(groups) == 2 and fused == [True, True], (groups, fused)
        assert diff <= 1e-10, diff  # float64: only the kernels' rounding differs
