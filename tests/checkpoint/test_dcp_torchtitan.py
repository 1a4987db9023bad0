"""torchtitan 0.3.0 checkpoints into ours: a DCP checkpoint laid out as torchtitan's
CheckpointManager writes it (written here with torch's fully_shard + dcp.save, torchtitan not
needed) is imported with the documented pattern renames and the fused ``wqkv`` split, then
loaded into our Llama with its optimizer, every value equal; plus the mapping's pieces and
refusals."""

import copy
import os
import pickle
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint import CheckpointError
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.core.distributed_checkpoint.dcp_interop import map_keys
from hyper_parallel.core.distributed_checkpoint.dcp_interop.fused_split import FusedLayout, FusedSplit, part_chunks
from hyper_parallel.core.distributed_checkpoint.dcp_interop.key_mapping import RenameRule
from hyper_parallel.core.distributed_checkpoint.format.metadata import ChunkStorageMetadata
from tests.checkpoint.helpers import make_llama
from tests.multirank import run_on_ranks

SEED = 11
N_HEADS, N_KV_HEADS = 4, 2  # llama_debug's
# The command docs/checkpoint.md gives for a torchtitan 0.3.0 Llama 3 checkpoint.
TITAN_STATES = ["--exclude", "lr_scheduler.", "--exclude", "train_state."]
TITAN_MAPPING = [
    "--split-fused", f"wqkv=wq,wk,wv:{N_HEADS}:{N_KV_HEADS}",
    "--rename", "optimizer.state.layers.*.attention.qkv_linear.=optim.state.layers.*.attention.",
    "--rename", "optimizer.state.lm_head.=optim.state.output.",
    "--rename", "optimizer.=optim.",
    "--rename", "layers.*.attention.qkv_linear.=model.layers.*.attention.",
    "--rename", "lm_head.=model.output.",
    "--rename", "=model.",
]
TITAN_TO_OURS = [*TITAN_STATES, "--exclude", "dataloader", *TITAN_MAPPING]


def _fuse(wq, wk, wv, n_kv):
    """torchtitan's FusedQKVLinear layout: per kv head, its query heads, its key head, its value head."""
    hd, dim = wk.shape[0] // n_kv, wq.shape[1]
    return torch.cat([wq.reshape(n_kv, -1, hd, dim), wk.reshape(n_kv, 1, hd, dim), wv.reshape(n_kv, 1, hd, dim)],
                     dim=1).reshape(-1, dim)


def _unfuse(wqkv, n_heads, n_kv):
    """torchtitan 0.3.0's ``FusedQKVLinear._split_qkv_on_save`` (weight): wq, wk, wv."""
    per_kv = n_heads // n_kv
    hd = wqkv.shape[0] // (n_kv * (per_kv + 2))
    w = wqkv.reshape(n_kv, per_kv + 2, hd, *wqkv.shape[1:])
    return (w[:, :per_kv].reshape(-1, *wqkv.shape[1:]).contiguous(),
            w[:, per_kv].reshape(-1, *wqkv.shape[1:]).contiguous(),
            w[:, per_kv + 1].reshape(-1, *wqkv.shape[1:]).contiguous())


class _TitanFusedQKV(nn.Module):
    """torchtitan 0.3.0's ``FusedQKVLinear`` as checkpoints see it: one ``wqkv`` parameter;
    ``state_dict()`` holds ``wq``/``wk``/``wv`` instead (its post hook, which gathers a
    sharded ``wqkv`` to Replicate first)."""

    def __init__(self, wq, wk, wv):
        super().__init__()
        self.wqkv = nn.Linear(wq.shape[1], wq.shape[0] + 2 * wk.shape[0], bias=False)
        with torch.no_grad():
            self.wqkv.weight.copy_(_fuse(wq, wk, wv, N_KV_HEADS))
        self.register_state_dict_post_hook(self._split_qkv_on_save)

    @staticmethod
    def _split_qkv_on_save(module, state_dict, prefix, local_metadata):
        tensor = state_dict.pop(f"{prefix}wqkv.weight")
        if isinstance(tensor, DTensor):
            tensor = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
        for name, part in zip(("wq", "wk", "wv"), _unfuse(tensor, N_HEADS, N_KV_HEADS)):
            state_dict[f"{prefix}{name}.weight"] = part


