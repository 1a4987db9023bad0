"""Reference models used by the recipes, tests and benchmarks."""

from hyper_parallel.models.llama import CONFIGS, LlamaConfig, Transformer, TransformerBlock, build_llama

__all__ = ["CONFIGS", "LlamaConfig", "Transformer", "TransformerBlock", "build_llama"]
