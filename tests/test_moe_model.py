"""The mixture-of-experts model (hyper_parallel.models.moe): the layer against a per-token
reference in float64, routing, the balancing loss and bias, token counts, presets, sharding."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.models.moe import MOE_CONFIGS, MoEConfig, build_moe, memory_per_rank, param_counts
from hyper_parallel.models.moe_layer import MoE, TopKRouter, load_balance_loss
from tests.fully_shard._helpers import shard_layers_and_root
from tests.multirank import run_on_ranks

DIM, HIDDEN, EXPERTS = 12, 10, 6


def _layer(top_k=2, norm_topk_prob=True, shared=0, seed=0, **kw) -> MoE:
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, norm_topk_prob=norm_topk_prob, shared_hidden_dim=shared, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return moe.double()


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, each chosen expert's SwiGLU on its own, weighted sum."""
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for token in x:
        probs = F.softmax(moe.router.gate(token), dim=-1)
        top = torch.topk(probs, moe.top_k).indices
        weights = probs[top] / (probs[top].sum() if moe.router.norm_topk_prob else 1)
        out = sum(w * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token))) for w, e in zip(weights, top.tolist()))
        if moe.shared_expert is not None:
            out = out + moe.shared_expert(token)
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k, norm_topk_prob, shared", [(2, True, 0), (3, False, 8), (1, True, 0)])
def test_moe_forward_and_backward_match_a_per_token_loop_in_float64(top_k, norm_topk_prob, shared):
    moe = _layer(top_k, norm_topk_prob, shared)
    x = torch.randn(3, 7, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(3, 7, DIM, dtype=torch.float64)
    params = [x, *moe.parameters()]
    out = moe(x)
    grads = torch.autograd.grad((out * weight).sum(), params)
    expected = _reference(moe, x.view(-1, DIM)).view_as(out)
    expected_grads = torch.autograd.grad((expected * weight).sum(), params)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert all(g.abs().sum() > 0 for g in grads)  # every parameter (and the input) gets a gradient
    assert int(moe.tokens_per_expert.sum()) == 21 * top_k


def test_router_picks_the_top_k_and_renormalises_their_weights():
    router = TopKRouter(3, 4, 2, norm_topk_prob=True).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4, 3, dtype=torch.float64))  # logits: x, then 0
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, -1.0, -2.0]], dtype=torch.float64)
    probs, experts, weights = router(x)
    torch.testing.assert_close(probs, F.softmax(torch.cat([x, torch.zeros(2, 1, dtype=x.dtype)], 1), -1))
    assert experts.tolist() == [[0, 2], [0, 3]]  # token 1: logits 0, -1, -2, 0 (a tie: the lower index first)
    p = probs[0]
    torch.testing.assert_close(weights[0], torch.stack([p[0], p[2]]) / (p[0] + p[2]))
    router.norm_topk_prob = False
    torch.testing.assert_close(router(x).weights[0], torch.stack([p[0], p[2]]))


def test_load_balance_loss_is_the_hand_computed_value():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.1, 0.3]], dtype=torch.float64)
    counts = torch.tensor([3, 2, 0, 1])  # 3 tokens x top-2 pairs
    # E / (k N) * sum_e count_e * mean_t p_te = 4 / 6 * (3 * 1.3 + 2 * 0.9 + 0 * 0.4 + 1 * 0.4) / 3
    expected = 4 / 6 * (3 * 1.3 + 2 * 0.9 + 1 * 0.4) / 3
    assert load_balance_loss(probs, counts, 2).item() == pytest.approx(expected, rel=1e-12)
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    assert load_balance_loss(uniform, torch.tensor([4, 4, 4, 4]), 2).item() == pytest.approx(1.0)


