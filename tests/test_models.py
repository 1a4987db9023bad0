"""The reference Llama model: shapes, tying, and mesh-independent initialisation."""

import torch

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from tests.fully_shard._helpers import shard_layers_and_root
from tests.multirank import run_on_ranks

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=16)


def test_forward_shape_and_tied_embeddings_survive_to_empty():
    with torch.device("meta"):
        model = build_llama("llama_debug", tie_embeddings=True, **TINY)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, 61, (2, 16)))
    assert logits.shape == (2, 16, 61) and torch.isfinite(logits).all()


def _sharded_init_full_params(mesh_shape):
    mesh = hp.init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = build_llama("llama_debug", **TINY)
    shard_layers_and_root(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def test_init_is_the_same_on_every_mesh():
    reference = build_llama("llama_debug", **TINY)
    reference.init_weights(seed=3)
    expected = dict(reference.named_parameters())
    for world, mesh_shape in ((2, (2,)), (4, (4,)), (4, (2, 2))):
        full = run_on_ranks(world, _sharded_init_full_params, mesh_shape)[0]
        assert full.keys() == expected.keys()
        for name, value in full.items():
            assert torch.equal(value, expected[name].detach()), (mesh_shape, name)
