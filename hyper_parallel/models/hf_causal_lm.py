"""Any ``transformers`` causal LM as the recipe's model (``model=hf model.path=DIR``).

The model is the one ``transformers`` builds from ``DIR/config.json``
(``AutoModelForCausalLM.from_config``, its own modeling code), on the meta device, as an instance
of a subclass of its class that adds :class:`CausalLMLogits`: called with token ids it returns
the logits, as the project's models do, and its decoder layers are :attr:`CausalLMLogits.layers`
(what the recipe checkpoints, compiles and shards one by one). Parameter names are
``transformers``' own, so checkpoints hold them and an export is a ``from_pretrained`` folder.

After sharding, :func:`init_weights` runs the model's own ``_init_weights`` one module at a time
on full tensors seeded by ``(seed, module name)`` (each rank keeps its part: the same values on
every mesh), and :func:`~hyper_parallel.models.hf_weights.load_weights` fills the parameters from
``DIR``'s safetensors, each rank reading only its own slices (a tied tensor once, experts
``transformers`` fuses into 3-D tensors from the per-expert tensors a folder holds).
:func:`apply_tensor_parallel` shards the decoder layers as the model's own ``base_model_tp_plan``
says; :mod:`~hyper_parallel.models.hf_expert_parallel` splits a mixture of experts' experts over
the ``ep`` ranks. The recipe reaches them through the model's
:class:`~hyper_parallel.models.contract.RecipeModel` methods.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_parallel._torch_compat import module_buffers, module_parameters
from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.core.layout import local_part
from hyper_parallel.models import hf_context_parallel, hf_expert_parallel
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.decoder import name_seed
from hyper_parallel.models.moe_layer import attach_aux_loss, checked_aux_loss_scale
from hyper_parallel.models.hf_llama import CONFIG_FILE

# The transformers versions the tests ran on (pyproject.toml's "hf" extra says the same).
TESTED_TRANSFORMERS = ("5.23", "6.0")  # [lower, upper)
ATTENTION = "sdpa"


class HFModelError(ValueError):
    """``model.path`` cannot be trained: the message names the folder and the problem."""


def _version_tuple(version: str) -> Tuple[int, ...]:
    """``"5.24.0.dev0"`` -> ``(5, 24, 0)``: the leading numbers."""
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", version).group())[:3])


def transformers_problem(version: str) -> List[str]:
    """A line when the transformers ``version`` is outside :data:`TESTED_TRANSFORMERS` (else empty)."""
    low, high = TESTED_TRANSFORMERS
    if _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        return []
    return [f"model=hf is tested with transformers >={low},<{high}; this environment has {version}: "
            f"pip install 'hyper_parallel[hf]'"]


def _transformers() -> Any:
    from hyper_parallel._optional import require

    return require("transformers", "model=hf")


class CausalLMLogits(RecipeModel):
    """What the recipe needs of a ``transformers`` causal LM (:class:`RecipeModel`), mixed into
    its class (first base): ``model(input_ids)`` is the logits ``(batch, seq, vocab)``, ``layers``
    the decoder layers, the tensor-parallel plan the model's own (:func:`apply_tensor_parallel`),
    the seeded initialisation the model's own ``_init_weights`` (:func:`init_weights`)."""

    _aux_loss_scale = 1.0

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                loss: Optional[ChunkedLoss] = None) -> torch.Tensor:
        """The logits; with ``loss``, the summed token loss of its targets instead, the logits made
        ``loss.chunks`` pieces of the sequence at a time (:class:`ChunkedLoss`: the base model
        runs once, the model's own forward after it, :meth:`_logits_of`, on each piece). With
        ``output_router_logits`` in the config the result carries the model's own load-balancing
        loss (``router_aux_loss_coef x aux_loss``, over this forward's tokens, what ``transformers``
        adds to its loss) into the backward (:meth:`set_aux_loss_scale`). Under context
        parallelism the rotary positions are the tokens' global ones."""
        positions = hf_context_parallel.position_ids(self, input_ids)
        text = self.config.get_text_config()  # type: ignore[attr-defined]
        routed = records_router_logits(self.config)  # type: ignore[attr-defined]
        router = {"output_router_logits": True} if routed else {}
        if loss is None:
            out = super().forward(input_ids=input_ids, position_ids=positions,  # type: ignore[misc]
                                  use_cache=False, **router)
            result = out.logits
        else:
            base = self.base_model(input_ids=input_ids, position_ids=positions,  # type: ignore[attr-defined]
                                   use_cache=False, **router)
            result = loss(base.last_hidden_state, lambda hidden: self._logits_of(base, hidden).logits)
            # The model's own balancing loss of the base model's router logits (no token's logits).
            out = self._logits_of(base, base.last_hidden_state[:, :0], aux_loss=True) if routed else None
        if not routed:
            return result
        return attach_aux_loss(result, text.router_aux_loss_coef * self._aux_loss_scale * out.aux_loss)

    def _logits_of(self, base: Any, hidden: torch.Tensor, aux_loss: bool = False) -> Any:
        """The output of the model's own forward (``lm_head``, and whatever the architecture does
        to the logits after it, e.g. soft-capping; with ``aux_loss`` the balancing loss) on the
        base model's output ``base`` with ``hidden`` as its last hidden states: for the call the
        base model is replaced by one that returns them (:class:`_BaseOutput`), so that no
        architecture's head is written again here."""
        prefix = self.base_model_prefix  # type: ignore[attr-defined]
        model = getattr(self, prefix)
        setattr(self, prefix, _BaseOutput(type(base)(**{**base, "last_hidden_state": hidden})))
        routed = records_router_logits(self.config)  # type: ignore[attr-defined]
        router = {"output_router_logits": aux_loss} if routed else {}
        try:
            return super().forward(use_cache=False, **router)  # type: ignore[misc]
        finally:
            setattr(self, prefix, model)

    @property
    def blocks_compile_fullgraph(self) -> bool:  # type: ignore[override]
        """False with ``output_router_logits``: ``transformers`` records the router logits by
        forward hooks that read a ``ContextVar``, which dynamo cannot trace (a graph break in each
        layer). Otherwise a decoder layer compiles whole (every tested family, experts included)."""
        return not records_router_logits(self.config)  # type: ignore[attr-defined]

    def set_aux_loss_scale(self, scale: float) -> None:
        """The load-balancing loss's gradients are those of ``scale x`` it (see :meth:`forward`)."""
        self._aux_loss_scale = checked_aux_loss_scale(scale)

    @property
    def architecture(self) -> str:
        """The transformers class name (e.g. ``Qwen3ForCausalLM``), also once ``fully_shard`` wrapped it."""
        return next(c for c in type(self).__mro__ if CausalLMLogits in c.__bases__).__name__

    @property
    def layers(self) -> Dict[str, nn.Module]:
        """The decoder layers by index (``"0"``, ``"1"``, ...), in order."""
        return {str(i): layer for i, layer in enumerate(self.base_model.layers)}  # type: ignore[attr-defined]

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """:func:`apply_tensor_parallel` (the model's ``base_model_tp_plan``)."""
        apply_tensor_parallel(self, tp_mesh)  # type: ignore[arg-type]

    def apply_expert_parallel(self, ep_mesh: DeviceMesh) -> List[nn.Module]:
        """:func:`~hyper_parallel.models.hf_expert_parallel.apply_expert_parallel` (registered as
        a ``transformers`` experts implementation)."""
        return hf_expert_parallel.apply_expert_parallel(self, ep_mesh)  # type: ignore[arg-type]

    def use_ring_attention(self) -> None:
        """:func:`~hyper_parallel.models.hf_context_parallel.use_ring_attention` (the ring
        registered as a ``transformers`` attention implementation)."""
        hf_context_parallel.use_ring_attention(self)  # type: ignore[arg-type]

    def init_from_seed(self, seed: int) -> None:
        """:func:`init_weights` (the model's own ``_init_weights``; transformers' ``init_weights``
        takes no seed)."""
        init_weights(self, seed)  # type: ignore[arg-type]