def test_model_aux_loss_is_the_weighted_sum_over_layers_and_trains_the_router():
    model = build_moe("moe_debug", aux_loss_weight=0.5).double()
    model.init_weights(seed=2)
    captured = {}
    for name, moe in model.moe_layers().items():
        moe.router.register_forward_hook(lambda mod, args, out, name=name: captured.__setitem__(name, out))
    model(torch.randint(0, 256, (2, 9)))
    by_hand = sum(load_balance_loss(r.probs, torch.bincount(r.experts.flatten(), minlength=8), 2)
                  for r in captured.values())
    torch.testing.assert_close(model.aux_loss(), 0.5 * by_hand.detach(), rtol=1e-12, atol=0)
    assert not model.aux_loss().requires_grad  # a value for metrics: the backward already has it
    assert build_moe("moe_debug", aux_loss_weight=0.0)(torch.zeros(1, 2, dtype=torch.long)) is not None
    assert build_moe("moe_debug", aux_loss_weight=0.0).aux_loss().item() == 0


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_backward_of_the_loss_includes_the_attached_aux_loss_at_the_declared_scale(scale):
    # Each MoE layer attaches its weighted aux loss to its output: the gradients of
    # scale * loss are those of scale * (loss + aux) when the aux's built by hand is added.
    model = build_moe("moe_debug", n_layers=3, first_k_dense=1, ffn_hidden_dim=48, aux_loss_weight=0.5).double()
    model.init_weights(seed=2)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    model.set_aux_loss_scale(scale)
    got = torch.autograd.grad(scale * model(tokens).pow(2).mean(), params, allow_unused=True)

    plain = build_moe("moe_debug", n_layers=3, first_k_dense=1, ffn_hidden_dim=48, aux_loss_weight=0.0).double()
    plain.load_state_dict(model.state_dict())
    captured = []
    for moe in plain.moe_layers().values():
        moe.router.register_forward_hook(lambda mod, args, out: captured.append(out))
    loss = plain(tokens).pow(2).mean()
    aux = 0.5 * sum(load_balance_loss(r.probs, torch.bincount(r.experts.flatten(), minlength=8), 2)
                    for r in captured)
    want = torch.autograd.grad(scale * (loss + aux), list(plain.parameters()), allow_unused=True)
    gate = [i for i, (name, _) in enumerate(model.named_parameters()) if name.endswith("router.gate.weight")]
    assert len(gate) == 2
    for i in gate:  # the router's gradient is where the aux loss shows
        no_aux = torch.autograd.grad(scale * plain(tokens).pow(2).mean(), [list(plain.parameters())[i]])[0]
        assert (want[i] - no_aux).abs().max() > 1e-6
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14, msg=name)
    with pytest.raises(ValueError, match=r"aux loss scale 0 must be a finite number > 0"):
        model.set_aux_loss_scale(0)
    with torch.no_grad():  # evaluation: nothing attached, the value still reported
        model(tokens)
    assert model.aux_loss() > 0


def test_tokens_per_expert_are_the_routed_pairs_of_the_last_forward():
    model = build_moe("moe_debug", n_layers=3, first_k_dense=1, ffn_hidden_dim=48)
    model.init_weights(seed=0)
    routed = {}
    for name, moe in model.moe_layers().items():
        moe.router.register_forward_hook(lambda mod, args, out, name=name: routed.__setitem__(name, out.experts))
    for batch in (4, 3):  # the counts are of the last forward only
        model(torch.randint(0, 256, (batch, 8)))
    counts = model.tokens_per_expert()
    assert sorted(counts) == ["1", "2"]  # block 0 is dense
    for name, value in counts.items():
        assert value.dtype == torch.int64 and int(value.sum()) == 3 * 8 * 2
        assert value.tolist() == torch.bincount(routed[name].flatten(), minlength=8).tolist()


def test_expert_bias_moves_towards_balance_and_changes_only_the_choice():
    moe = _layer(expert_bias=True)
    moe.pending_tokens_per_expert.copy_(torch.tensor([10, 0, 4, 4, 2, 4]))  # mean 4
    moe.update_expert_bias(0.1)
    delta = 0.1 * torch.tensor([-1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(moe.router.expert_bias, delta - delta.mean())
    assert moe.pending_tokens_per_expert.sum() == 0
    x = torch.randn(5, DIM, dtype=torch.float64)
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0]))
    probs, experts, weights = moe.router(x)
    assert (experts == 5).any(dim=1).all()  # the bias wins every token expert 5 ...
    torch.testing.assert_close(weights, probs.gather(1, experts) / probs.gather(1, experts).sum(1, keepdim=True))
    moe(x.view(1, 5, DIM))
    assert moe.pending_tokens_per_expert[5] == 5  # ... and the counts since the update accumulate
    with pytest.raises(ValueError, match="no expert_bias"):
        _layer().update_expert_bias(0.1)
    with pytest.raises(ValueError, match="expert_bias_update_rate > 0"):
        build_moe("moe_debug").update_expert_bias()


def test_grouped_experts_refuse_counts_that_do_not_match():
    experts = _layer().experts
    with pytest.raises(ValueError, match=r"non-negative counts summing to the 4 rows of x, got \[1, 1, 1, 0, 0, 0\]"):
        experts(torch.zeros(4, DIM, dtype=torch.float64), torch.tensor([1, 1, 1, 0, 0, 0]))
    out = experts(torch.zeros(0, DIM, dtype=torch.float64), torch.zeros(EXPERTS, dtype=torch.long))
    assert out.shape == (0, DIM)
    out.sum().backward()
    assert experts.w1.grad is not None  # no tokens: the weights still take part in autograd


def test_presets_have_the_published_parameter_counts():
    qwen = param_counts(MoEConfig(**MOE_CONFIGS["qwen3_30b_a3b"]))
    # Qwen3-30B-A3B's model card: 30.5B total, 3.3B activated, 29.9B non-embedding.
    assert qwen.total == pytest.approx(30.5e9, rel=0.01) and qwen.active == pytest.approx(3.3e9, rel=0.03)
    assert qwen.total - 2 * qwen.embedding == pytest.approx(29.9e9, rel=0.01)
    deepseek = param_counts(MoEConfig(**MOE_CONFIGS["deepseek_v3_16b"]))
    # DeepSeek-V2-Lite: 15.7B total, 2.4B activated (the input embedding's lookup not counted).
    assert deepseek.total == pytest.approx(15.7e9, rel=0.01)
    assert deepseek.active - deepseek.embedding == pytest.approx(2.4e9, rel=0.03)
    debug = build_moe("moe_debug")
    assert param_counts(debug.cfg).total == debug.num_params()


