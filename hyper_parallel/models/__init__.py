"""Reference models used by the recipes, tests and benchmarks."""

from hyper_parallel.models.llama import CONFIGS, LlamaConfig, Transformer, TransformerBlock, build_llama
from hyper_parallel.models.moe import MOE_CONFIGS, MoEConfig, MoETransformer, build_moe, param_counts

__all__ = ["CONFIGS", "LlamaConfig", "MOE_CONFIGS", "MoEConfig", "MoETransformer", "Transformer", "TransformerBlock",
           "build_llama", "build_moe", "param_counts"]