def records_router_logits(config: Any) -> bool:
    """Whether the model of ``config`` returns its router logits (and load-balancing loss)."""
    return bool(getattr(config.get_text_config(), "output_router_logits", False))


class _BaseOutput(nn.Module):
    """Stands in for a causal LM's base model for one call (:meth:`CausalLMLogits._logits_of`):
    returns ``output`` whatever it is given."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


@lru_cache(maxsize=None)
def _with_logits(cls: type) -> type:
    return type(cls.__name__, (CausalLMLogits, cls), {"__module__": cls.__module__})


def read_config(path: str) -> Any:
    """The ``transformers`` config of ``path/config.json``, after checking that the installed
    transformers has a causal LM for it.

    Raises:
        HFModelError: no ``config.json``, unreadable, not a causal LM, or an architecture the
            installed transformers lacks (one line each).
    """
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise HFModelError(f"model.path={path} has no {CONFIG_FILE} (a transformers model folder has one)")
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HFModelError(f"model.path={path}: {CONFIG_FILE} is not a config this transformers "
                           f"({transformers.__version__}) knows: {line}") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFModelError(f"model.path={path}: model_type {model_type!r} is not a causal language model in "
                           f"transformers {transformers.__version__} (model=hf trains AutoModelForCausalLM models)")
    return config


def model_class(config: Any) -> type:
    """The ``transformers`` causal LM class of ``config`` with :class:`CausalLMLogits` mixed in."""
    transformers = _transformers()
    return _with_logits(transformers.AutoModelForCausalLM._model_mapping[type(config)])


def build_meta(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device, float32, SDPA attention.

    Raises:
        HFModelError: it has no list of decoder layers (``base_model.layers``).
    """
    with torch.device("meta"):
        model = model_class(config)._from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    if not isinstance(getattr(model.base_model, "layers", None), nn.ModuleList):
        raise HFModelError(f"{type(model).__name__} has no list of decoder layers (base_model.layers) to "
                           "shard one by one")
    return model


