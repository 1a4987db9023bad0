"""A ``transformers`` model folder's safetensors and the model of ``model=hf``
(:mod:`hyper_parallel.models.hf_causal_lm`): the names to fill (a tied tensor once), the stored
tensors each is read from (experts ``transformers`` fuses into 3-D tensors from the per-expert
tensors its folders hold, as its checkpoint conversion mapping says), the check of names and
shapes from the headers, and the load, each rank reading only its own slices."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping

import torch
from torch import nn


def state_names(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, a tied tensor under its first name
    only (the name a ``transformers`` save keeps)."""
    from hyper_parallel.checkpoint import get_model_state_dict

    # The model's own tensors, in the state dict's order: the exported ones are detached views,
    # new objects, so ties are told by these.
    own = list(model.state_dict(keep_vars=True).values())
    exported = get_model_state_dict(model)
    assert len(own) == len(exported), (len(own), len(exported))
    seen, names = set(), {}
    for (name, tensor), original in zip(exported.items(), own):
        if id(original) not in seen:
            seen.add(id(original))
            names[name] = tensor
    return names


def weight_problems(path: str, model: nn.Module) -> List[str]:
    """The safetensors of ``path`` against ``model`` (meta is fine): missing names, shapes
    (reads the headers only; per-expert tensors as the fused ones they make, see
    :func:`stored_names`). Empty when ``path`` holds no weights or they fit.

    Raises:
        CheckpointError: an unreadable index or header.
    """
    from hyper_parallel.core.distributed_checkpoint.hf import hf_metadata
    from hyper_parallel.models.hf_moe import stacked_metadata

    if not has_weights(path):
        return []
    stored = hf_metadata(path).state_dict_metadata
    wanted = state_names(model)
    sources = stored_names(model, stored)
    missing = [name for name, keys in sources.items()
               if any(key not in stored for key in ([keys] if isinstance(keys, str) else _flat(keys)))]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return [f"model.path={path}: the weights lack {', '.join(missing[:3])}{more} of {type(model).__name__}"]
    try:
        sizes = {name: tuple(md.size) for name, md in stacked_metadata(path, sources).state_dict_metadata.items()}
    except ValueError as err:
        return [f"model.path={path}: {err}"]
    shapes = [f"{name} {sizes[name]} (config.json: {tuple(t.shape)})"
              for name, t in wanted.items() if tuple(t.shape) != sizes[name]]
    if shapes:
        return [f"model.path={path}: weights do not match config.json: {'; '.join(shapes[:3])}"]
    return []


def _flat(keys: List[Any]) -> List[str]:
    return [key for item in keys for key in ([item] if isinstance(item, str) else item)]


def _fused_experts(config: Any) -> Dict[str, List[str]]:
    """``transformers``' fused expert tensors of ``config``'s model and the per-expert tensors
    each is made of on disk, from its checkpoint conversion mapping: ``{"mlp.experts.gate_up_proj":
    ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], ...}`` (stacked over the
    experts, then concatenated). Only converters that stack (and concatenate on dim 1) count."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    fused = {}
    for convert in get_checkpoint_conversion_mapping(config.model_type) or []:
        if not isinstance(convert, WeightConverter) or len(convert.target_patterns) != 1:
            continue
        ops = convert.operations
        stacks = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        joins = len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
        if stacks and joins and all(p.count("*") == 1 for p in convert.source_patterns):
            fused[convert.target_patterns[0]] = list(convert.source_patterns)
    return fused


def stored_names(model: nn.Module, stored: Mapping[str, Any]) -> Dict[str, Any]:
    """Each of ``model``'s tensor names -> the name it has in ``stored`` (a folder's tensors), or,
    for a fused expert tensor the folder holds per expert (``transformers`` saves them so), the
    list over the experts of the per-expert names that make it (for
    :func:`~hyper_parallel.models.hf_moe.stacked_metadata`)."""
    fused = _fused_experts(model.config)
    names = {}
    for name, tensor in state_names(model).items():
        target = next((t for t in fused if name.endswith("." + t)), None)
        if name in stored or target is None:
            names[name] = name
            continue
        prefix = name[:-len(target)]
        names[name] = [[prefix + source.replace("*", str(expert)) for source in fused[target]]
                       for expert in range(tensor.shape[0])]
    return names


def has_weights(path: str) -> bool:
    """Whether ``path`` holds safetensors weights (``model.safetensors`` or an index)."""
    from hyper_parallel.core.distributed_checkpoint.hf import INDEX_FILE, SINGLE_FILE

    return any(os.path.isfile(os.path.join(path, f)) for f in (INDEX_FILE, SINGLE_FILE))


def load_weights(model: nn.Module, path: str) -> None:
    """Fill ``model`` (plain or sharded) from the safetensors of ``path``, each rank reading only
    its own slices (collective under a process group); per-expert tensors fill the fused ones
    they make (:func:`stored_names`).

    Raises:
        KeyError / ValueError / CheckpointError: as :func:`hyper_parallel.checkpoint.load_hf`.
    """
    from hyper_parallel.checkpoint import load_hf
    from hyper_parallel.core.distributed_checkpoint.hf import hf_metadata
    from hyper_parallel.models.hf_moe import stacked_metadata

    targets = state_names(model)
    load_hf(targets, path, metadata=stacked_metadata(path, stored_names(model, hf_metadata(path).state_dict_metadata)))
