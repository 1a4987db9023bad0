"""Mesh from config, and the model: built on meta, sharded per block and at the root, then
materialised and initialised shard by shard."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from hyper_parallel.checkpoint import CheckpointError
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy, fully_shard
from hyper_parallel.parallel.expert import expert_meshes
from hyper_parallel.models import hf_causal_lm, hf_llama, hf_moe, hf_weights
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.llama import LlamaConfig, Transformer
from hyper_parallel.models.moe import MoEConfig, MoETransformer
from hyper_parallel.models.moe_layer import RoutingReplay, replaying_routing
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.model import ModelConfig, model_config
from hyper_parallel.trainer.setup.context_parallel import data_parallel_group, dp_cp_mesh, use_ring_attention
from hyper_parallel.models.float8 import convert_to_float8


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The world's mesh of shape ``dims.mesh_shape``: dims ``("pp", "replicate", "shard",
    "cp", "tp")`` in that order, each present when its degree is above 1 (``"shard"`` always):
    ``("shard",)`` for FSDP, ``("replicate", "shard")`` for HSDP, ``("shard", "tp")`` for FSDP x
    TP, ``("pp", "shard")`` for PP x FSDP, ``("shard", "cp")`` for FSDP x CP."""
    shape = dims.mesh_shape
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh of :func:`build_mesh`'s mesh (what ``fully_shard`` shards
    over): every dim but ``pp`` and ``tp``; with ``cp``, ``shard`` and ``cp`` flattened into
    one (:func:`~hyper_parallel.trainer.setup.context_parallel.dp_cp_mesh`)."""
    if "cp" in mesh.mesh_dim_names:
        return dp_cp_mesh(mesh)
    names = tuple(name for name in mesh.mesh_dim_names if name not in ("pp", "tp"))
    return mesh if names == mesh.mesh_dim_names else mesh[names]


def apply_activation_checkpointing(model: RecipeModel, *, compiled: bool = False) -> None:
    """Recompute each block's activations during backward.

    The block's ``forward`` is wrapped in place (no wrapper module), so parameter names and
    checkpoints are the same with and without it. The wrapper is a plain Python function (not a
    ``functools.partial`` of ``checkpoint``): a compiled block then has a frame for dynamo to
    trace, which captures the checkpointed region in the block's graph. A model that
    :attr:`~hyper_parallel.models.contract.RecipeModel.replays_routing` (a mixture of experts)
    has its routing recorded in the forward and replayed by the recomputation
    (:class:`~hyper_parallel.models.moe_layer.RoutingReplay`), unless the blocks are ``compiled``
    (there it is recomputed).
    """
    replay = model.replays_routing and not compiled
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward) if not replay else _checkpointed_replaying_routing(block.forward)


def _checkpointed(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def checkpointed_forward(*args: Any, **kwargs: Any) -> torch.Tensor:  # transformers' layers take keywords
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpointed_forward


def _checkpointed_replaying_routing(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def checkpointed_forward(*args: Any) -> torch.Tensor:
        replay = RoutingReplay()  # this call's: its recomputation runs the same closure

        def run(*inputs: Any) -> torch.Tensor:
            with replaying_routing(replay):
                out = forward(*inputs)
            replay.replay()
            return out
        return checkpoint(run, *args, use_reentrant=False)
    return checkpointed_forward


def shard_model(model: RecipeModel, mesh: DeviceMesh, *, mixed_precision: str,
                reshard_after_forward: bool) -> RecipeModel:
    """``fully_shard`` every block, then the root (which keeps its parameters for backward), over
    ``mesh`` (a data-parallel mesh: see :func:`dp_mesh`)."""
    mp_policy = _mp_policy(mixed_precision)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _mp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision == "bf16" else MixedPrecisionPolicy())


def shard_experts(model: RecipeModel, data_mesh: DeviceMesh, ep: int, *, mixed_precision: str,
                  reshard_after_forward: bool) -> None:
    """Expert parallelism: the ``dp_shard`` ranks of the data-parallel mesh ``data_mesh`` (1-D
    ``(shard,)``, or 2-D ``(replicate, shard)`` under HSDP; with context parallelism the
    flattened ``dp_shard_cp`` dim in place of ``shard``; see :func:`dp_mesh`) regrouped into
    ``efsdp`` x ``ep`` (:func:`~hyper_parallel.parallel.expert.expert_meshes`); each MoE
    layer's routed experts split over ``ep`` by the model
    (:meth:`~hyper_parallel.models.contract.RecipeModel.apply_expert_parallel`: their tokens
    sent by all-to-all) and ``fully_shard``-ed over ``efsdp`` (HSDP over ``(replicate, efsdp)``
    when ``data_mesh`` has a replicate dim). An expert's gradient sums the tokens of its whole ep
    group, so it is divided by the whole data-parallel size (``replicate x dp_shard`` (``x cp``), the
    dense average), not by the ``replicate x efsdp`` size that ``fully_shard`` would use. Call before
    :func:`shard_model`.

    Raises:
        ValueError: the model has no experts it can split (see ``apply_expert_parallel``).
    """
    ep_mesh, efsdp_mesh = expert_meshes(data_mesh, ep)
    for experts in model.apply_expert_parallel(ep_mesh):
        fully_shard(experts, mesh=efsdp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=_mp_policy(mixed_precision))
        experts.set_gradient_divide_factor(data_mesh.size())


def compile_blocks(model: RecipeModel, backend: str, *, fullgraph: bool = True) -> None:
    """``torch.compile`` each block; fully_shard's hooks run eagerly around it. Call after
    activation checkpointing and before ``fully_shard`` (the torchtitan order).

    ``fullgraph=True``: a block body compiles without graph breaks (an error otherwise).
    ``fullgraph=False``: dynamo compiles the block around its graph breaks: context
    parallelism's ring attention (``torch.compiler.disable`` at
    :func:`~hyper_parallel.parallel.ring_attention.cp_attention`'s ring), a mixture of experts' split
    of the tokens by expert (data-dependent sizes)."""
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)


def compile_block_forwards(model: RecipeModel, backend: str, *, fullgraph: bool = True) -> None:
    """``torch.compile`` each block's ``forward`` function rather than its module call, so that
    activation checkpointing applied afterwards runs around the compiled code (used with tensor
    parallelism: torch's AOT autograd cannot compile a checkpointed tensor-parallel block, it
    saves a ``DeviceMesh`` among the region's tensors; and with graph breaks in the block:
    dynamo cannot trace a checkpointed region with a graph break inside, and would leave the
    whole block eager). ``fullgraph``: as :func:`compile_blocks`."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)


