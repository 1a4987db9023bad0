"""``model=hf`` with ``parallel.cp``: transformers' own Llama, Qwen3 (q/k norms, head_dim set) and Mistral (no window;
tiny configs written here) run the project's ring attention as their attention implementation.
CP2 on 2 ranks (each rank holding its head-tail chunks of every sequence, the rotary embedding on
their global positions; Qwen3 checkpointing activations) and Llama's CP2 x TP2 on 4 ranks train
the one-process losses; what the ring cannot compute is refused in one line by ``--check`` (and
by the attention function on the call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hyper_parallel.models.hf_context_parallel import ring_attention_forward  # noqa: E402
from tests.multirank import run_on_ranks  # noqa: E402
from tests.recipes.launch import assert_losses_match, last_loss_per_step  # noqa: E402
from tests.recipes.test_hf_model import SHAPE, _train, _write_folder  # noqa: E402
from tests.recipes.train_in_process import one_line_error  # noqa: E402

CP_FAMILIES = ("llama", "qwen3", "mistral")
CP2 = ["parallel.cp=2"]
CHECKPOINTING = {"llama": [], "qwen3": ["model.activation_checkpointing=true"], "mistral": []}  # recomputed inside the context


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each family's output folders: CP2 on 2 ranks (Qwen3 checkpointing activations), Llama's CP2 x TP2
    on 4, and one process."""
    root = tmp_path_factory.mktemp("hf-cp")
    paths = {family: _write_folder(root / family, family) for family in CP_FAMILIES}
    out = {family: {kind: str(root / f"{family}-{kind}") for kind in ("cp2", "one")} for family in paths}
    out["llama"]["cp2_tp2"] = str(root / "llama-cp2_tp2")
    run_on_ranks(2, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['cp2']}", *CP2, *CHECKPOINTING[f]]
                             for f in paths], timeout=300)
    run_on_ranks(4, _train, [[f"model.path={paths['llama']}", f"output_dir={out['llama']['cp2_tp2']}", *CP2,
                              "parallel.tp=2", "parallel.dp_shard=1"]], timeout=300)
    run_on_ranks(1, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['one']}"] for f in paths], timeout=300)
    return out


@pytest.mark.parametrize("family", CP_FAMILIES)
def test_cp2_trains_the_one_process_losses(runs, family):
    one, cp2 = (last_loss_per_step(runs[family][kind]) for kind in ("one", "cp2"))
    assert sorted(one) == sorted(cp2) == [1, 2, 3] and one[3] < one[1]
    assert_losses_match(one, cp2, rel=1e-5)  # float32: reduction order only


def test_cp2_x_tp2_trains_the_one_process_losses(runs):
    """The ring exchanges the K/V heads of each tp rank (Llama's own tensor-parallel plan)."""
    assert_losses_match(last_loss_per_step(runs["llama"]["one"]), last_loss_per_step(runs["llama"]["cp2_tp2"]),
                        rel=1e-5)


@pytest.mark.parametrize("case, expected", [
    ("sliding_window", "parallel.cp: ring attention cannot compute MistralForCausalLM's sliding window 8 shorter "
                       "than training.seq_len=16; use FSDP/HSDP"),
    ("conv_layers", "parallel.cp: ring attention cannot compute Lfm2ForCausalLM's layers that are not attention "
                    "(conv); use FSDP/HSDP"),
    ("no_interface", "parallel.cp: JambaForCausalLM's attention does not go through transformers' "
                     "AttentionInterface"),
])
def test_what_the_ring_cannot_compute_is_refused_in_one_line(tmp_path, check, case, expected):
    config = {"sliding_window": lambda: transformers.MistralConfig(**SHAPE, sliding_window=8),
              "conv_layers": lambda: transformers.Lfm2Config(**SHAPE, layer_types=["conv", "full_attention"]),
              "no_interface": lambda: transformers.JambaConfig(**SHAPE)}[case]()
    config.save_pretrained(tmp_path / case)
    one_line_error(*check("model=hf", f"model.path={tmp_path / case}", "training.seq_len=16", *CP2)[::2], expected)


def test_outside_cp_the_attention_is_causal_sdpa_and_what_it_cannot_compute_is_refused():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    module = torch.nn.Module()
    module.is_causal = True
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    for window in (None, 16):  # a window as long as the sequence attends to all of it
        out, weights = ring_attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window)
        assert weights is None and torch.allclose(out, expected, atol=1e-6)
    padding = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    for kwargs, message in ((dict(attention_mask=padding), "takes no attention mask"),
                            (dict(dropout=0.1), "has no dropout"),
                            (dict(sliding_window=8), "its window 8 is shorter than the sequence \\(16 tokens\\)"),
                            (dict(softcap=30.0), "does not compute softcap"),
                            (dict(s_aux=torch.zeros(4)), "does not compute s_aux")):
        with pytest.raises(ValueError, match=message):
            ring_attention_forward(module, q, k, v, **{"attention_mask": None, **kwargs})
