"""The ``model`` group's schema (a Llama-style shape and the recipe's model options) and the model
shape it describes (:func:`model_config`: a ``LlamaConfig``, or an ``MoEConfig`` with
``model.moe``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Callable, ClassVar, Dict, List, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf

from hyper_parallel.models.llama import LlamaConfig, RopeScaling
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.trainer.config.moe import MoEOptions, moe_config, moe_problems
from hyper_parallel.trainer.config.rules import field_rules, key

Ok = Callable[[str], bool]


@dataclass
class ModelConfig:
    """A Llama-style shape (the defaults: ``llama_debug``) and the recipe's model options."""

    name: str = key("llama_debug")
    vocab_size: int = key(256, min=1)
    dim: int = key(64, min=1)
    n_layers: int = key(2, min=1)
    n_heads: int = key(4, min=1)
    n_kv_heads: Optional[int] = key(2, min=1)            # null: n_heads (no grouped-query attention)
    ffn_hidden_dim: Optional[int] = key(None, min=1)     # null: the Llama rule from dim
    max_seq_len: int = key(256, min=1)
    rope_theta: float = key(10000.0, min=0, min_open=True)
    tie_embeddings: bool = key(False)
    # null: plain RoPE. Llama 3.1/3.2's scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (a key left out takes Llama 3.1's value, see RopeScaling).
    rope_scaling: Optional[RopeScaling] = key(None)
    activation_checkpointing: bool = key(False)          # recompute each block's activations in backward
    init_from: Optional[str] = key(None, path=True)      # HF-style safetensors directory to initialise from
    path: Optional[str] = key(None, path=True)           # model=hf: a transformers folder (config.json, weights); its config sets the shape
    moe: Optional[MoEOptions] = key(None)                # null: a Llama; set: a mixture of experts in each block

    # The keys that are recipe options, not LlamaConfig fields.
    RECIPE_KEYS: ClassVar[Tuple[str, ...]] = ("name", "activation_checkpointing", "init_from", "path")

    def problems(self, ok: Ok) -> List[str]:
        if not all(ok(name) for name in field_rules(ModelConfig)):
            return []
        if self.moe is not None:
            return moe_problems(self)
        try:
            llama = llama_config(self)
        except (ValueError, TypeError) as err:
            return [f"model: {err}"]
        return [f"model: dim/n_heads = {llama.head_dim} must be even (RoPE rotates pairs)"] if llama.head_dim % 2 else []


def llama_config(model: ModelConfig) -> LlamaConfig:
    """The ``LlamaConfig`` described by the ``model`` config group.

    Raises:
        ValueError: inconsistent sizes (e.g. ``dim`` not divisible by ``n_heads``), or
            ``model.moe`` is set (use :func:`model_config`).
    """
    values = shape(model)
    if values.pop("moe") is not None:
        raise ValueError("model.moe is set: a mixture of experts has no LlamaConfig (a Llama export or "
                         "Llama-only tool does not cover MoE models yet)")
    return LlamaConfig(**values)


def model_config(model: ModelConfig) -> Union[LlamaConfig, MoEConfig]:
    """The model's shape: an ``MoEConfig`` when ``model.moe`` is set, else a ``LlamaConfig``.

    Raises:
        ValueError: inconsistent sizes.
    """
    return llama_config(model) if model.moe is None else moe_config(model)


def shape(model: ModelConfig) -> Dict[str, object]:
    """The model keys that are ``LlamaConfig`` fields, with their values as plain data (a nested
    key as a dict; a key the (saved) config lacks at the schema's default). ``model`` may also
    be the ``model`` node of a composed or saved config."""
    def plain(value: object) -> object:
        if is_dataclass(value):
            return asdict(value)
        return OmegaConf.to_container(value) if isinstance(value, DictConfig) else value

    return {f.name: plain(getattr(model, f.name, f.default)) for f in fields(ModelConfig)
            if f.name not in ModelConfig.RECIPE_KEYS}