def _titan_llama(ours):
    """torchtitan 0.3.0's Llama 3 module tree (fused qkv, ``lm_head``) with the values of ours."""
    titan = nn.Module()
    titan.tok_embeddings = copy.deepcopy(ours.tok_embeddings)
    titan.layers = nn.ModuleDict()
    for name, block in ours.layers.items():
        layer = titan.layers[name] = nn.Module()
        layer.attention = nn.Module()
        attn = block.attention
        layer.attention.qkv_linear = _TitanFusedQKV(attn.wq.weight.detach(), attn.wk.weight.detach(),
                                                    attn.wv.weight.detach())
        layer.attention.wo = copy.deepcopy(attn.wo)
        for part in ("attention_norm", "feed_forward", "ffn_norm"):
            setattr(layer, part, copy.deepcopy(getattr(block, part)))
    titan.norm = copy.deepcopy(ours.norm)
    titan.lm_head = copy.deepcopy(ours.output)
    return titan


def _titan_groups(model):
    """Two param groups, as torchtitan's ParamGroupConfig patterns make them (with names)."""
    named = list(model.named_parameters())
    norms = [(n, p) for n, p in named if "norm" in n]
    rest = [(n, p) for n, p in named if "norm" not in n]
    return [{"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "weight_decay": 0.1},
            {"params": [p for _, p in norms], "param_names": [n for n, _ in norms], "weight_decay": 0.0}]


def _titan_flat_optim_state_dict(optim):
    """torchtitan 0.3.0's ``get_flat_optim_state_dict``: ``state.<fqn>.<name>`` and
    ``param_groups.<fqn>.<name>`` per parameter."""
    sd = optim.state_dict()
    names = {pid: fqn for g in sd["param_groups"] for pid, fqn in zip(g["params"], g["param_names"])}
    flat = {f"state.{names[pid]}.{k}": v for pid, state in sd["state"].items() for k, v in state.items()}
    for group in sd["param_groups"]:
        for fqn in group["param_names"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k not in ("params", "param_names")})
    return flat


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _save_like_torchtitan(folder):
    """What torchtitan 0.3.0's CheckpointManager saves at step 2 (FSDP on 2 ranks, AdamW +
    LambdaLR): the model's keys at the top level, then optimizer, lr_scheduler, dataloader
    (a pickled state per dp rank) and train_state; returns the state our names should get."""
    ours = make_llama(seed=SEED)
    titan = _titan_llama(ours)
    for layer in titan.layers.values():
        torch_fully_shard(layer)
    torch_fully_shard(titan)
    optim = torch.optim.AdamW(_titan_groups(titan), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5 + 0.1 * step)
    for step in range(2):
        for name, param in titan.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + step)  # the same on every rank
            param.grad = distribute_tensor(torch.randn(param.shape, generator=g), param.device_mesh, param.placements)
        optim.step()
        schedule.step()
    rank = dist.get_rank()
    model_sd = titan.state_dict()
    states = {**model_sd, "optimizer": _titan_flat_optim_state_dict(optim),
              "lr_scheduler": {"last_epoch": schedule.last_epoch},
              "dataloader": {f"dp_rank_{rank}": pickle.dumps({"sample": 7 + rank}), "world_size": 2},
              "train_state": {"step": 2, "ntokens_seen": 4096}}
    torch_dcp.save(states, checkpoint_id=os.path.join(folder, "step-2"))
    # Expected, in our names: the split of the fused moments is torchtitan's own (_unfuse).
    ours_name = lambda fqn: fqn.replace("qkv_linear.", "").replace("lm_head", "output")  # noqa: E731
    fqns = {p: n for n, p in titan.named_parameters()}
    expected = {f"model.{ours_name(k)}": _full(v) for k, v in model_sd.items()}
    groups = []
    for group in optim.param_groups:
        names = []
        for param in group["params"]:
            name = ours_name(fqns[param])
            state = {k: _full(v) for k, v in optim.state[param].items()}
            parts = [(name, state)]
            if "wqkv" in name:
                split = {k: _unfuse(v, N_HEADS, N_KV_HEADS) if v.dim() else (v, v, v) for k, v in state.items()}
                parts = [(name.replace("wqkv", w), {k: v[i] for k, v in split.items()})
                         for i, w in enumerate(("wq", "wk", "wv"))]
            for part, values in parts:
                names.append(part)
                expected.update({f"optim.state.{part}.{k}": v for k, v in values.items()})
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": names})
    return expected, groups