def build_transformer(shape: Union[LlamaConfig, MoEConfig]) -> Union[Transformer, MoETransformer]:
    """The model of ``shape`` (a Llama, or a mixture of experts), on the current device."""
    return MoETransformer(shape) if isinstance(shape, MoEConfig) else Transformer(shape)


def build_model(model_cfg: ModelConfig, *, mesh: Optional[DeviceMesh], device: torch.device, seed: int,
                mixed_precision: str = "fp32", reshard_after_forward: bool = True,
                compile_backend: Optional[str] = None, float8_recipe: Optional[str] = None, ep: int = 1,
                meta_model: Optional[RecipeModel] = None) -> nn.Module:
    """Build the configured model without allocating full weights, shard it, initialise it.

    A mixture of experts (``model.moe``) with ``ep > 1`` gets expert parallelism over the
    mesh's ``shard`` dim (``dp_shard x cp`` with a ``cp`` dim) first (:func:`shard_experts`);
    its MoE layers balance each micro-step's tokens over all data-parallel ranks (x CP), the
    global micro-batch (:meth:`~hyper_parallel.models.moe.MoETransformer.set_balance_group`).

    Order (torchtitan's): tensor parallelism over ``mesh["tp"]`` when the mesh has that dim,
    float8 conversion with ``float8_recipe`` (None: none), activation checkpointing, per-block
    ``torch.compile`` with ``compile_backend`` (None: eager), then ``fully_shard`` over the
    data-parallel dims (:func:`dp_mesh`). With tensor or context parallelism, compile and
    checkpointing, the checkpoint wraps the compiled block forward instead
    (:func:`compile_block_forwards`). With context parallelism or a mixture of experts blocks
    compile with ``fullgraph=False`` (the ring exchange, the experts' token split: graph breaks),
    and with checkpointing the checkpoint wraps the compiled block forward as well.

    With ``mesh=None`` the model is not sharded (a plain single-process model, used as the
    reference in tests). ``model.init_from`` loads an HF-style safetensors directory after
    initialisation, each rank reading only its own slices: a ``transformers`` Llama export
    (``config.json`` with ``model_type: llama``) or our own names; for a mixture of experts a
    ``transformers`` Qwen3-MoE directory (:func:`hyper_parallel.models.hf_moe.load_pretrained`).
    A ``config.json`` there must describe this model (heads, sizes, rope_theta, tied
    embeddings; for Qwen3-MoE also the experts).

    ``meta_model``: the model of ``model_cfg`` already built on the meta device (with
    ``model.path``, the one :func:`~hyper_parallel.trainer.config.validate_config` built to check
    the folder: ``ValidConfig.meta_model``), parallelised in place of a new one.

    Raises:
        ConfigError: ``model.init_from`` cannot be read, or it or its ``config.json`` does not
            fit the model.
        ValueError: ``meta_model`` is not on the meta device any more (built already).
    """
    if meta_model is not None:
        if any(not p.is_meta for p in meta_model.parameters()):
            raise ValueError("meta_model holds materialised parameters: it was built already (a ValidConfig "
                             "trains once; validate the config again for another run)")
        model = meta_model
    elif model_cfg.path is not None:
        try:
            model = hf_causal_lm.build_meta(hf_causal_lm.read_config(os.path.expanduser(model_cfg.path)))
        except hf_causal_lm.HFModelError as err:
            raise ConfigError(str(err)) from None
    else:
        with torch.device("meta"):
            model = build_transformer(model_config(model_cfg))
    return parallelize(model, model_cfg, mesh=mesh, device=device, seed=seed, mixed_precision=mixed_precision,
                       reshard_after_forward=reshard_after_forward, compile_backend=compile_backend,
                       float8_recipe=float8_recipe, ep=ep)


