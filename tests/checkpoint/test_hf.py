"""export_hf from a sharded checkpoint, load_hf into plain and sharded models."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    export_hf,
    load_hf,
    save,
)
from tests.checkpoint.helpers import full_model_state_dict, make_llama, save_fully_sharded_llama, shard_params
from tests.multirank import run_on_ranks

SEED = 11


def _load_hf_sharded(hf_dir):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_params(make_llama(seed=SEED + 1), mesh, lambda n, p: [Shard(p.dim() - 1)])
    load_hf(model, hf_dir)
    full = full_model_state_dict(model)  # a collective: every rank gathers
    return full if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "step-3")
    run_on_ranks(2, save_fully_sharded_llama, path, SEED, timeout=120)
    return path


def test_export_sharded_checkpoint_and_load_plain_model_same_logits(sharded_checkpoint, tmp_path):
    reference = make_llama(seed=SEED)
    max_shard_bytes = 100_000
    index = export_hf(sharded_checkpoint, tmp_path, max_shard_bytes=max_shard_bytes)
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index
    expected = reference.state_dict()
    assert index["weight_map"].keys() == expected.keys()  # model entry only, no "model." prefix
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())

    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    for file in files:
        with safe_open(str(tmp_path / file), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= max_shard_bytes or len(tensors) == 1
        assert all(index["weight_map"][k] == file and torch.equal(t, expected[k]) for k, t in tensors.items())

    model = make_llama(seed=SEED + 1)
    load_hf(model, tmp_path)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


def test_load_hf_into_sharded_model_gives_identical_full_params(sharded_checkpoint, tmp_path):
    export_hf(sharded_checkpoint, tmp_path)
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) == 1
    loaded = run_on_ranks(2, _load_hf_sharded, str(tmp_path), timeout=120)[0]
    expected = make_llama(seed=SEED).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.items())


def test_load_hf_converts_dtype_and_names_bad_keys(sharded_checkpoint, tmp_path):
    export_hf(sharded_checkpoint, tmp_path, max_shard_bytes=50_000)
    expected = make_llama(seed=SEED).state_dict()
    model = make_llama(seed=SEED + 1).to(torch.bfloat16)
    load_hf(model, tmp_path)
    assert all(torch.equal(v, expected[k].to(torch.bfloat16)) for k, v in model.state_dict().items())

    with pytest.raises(KeyError, match=r"extra\.weight"):
        load_hf({"norm.weight": torch.empty(64), "extra.weight": torch.empty(3)}, tmp_path)
    with pytest.raises(ValueError, match=r"norm\.weight: shape mismatch"):
        load_hf({"norm.weight": torch.empty(65)}, tmp_path)
    with pytest.raises(CheckpointError, match="index"):
        load_hf({"norm.weight": torch.empty(64)}, tmp_path / "nowhere")


def test_export_without_model_entry_and_bad_arguments(tmp_path):
    save({"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.ones(2)}, "n": 1},
         checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    index = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert sorted(index["weight_map"]) == ["a", "b.c"]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=0)
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        export_hf(tmp_path / "missing", tmp_path / "hf")