# transformers' tensor-parallel styles (``base_model_tp_plan``) that map to torch's, and the prefix
# of the entries that plan each decoder layer. ``replicated_with_grad_allreduce`` (Qwen3's and
# Gemma 3's per-head q/k norms) is no torch style: :func:`_replicate_head_norm`.
TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
HEAD_NORM_STYLE = "replicated_with_grad_allreduce"
_LAYER_ENTRY = "layers.*."


def tensor_parallel_problems(config: Any, architecture: str) -> List[str]:
    """Why ``config``'s model cannot run ``parallel.tp`` from its ``base_model_tp_plan``: no plan,
    an entry outside the decoder layers, or a style without a torch equivalent here (empty: it can)."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    if not plan:
        return [f"parallel.tp: {architecture} has no tensor-parallel plan (base_model_tp_plan); use FSDP/HSDP"]
    odd = [f"{name}: {style}" for name, style in plan.items()
           if not name.startswith(_LAYER_ENTRY) or style not in (*TP_STYLES, HEAD_NORM_STYLE)]
    if odd:
        return [f"parallel.tp: {architecture}'s tensor-parallel plan has entries without a torch style here "
                f"({', '.join(odd[:3])}; supported: decoder-layer {' / '.join((*TP_STYLES, HEAD_NORM_STYLE))}); "
                "use FSDP/HSDP"]
    return []


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard each decoder layer of ``model`` over the 1-D ``tp_mesh`` as its config's
    ``base_model_tp_plan`` says (``colwise`` -> ``ColwiseParallel``, ``rowwise`` ->
    ``RowwiseParallel``: attention on this rank's heads, the MLP on its columns;
    ``replicated_with_grad_allreduce``: :func:`_replicate_head_norm`). Every other
    parameter (embeddings, norms, the output layer) becomes a replicated DTensor over ``tp_mesh``
    (its module takes and returns plain tensors), so a checkpoint stores it once and the gradient
    norm counts it once. On the meta device too.

    Raises:
        ValueError: as :func:`tensor_parallel_problems`.
    """
    problems = tensor_parallel_problems(model.config, model.architecture)
    if problems:
        raise ValueError(problems[0])
    config = model.config.get_text_config()
    plan = {name[len(_LAYER_ENTRY):]: style for name, style in config.base_model_tp_plan.items()}
    layer_plan = {name: TP_STYLES[style]() for name, style in plan.items() if style in TP_STYLES}
    head_norms = [name for name, style in plan.items() if style == HEAD_NORM_STYLE]
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, layer_plan)
        for name in head_norms:
            _replicate_head_norm(layer.get_submodule(name), tp_mesh, getattr(config, "head_dim", None), name)
    for module in model.modules():
        if any(p is not None and not isinstance(p, DTensor) for p in module_parameters(module).values()):
            distribute_module(module, tp_mesh, _replicate_parameters, _replicated_inputs, _local_outputs)