def _load_into_our_llama(path):
    """Our Llama under hp.fully_shard on 2 ranks, AdamW with the same two groups; load; full state."""
    model = make_llama(seed=SEED + 1)
    for layer in model.layers.values():
        hp.fully_shard(layer)
    hp.fully_shard(model)
    groups = _titan_groups(model)
    for group in groups:
        del group["param_names"]
    optim = torch.optim.AdamW(groups, lr=1e-3)
    hdcp.load({"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}, checkpoint_id=path)
    flat, _ = hdcp.flatten_state_dict({"model": hdcp.get_model_state_dict(model),
                                       "optim": hdcp.get_optimizer_state_dict(model, optim)})
    return {k: _full(v) for k, v in flat.items()}


@pytest.fixture(scope="module")
def titan_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("titan"))
    expected, groups = run_on_ranks(2, _save_like_torchtitan, folder, timeout=120)[0]
    return os.path.join(folder, "step-2"), expected, groups


def test_torchtitan_checkpoint_imports_and_loads_model_and_optimizer(titan_checkpoint, tmp_path):
    src, expected, groups = titan_checkpoint
    keys = set(torch_dcp.FileSystemReader(src).read_metadata().state_dict_metadata)
    # torchtitan's names: split model weights, fused optimizer state, flattened param groups.
    assert {"layers.0.attention.qkv_linear.wq.weight", "lm_head.weight",
            "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg",
            "optimizer.param_groups.layers.0.attention.qkv_linear.wqkv.weight.lr"} <= keys
    dst = str(tmp_path / "ours")
    assert main(["import-dcp", src, dst, *TITAN_TO_OURS]) == 0
    assert main(["verify", dst]) == 0
    for loaded in run_on_ranks(2, _load_into_our_llama, dst, timeout=120):
        loaded_groups = loaded.pop("optim.param_groups")
        assert loaded.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
        assert [dict(g, betas=tuple(g["betas"])) for g in loaded_groups] == groups
        assert {g["weight_decay"] for g in groups} == {0.1, 0.0} and groups[0]["initial_lr"] == 8e-4


def test_torchtitan_weights_reach_model_init_from_through_export_hf(titan_checkpoint, tmp_path):
    """docs/checkpoint.md's weights-only command, then export-hf and load_hf (what model.init_from does)."""
    src, expected, _ = titan_checkpoint
    ours, hf = str(tmp_path / "ours"), str(tmp_path / "hf")
    assert main(["import-dcp", src, ours, "--exclude", "optimizer.", "--exclude", "lr_scheduler.",
                 "--exclude", "dataloader", "--exclude", "train_state.",
                 "--rename", "layers.*.attention.qkv_linear.=layers.*.attention.", "--rename", "lm_head.=output."]) == 0
    assert main(["export-hf", ours, hf]) == 0
    model = make_llama(seed=SEED + 2)
    hdcp.load_hf(model, hf)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[f"model.{key}"]), key


def test_wrong_head_counts_and_non_plain_values_are_refused_naming_the_key(titan_checkpoint, tmp_path, capsys):
    src, _, _ = titan_checkpoint
    wrong = [a.replace(f":{N_HEADS}:{N_KV_HEADS}", ":5:1") for a in TITAN_TO_OURS]  # 7 heads: 48 rows do not divide
    assert main(["import-dcp", src, str(tmp_path / "a"), *wrong]) == 1
    assert "cannot split 'optimizer.state.layers." in capsys.readouterr().err
    assert main(["import-dcp", src, str(tmp_path / "b"), *TITAN_STATES, *TITAN_MAPPING]) == 1
    assert "dataloader.dp_rank_" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- the pieces


