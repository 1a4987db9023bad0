"""The models of the recipes, tests and benchmarks: one decoder and its families.

``decoder`` is the decoder (embedding, blocks, final norm, output, rotary tables, seeded
initialisation) built from ``attention``, ``layers`` (RMSNorm, dense SwiGLU) and ``rotary``; a
family chooses each block's feed-forward: ``llama`` (dense SwiGLU) and ``moe`` (a mixture of
experts: ``moe_layer``, ``grouped_experts``). ``llama_parallel`` holds their tensor-parallel plan
and pipeline stage split, ``hf_llama`` / ``hf_moe`` the Hugging Face name maps and configs;
``hf_causal_lm`` builds any transformers causal LM for the recipes (``model=hf``), ``hf_weights``
reads its folder's safetensors, ``hf_sizes`` counts its parameters and FLOPs,
``hf_context_parallel`` / ``hf_expert_parallel`` run its attention as the ring and its experts
over the ep ranks; ``float8`` converts their dense linears to torchao's float8 ones (the output
layer kept high precision);
``contract`` declares what the recipe needs of every one of these models (:class:`RecipeModel`).

May import (beside torch): ``hyper_parallel._torch_compat``, ``core`` (fully_shard, layout, the
checkpoint formats for the HF maps), ``checkpoint``, ``parallel.context`` and
``parallel.ring_attention`` (context parallelism: the attention's context and ring),
``parallel.expert`` (expert parallelism: a model's ``apply_expert_parallel`` shards its experts
and sends their tokens with it),
``chunked_loss``, ``_optional`` (the optional extras) and ``utils``; never ``trainer``, ``data``,
the other parallelisms or the recipes (tests/test_import_cycles.py checks it).
"""

from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.llama import CONFIGS, LlamaConfig, Transformer, TransformerBlock, build_llama
from hyper_parallel.models.moe import MOE_CONFIGS, MoEConfig, MoETransformer, build_moe, param_counts

__all__ = ["CONFIGS", "LlamaConfig", "MOE_CONFIGS", "MoEConfig", "MoETransformer", "RecipeModel", "Transformer",
           "TransformerBlock", "build_llama", "build_moe", "param_counts"]
