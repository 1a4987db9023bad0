"""``model=hf model.path=DIR``: the checks of a ``transformers`` folder before any rank starts,
and the model keys the rest of the recipe reads (vocabulary, sizes) taken from its config.json.

The model itself is :mod:`hyper_parallel.models.hf_causal_lm`'s; what the recipe cannot do with
it yet (pipeline parallelism, document masks, ``model.init_from``, ``model.moe``) is refused here
in one line naming the model and what to use instead; tensor parallelism follows the model's own
plan (``base_model_tp_plan``) where its styles map to torch's, context parallelism runs where the
ring attention can replace the model's
(:func:`~hyper_parallel.models.hf_context_parallel.context_parallel_problems`), expert
parallelism where the model's experts are ``transformers``' grouped 3-D ones and ``ep`` divides
them (:func:`~hyper_parallel.models.hf_expert_parallel.expert_parallel_problems`; not with
tensor parallelism), float8 where one of its linears can run it
(:func:`~hyper_parallel.models.float8.float8_linear_problems`); compile and the chunked loss run
as for the project's models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from hyper_parallel.trainer.config.parallel import ParallelDims
    from hyper_parallel.trainer.config.schema import TrainConfig

# ModelConfig key -> the transformers config key it is read from.
SHAPE_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
              "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
              "ffn_hidden_dim": "intermediate_size", "max_seq_len": "max_position_embeddings",
              "tie_embeddings": "tie_word_embeddings"}


def read_model_keys(path: str) -> Tuple[Dict[str, Any], List[str], Optional[Any]]:
    """``(model keys from path's config.json, problems, the model on the meta device)``: the installed
    transformers' version, config.json (present, a causal LM this transformers has), and the
    weights, if any, against the model it describes (names and shapes, from the headers). The
    model is the one the run trains (``ValidConfig.meta_model``): nothing builds it again."""
    from hyper_parallel._optional import available, install_hint

    if not available("transformers"):
        return {}, [install_hint("transformers", "model=hf")], None
    import transformers

    from hyper_parallel.models import hf_causal_lm, hf_weights

    problems = hf_causal_lm.transformers_problem(transformers.__version__)
    if problems:
        return {}, problems, None
    try:
        config = hf_causal_lm.read_config(path)
        model = hf_causal_lm.build_meta(config)
        problems = hf_weights.weight_problems(path, model)
    except (hf_causal_lm.HFModelError, CheckpointError) as err:
        return {}, [str(err)], None
    text = config.get_text_config()
    keys = {key: getattr(text, name, None) for key, name in SHAPE_KEYS.items()}
    keys["n_kv_heads"] = keys["n_kv_heads"] or keys["n_heads"]
    keys["tie_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    return keys, problems, model


def problems(cfg: "TrainConfig", model: Any, set_keys: List[str], dims: Optional["ParallelDims"] = None) -> List[str]:
    """What the recipe cannot do with a ``transformers`` ``model`` (on the meta device), one line
    each; ``set_keys``: model shape keys given although config.json decides them; ``dims``: the
    world's layout (None: not resolved)."""
    from hyper_parallel.models.float8 import float8_linear_problems
    from hyper_parallel.models.hf_causal_lm import records_router_logits, tensor_parallel_problems
    from hyper_parallel.models.hf_context_parallel import context_parallel_problems
    from hyper_parallel.models.hf_expert_parallel import expert_parallel_problems

    p, t, m, architecture = cfg.parallel, cfg.training, cfg.model, model.architecture
    found = [f"model.{key} is read from {m.path}/config.json with model=hf: remove the override" for key in set_keys]
    instead = "use FSDP/HSDP (parallel.dp_shard, parallel.dp_replicate)"
    if p.tp > 1:
        found += tensor_parallel_problems(model.config, architecture)
    if p.cp > 1:
        found += context_parallel_problems(model, t.seq_len)
    text = model.config.get_text_config()
    if records_router_logits(model.config) and not hasattr(text, "router_aux_loss_coef"):
        found.append(f"{m.path}/config.json: output_router_logits=true, but {architecture} has no load-balancing "
                     "loss (no router_aux_loss_coef); set it to false")
    if p.ep > 1:
        experts = expert_parallel_problems(model, p.ep)
        found += experts or p.ep_rank_problems(dims)
        if not experts and p.tp > 1:
            found.append(f"parallel.ep={p.ep} with parallel.tp={p.tp}: model=hf ({architecture}) splits its experts "
                         "over data-parallel ranks only; use one of them")
    if p.pp > 1:
        found.append(f"parallel.pp={p.pp}: model=hf ({architecture}) does not support it yet; {instead}")
    if t.float8:
        found += float8_linear_problems(model, f"in {m.path}/config.json", architecture)
    for on, what, alternative in (
            (t.document_mask, "training.document_mask=true", "train without document masks"),
            (m.init_from is not None, "model.init_from", f"put the weights in {m.path}"),
            (m.moe is not None, "model.moe", "the experts are config.json's")):
        if on:
            found.append(f"{what} with model=hf ({architecture}) is not supported; {alternative}")
    return found