def test_patterns_match_one_component_and_carry_it_to_the_new_name():
    rule = RenameRule.parse("layers.*.attention.qkv_linear.=model.layers.*.attention.")
    assert rule.apply("layers.12.attention.qkv_linear.wq.weight") == "model.layers.12.attention.wq.weight"
    assert rule.apply("layers.1.2.attention.qkv_linear.wq.weight") is None  # '*' is one component
    assert rule.apply("layers..attention.qkv_linear.wq.weight") is None
    assert map_keys(["a.0.x", "a.1.x", "b.0.x"], rename=[("a.*.", "z.*.")], exclude=["b.*.x"]) == {
        "z.0.x": "a.0.x", "z.1.x": "a.1.x"}
    with pytest.raises(ValueError, match=r"NEW has 2 '\*', OLD has 1"):
        RenameRule.parse("a.*.=b.*.*.")
    with pytest.raises(CheckpointError, match=r"'a.0.x' and 'a.1.x' both map to 'z.x'"):
        map_keys(["a.0.x", "a.1.x"], rename=[("a.*.", "z.")])


@pytest.mark.parametrize("layout", list(FusedLayout))
def test_split_rows_of_uneven_chunks_equal_the_layouts_split(layout):
    split = FusedSplit.parse(f"wqkv=wq,wk,wv:6:2:{layout.value}")
    hd, cols = 3, 5
    fused = torch.randn((6 + 4) * hd, cols)
    if layout is FusedLayout.GROUPED:
        expected = _unfuse(fused, 6, 2)
    else:
        expected = torch.split(fused, [6 * hd, 2 * hd, 2 * hd])
    stored = [ChunkStorageMetadata((0, 0), (7, cols)), ChunkStorageMetadata((7, 0), (11, cols)),
              ChunkStorageMetadata((18, 0), (12, cols))]  # boundaries inside heads on purpose
    for rows, want in zip(split.part_rows(fused.shape[0], "k"), expected):
        got = torch.full_like(want, float("nan"))
        for piece in part_chunks(rows, stored):
            source = fused[piece.source_offsets[0]:]
            data = torch.cat([source.narrow(0, start, n) for start, n in piece.rows])
            got[piece.chunk.offsets[0]:piece.chunk.offsets[0] + piece.chunk.sizes[0]] = data
        assert torch.equal(got, want)


def test_split_fused_option_is_checked():
    with pytest.raises(ValueError, match="FUSED=Q,K,V:N_HEADS:N_KV_HEADS"):
        FusedSplit.parse("wqkv=wq,wk:4:2")
    with pytest.raises(ValueError, match="unknown layout 'zigzag'"):
        FusedSplit.parse("wqkv=wq,wk,wv:4:2:zigzag")
    with pytest.raises(ValueError, match="n_heads=6 is not a multiple of n_kv_heads=4"):
        FusedSplit.parse("wqkv=wq,wk,wv:6:4")
    assert FusedSplit.parse("wqkv=wq,wk,wv:4:2").part_keys("o.state.l.0.wqkv.weight.step") == [
        "o.state.l.0.wq.weight.step", "o.state.l.0.wk.weight.step", "o.state.l.0.wv.weight.step"]


def test_param_groups_renamed_away_from_their_state_are_refused(titan_checkpoint, tmp_path):
    src, _, _ = titan_checkpoint
    with pytest.raises(CheckpointError, match=r"optimizer state of parameter '[\w.]+' maps to "
                                              r"'opt.state.[\w.]+'.*not under 'optim.state.'"):
        hdcp.import_dcp(src, str(tmp_path / "out"), exclude=["lr_scheduler.", "dataloader.", "train_state."],
                        rename=[("optimizer.param_groups", "optim.param_groups"), ("optimizer.", "opt.")])


# ----------------------------------------------------------------------------- torchtitan itself


class _TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def state_dict(self):
        return {"step": 2, "ntokens_seen": 4096}

    def load_state_dict(self, state):
        pass