def parallelize(model: RecipeModel, model_cfg: ModelConfig, *, mesh: Optional[DeviceMesh], device: torch.device,
                seed: int, mixed_precision: str = "fp32", reshard_after_forward: bool = True,
                compile_backend: Optional[str] = None, float8_recipe: Optional[str] = None,
                ep: int = 1) -> RecipeModel:
    """:func:`build_model`'s steps after the meta model: parallelise, materialise and
    initialise ``model`` (a whole model, or a pipeline stage of one with the same names), through
    what it declares as a :class:`~hyper_parallel.models.contract.RecipeModel`."""
    context_parallel = mesh is not None and "cp" in mesh.mesh_dim_names
    if context_parallel:
        use_ring_attention(model)
    if model.balances_load_over_ranks and mesh is not None:  # balance each global micro-batch
        model.set_balance_group(data_parallel_group(mesh))
    tensor_parallel = mesh is not None and "tp" in mesh.mesh_dim_names
    if tensor_parallel:
        model.apply_tensor_parallel(mesh["tp"])
    if float8_recipe is not None:
        convert_to_float8(model, float8_recipe)
    # Graph breaks: CP's ring exchange, and an MoE's data-dependent split of the tokens by expert.
    fullgraph = model.blocks_compile_fullgraph and not context_parallel
    if (tensor_parallel or not fullgraph) and compile_backend is not None and model_cfg.activation_checkpointing:
        compile_block_forwards(model, compile_backend, fullgraph=fullgraph)  # checkpointing around the compiled code
        apply_activation_checkpointing(model, compiled=True)
    else:
        if model_cfg.activation_checkpointing:
            apply_activation_checkpointing(model, compiled=compile_backend is not None)
        if compile_backend is not None:
            compile_blocks(model, compile_backend, fullgraph=fullgraph)
    if mesh is not None and ep > 1:
        shard_experts(model, dp_mesh(mesh), ep, mixed_precision=mixed_precision,
                      reshard_after_forward=reshard_after_forward)
    if mesh is not None:
        shard_model(model, dp_mesh(mesh), mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward)
    model.to_empty(device=device)
    model.init_from_seed(seed)  # the same values on every mesh and world size
    _load_pretrained(model, model_cfg)
    return model


def _load_pretrained(model: nn.Module, model_cfg: ModelConfig) -> None:
    """The weights the config names, each rank reading its own slices: ``model.path``'s
    safetensors if that ``transformers`` folder holds any, else ``model.init_from`` (a
    ``transformers`` Qwen3-MoE folder with ``model.moe``, else a Llama export or our names)."""
    if model_cfg.path is not None:
        path = os.path.expanduser(model_cfg.path)
        if hf_weights.has_weights(path):
            _loading(f"model.path={path}", lambda: hf_weights.load_weights(model, path))
    elif model_cfg.init_from:
        family, shape = (hf_llama if model_cfg.moe is None else hf_moe), model_config(model_cfg)
        _loading(f"model.init_from={model_cfg.init_from}",
                 lambda: family.load_pretrained(model, os.path.expanduser(model_cfg.init_from), shape))


def _loading(key: str, load: Callable[[], Any]) -> None:
    """``load()``, its refusal of the files as a ConfigError naming the config ``key``."""
    try:
        load()
    except (CheckpointError, KeyError, ValueError, OSError) as err:
        raise ConfigError(f"{key}: {err}") from None