def _replicate_head_norm(norm: nn.Module, tp_mesh: DeviceMesh, head_dim: Any, name: str) -> None:
    """``replicated_with_grad_allreduce``: a per-head norm (its weight one head's size) applied to
    this rank's heads, ``(..., heads, head_dim)`` after a ``colwise`` projection. Its weight is a
    replicated DTensor and its input the rank's heads as a DTensor sharded on the heads dim, so
    autograd sums the weight's gradient over the tp ranks (each holds its heads' share).

    Raises:
        ValueError: the module's parameters are not one weight of the config's ``head_dim``.
    """
    params = module_parameters(norm)
    if head_dim is None or [tuple(p.shape) for p in params.values() if p is not None] != [(head_dim,)]:
        raise ValueError(f"parallel.tp: the plan's {HEAD_NORM_STYLE} entry {name} is not a per-head norm "
                         f"(one weight of head_dim={head_dim}); use FSDP/HSDP")
    distribute_module(norm, tp_mesh, _replicate_parameters, _head_sharded_inputs, _local_outputs)


def _head_sharded_inputs(module: nn.Module, inputs: Tuple[Any, ...], mesh: DeviceMesh) -> Tuple[Any, ...]:
    return _dtensor_inputs(inputs, mesh, lambda x: Shard(x.ndim - 2))


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    params = module_parameters(module)
    for key, param in list(params.items()):
        if param is not None and not isinstance(param, DTensor):
            params[key] = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                   requires_grad=param.requires_grad)


def _replicated_inputs(module: nn.Module, inputs: Tuple[Any, ...], mesh: DeviceMesh) -> Tuple[Any, ...]:
    return _dtensor_inputs(inputs, mesh, lambda x: Replicate())


def _dtensor_inputs(inputs: Tuple[Any, ...], mesh: DeviceMesh,
                    placement: Callable[[torch.Tensor], Placement]) -> Tuple[Any, ...]:
    """Each plain tensor of ``inputs`` as this rank's part of a DTensor placed by ``placement(x)``."""
    return tuple(DTensor.from_local(x, mesh, [placement(x)], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _owners(model: nn.Module) -> Mapping[str, nn.Module]:
    from transformers import PreTrainedModel

    return {name: m for name, m in model.named_modules() if isinstance(m, PreTrainedModel)}


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise every parameter and buffer as the model's own ``_init_weights`` does (the one
    of the nearest enclosing ``PreTrainedModel``), one module at a time on full CPU tensors drawn
    from a generator seeded by ``(seed, module name)``; each rank keeps its part of a sharded one.
    Re-ties tied weights (``to_empty`` unties them)."""
    owners = _owners(model)
    for name, module in model.named_modules():
        slots = [(store, key, t) for store in (module_parameters(module), module_buffers(module))
                 for key, t in store.items() if t is not None]
        if not slots:
            continue
        owner = owners[max((o for o in owners if o == "" or name == o or name.startswith(o + ".")), key=len)]
        full = {}
        for store, key, tensor in slots:
            value = torch.empty(tensor.shape, dtype=tensor.dtype)
            full[key] = nn.Parameter(value, requires_grad=False) if store is module_parameters(module) else value
            store[key] = full[key]
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(name_seed(seed, name))
                owner._init_weights(module)
        finally:
            for store, key, tensor in slots:
                store[key] = tensor
        for store, key, tensor in slots:
            value = full[key].detach()
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(local_part(value, tensor))
            else:
                tensor.copy_(value)
    model.tie_weights()


# The files of a transformers tokenizer (those a folder has are copied with the model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def export_config(path: str, dtype: torch.dtype) -> Dict[str, Any]:
    """``path/config.json`` as a dict, naming ``dtype`` as the weights' dtype.

    Raises:
        ValueError: no readable config.json there, or a dtype config.json cannot name.
    """
    from hyper_parallel.models.hf_llama import hf_dtype_keys, read_config as read_json

    config = read_json(path)
    if config is None:
        raise ValueError(f"{path} (the run's model.path) has no {CONFIG_FILE} any more")
    return {**config, **hf_dtype_keys(dtype)}


def copy_tokenizer_files(path: str, out_dir: str) -> List[str]:
    """Copy the tokenizer files of ``path`` (:data:`TOKENIZER_FILES`) to ``out_dir``; their names."""
    from hyper_parallel.utils.fileio import write_file_atomically

    copied = []
    for name in TOKENIZER_FILES:
        source = os.path.join(path, name)
        if os.path.isfile(source):
            with open(source, "rb") as f:
                write_file_atomically(os.path.join(out_dir, name), f.read())
            copied.append(name)
    return copied