def test_torchtitan_checkpoint_manager_checkpoint_imports_into_our_llama(tmp_path):
    """torchtitan's own CheckpointManager (one process, its debugmodel: 16 heads, no GQA)."""
    pytest.importorskip("torchtitan.components.checkpointer.dcp", reason="torchtitan is not installed")
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    torch.manual_seed(SEED)
    titan = config.build()
    with torch.no_grad():
        for param in titan.parameters():
            param.normal_(0, 0.02)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[titan])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0).build(
        dataloader=None, model_parts=[titan], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": _TrainState()}, sd_adapter=None, base_folder=str(tmp_path))
    for _ in range(2):
        for param in titan.parameters():
            param.grad = torch.randn_like(param)
        optimizers.step()
        schedulers.step()
    assert manager.save(curr_step=2)
    manager.close()

    attention = config.layers[0].attention
    n_heads, n_kv_heads = attention.n_heads, attention.n_kv_heads or attention.n_heads
    mapping = [a.replace(f":{N_HEADS}:{N_KV_HEADS}", f":{n_heads}:{n_kv_heads}") for a in TITAN_MAPPING]
    dst = str(tmp_path / "ours")
    assert main(["import-dcp", str(tmp_path / "checkpoint" / "step-2"), dst, *TITAN_STATES, "--exclude", "dataloader",
                 *mapping]) == 0

    model_sd = titan.state_dict()  # torchtitan's own split of wqkv (its state_dict hook)
    ours = make_llama(vocab_size=config.vocab_size, dim=config.dim, n_layers=len(config.layers), n_heads=n_heads,
                      n_kv_heads=n_kv_heads, ffn_hidden_dim=model_sd["layers.0.feed_forward.w1.weight"].shape[0])
    optim = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    hdcp.load({"model": hdcp.ModelState(ours), "optim": hdcp.OptimizerState(ours, optim)}, checkpoint_id=dst,
              no_dist=True)
    ours_name = lambda fqn: fqn.replace("qkv_linear.", "").replace("lm_head", "output")  # noqa: E731
    assert {ours_name(k) for k in model_sd} == set(ours.state_dict())
    for key, value in model_sd.items():
        assert torch.equal(ours.state_dict()[ours_name(key)], value), key
    params = dict(ours.named_parameters())
    (titan_optim,) = optimizers.optimizers
    for group in titan_optim.param_groups:
        for fqn, param in zip(group["param_names"], group["params"]):
            state = dict(titan_optim.state[param])
            if "wqkv" in fqn:  # the moments split as torchtitan splits the weight
                module = titan.get_submodule(fqn.rsplit(".", 2)[0])
                parts = {}
                for name, value in state.items():
                    split = {"wqkv.weight": value} if value.dim() else {}
                    FusedQKVLinear._split_qkv_on_save(module, split, "", None)
                    for part in ("wq", "wk", "wv"):
                        parts.setdefault(part, {})[name] = split.get(f"{part}.weight", value)
                moments = [(fqn.replace("wqkv", part), values) for part, values in parts.items()]
            else:
                moments = [(fqn, state)]
            for name, values in moments:
                loaded = optim.state[params[ours_name(name)]]
                for key, value in values.items():
                    assert torch.equal(loaded[key], value), f"{name}.{key}"
    assert optim.param_groups[0]["lr"] == titan_optim.param_groups[0]["lr"] != 1e-3
    assert optim.param_groups[0]["betas"] == (0.9, 0.95)


def test_param_groups_holding_tensors_are_kept_key_by_key_as_ours_are(tmp_path):
    """A tensor hyper-parameter (lr as a tensor): the groups stay flat, as our flatten keeps them."""
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ours")
    groups = [{"lr": torch.tensor(0.01), "betas": (0.9, 0.99), "params": ["w"]}]
    torch_dcp.save({"optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": groups}},
                   checkpoint_id=src, no_dist=True)
    imported = hdcp.import_dcp(src, dst, rename=[("optim.state.w.", "optim.state.v.")])
    assert set(imported.state_dict_metadata) == {"optim.state.v.step", "optim.param_groups.0.lr",
                                                 "optim.param_groups.0.betas", "optim.param_groups.0.params"}
    state = {"optim": {"state": {"v": {"step": torch.zeros(())}},
                       "param_groups": [{"lr": torch.zeros(()), "betas": None, "params": None}]}}
    hdcp.load(state, checkpoint_id=dst, no_dist=True)
    assert state["optim"]["param_groups"] == [{"lr": torch.tensor(0.01), "betas": (0.9, 0.99), "params": ["v"]}]
    assert state["optim"]["state"]["v"]["step"] == 3.0
    torch_dcp.save({"opt": {"param_groups.0.lr": 0.1}}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"cannot regroup 'opt.param_groups.0.lr'"):
        hdcp.import_dcp(str(tmp_path / "bad"), str(tmp_path / "bad-out"))