@pytest.mark.parametrize("fields, problem", [
    (dict(top_k=9), "top_k=9 is more than num_experts=8"),
    (dict(first_k_dense=1), "first_k_dense=1 dense blocks need ffn_hidden_dim > 0"),
    (dict(first_k_dense=3, ffn_hidden_dim=8), "first_k_dense=3 is more than n_layers=2"),
    (dict(num_experts=0), "num_experts=0 must be an integer >= 1"),
    (dict(aux_loss_weight=-1.0), "aux_loss_weight=-1.0 must be a finite number >= 0"),
    (dict(dim=30), "dim=30 is not divisible by n_heads=4; set head_dim"),
    (dict(head_dim=7), "head_dim=7 must be an even integer >= 2"),
])
def test_bad_moe_config_is_refused_in_one_line(fields, problem):
    with pytest.raises(ValueError, match=re.escape(problem)) as err:
        build_moe("moe_debug", **fields)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown MoE model 'moe_tiny'"):
        build_moe("moe_tiny")


def _sharded_moe(seed):
    """moe_debug under fully_shard on every rank: full parameters, one training step's loss and
    gradients, and the expert bias after an update from the summed counts."""
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    with torch.device("meta"):
        model = build_moe("moe_debug", expert_bias_update_rate=0.01)
    shard_layers_and_root(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    rank = torch.distributed.get_rank()
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().pow(2).mean().backward()  # (with the attached aux loss)
    model.update_expert_bias()
    bias = model.layers["0"].moe.router.expert_bias.clone()
    return full, tokens, bias


def test_sharded_init_and_bias_update_match_one_process():
    ranks = run_on_ranks(2, _sharded_moe, 3)
    reference = build_moe("moe_debug", expert_bias_update_rate=0.01)
    reference.init_weights(seed=3)
    for name, value in reference.named_parameters():
        assert torch.equal(ranks[0][0][name], value.detach()), name
    reference(torch.cat([tokens for _, tokens, _ in ranks]))  # the counts of both ranks' tokens
    reference.update_expert_bias()
    for _, _, bias in ranks:
        torch.testing.assert_close(bias, reference.layers["0"].moe.router.expert_bias)
    assert reference.layers["0"].moe.router.expert_bias.abs().sum() > 0


def test_memory_per_rank_and_the_docs_table():
    qwen = MoEConfig(**MOE_CONFIGS["qwen3_30b_a3b"])
    counts = param_counts(qwen)
    fsdp, ep8 = memory_per_rank(qwen, 64), memory_per_rank(qwen, 64, ep=8)
    assert fsdp.model_state == ep8.model_state == 16 * counts.total // 64
    block = (counts.total - 2 * counts.embedding - qwen.dim) // qwen.n_layers
    experts = 3 * qwen.num_experts * qwen.dim * qwen.moe_ffn_dim
    assert fsdp.blocks == 2 * 2 * block and ep8.blocks == 2 * 2 * (block - experts + experts // 8)
    assert fsdp.root == 2 * (2 * counts.embedding + qwen.dim)
    with pytest.raises(ValueError, match="expert parallelism 3 must divide the 64 ranks and num_experts=128"):
        memory_per_rank(qwen, 64, ep=3)
    docs = (Path(__file__).parents[1] / "docs" / "moe.md").read_text()
    for name in ("qwen3_30b_a3b", "deepseek_v3_16b"):
        cfg = MoEConfig(**MOE_CONFIGS[name])
        for ranks, ep in ((8, 1), (8, 8), (64, 8)):
            m = memory_per_rank(cfg, ranks, ep)
            row = " | ".join(f"{value / 1e9:.1f} GB" for value in (*m, m.total))
            assert re.search(rf"\| `{name}` \| {ranks} \| [^|]+ \| {re.escape(row)} \|", docs), (name, ranks, ep, row)


def test_tensor_parallelism_refuses_the_moe_model_in_one_line():
    from hyper_parallel.models.llama_parallel import apply_tensor_parallel

    with pytest.raises(ValueError, match="not MoETransformer; the MoE model has no tensor-parallel plan"):
        apply_tensor_parallel(build_moe("moe_debug"), None)
    with pytest.raises(ValueError, match="MoETransformer: the MoE model has no tensor-parallel plan"):
        build_moe("moe_debug").apply_tensor_parallel(None)  # what the recipe calls


def test_pipeline_stages_of_the_moe_model_compute_the_whole_model():
    from hyper_parallel.models.llama_parallel import split_stage

    model = build_moe("moe_debug", n_layers=3)
    model.init_weights(seed=1)
    first = split_stage(model, range(0, 2), first=True, last=False)
    last = split_stage(model, range(2, 3), first=False, last=True)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)
    assert sorted(first.moe_layers()) == ["0", "1"] and sorted(last.moe_layers()) == ["2"]
