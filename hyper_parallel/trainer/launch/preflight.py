"""The pre-start check: the validated config against the machine, the file system, the data
and the installed packages, before any rank starts (what is checked where: ``config/__init__.py``).

Writable output folders and usable files in them (``checkpointing/output_files.py``), an earlier run's
checkpoints where a new run would overwrite them, the data against the config (a token file's
sidecar, the samples available for evaluation, a corpus's files and tokenizer), the optional
packages the settings need, and a lower bound of the memory the job needs against what the
machine has. Every check is cheap and reads no token or text, so ``recipes/train.py --check``
runs them before torchrun starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, NamedTuple, Optional, Union

import torch

from hyper_parallel._optional import MissingDependency, available, install_hint, require
from hyper_parallel.utils.fileio import unusable_folder, url_scheme
from hyper_parallel.checkpoint import startup_bounds, store_for
from hyper_parallel.data import MarkovSource, load_tokenizer
from hyper_parallel.data.text import TEXT_SUFFIXES, expand_paths
from hyper_parallel.data.tokenizer import check_vocab
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.hf_sizes import BlockSizes, block_sizes
from hyper_parallel.models.llama import LlamaConfig
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer.config.compose import ConfigError, problems_message
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.data import SyntheticDataConfig, TextDataConfig, TokensDataConfig
from hyper_parallel.trainer.config.model import model_config
from hyper_parallel.trainer.config.schema import TrainConfig
from hyper_parallel.trainer.step.evaluation import build_sources, check_eval_steps
from hyper_parallel.trainer.checkpointing.output_files import output_file_problems
from hyper_parallel.trainer.setup.parallelize import build_transformer
from hyper_parallel.utils.units import format_bytes

# fp32 parameter + fp32 gradient + AdamW's two fp32 moments.
_STATE_BYTES_PER_PARAM = 16


def check_environment(cfg: TrainConfig, dims: ParallelDims, *, ranks_per_node: int,
                      meta_model: Optional[RecipeModel] = None) -> None:
    """Run every pre-start check on a validated config (``meta_model``: ``ValidConfig.meta_model``,
    the ``transformers`` model of ``model=hf`` whose size the memory check counts).

    Creates ``output_dir`` and ``checkpoint.folder`` if missing (the job would create them).

    Raises:
        ConfigError: listing every problem found.
    """
    # An object store's requests are bounded here: one that never answers is one line, not a hang.
    with startup_bounds():
        checkpoint = checkpoint_folder_problems(cfg)
        folders = output_dir_problems(cfg) + checkpoint
        resume = [] if checkpoint else resume_problems(cfg)  # (an unusable folder is not listed)
    folders += snapshot_folder_problems(cfg)
    problems = (folders + (output_file_problems(cfg) if not folders else []) + init_from_problems(cfg)
                + load_from_problems(cfg)
                + resume + data_problems(cfg) + package_problems(cfg)
                + memory_problems(cfg, dims, ranks_per_node, meta_model))
    if problems:
        raise ConfigError(problems_message("cannot start", problems))


def output_dir_problems(cfg: TrainConfig) -> List[str]:
    """``output_dir`` is a local or mounted folder that can be created and written."""
    try:
        if url_scheme(cfg.output_dir):  # it would become a local folder named "s3:"
            return [f"output_dir: {cfg.output_dir!r} is a URL; output_dir must be a local or mounted folder"]
    except ValueError as err:  # a form that is neither a path nor a URL
        return [f"output_dir: {err}"]
    why = unusable_folder(cfg.output_dir)
    return [f"output_dir={cfg.output_dir} cannot be used: {why}; choose another output_dir"] if why else []


def snapshot_folder_problems(cfg: TrainConfig) -> List[str]:
    """With in-memory snapshots on, ``checkpoint.memory_dir`` can be created and written."""
    c = cfg.checkpoint
    why = unusable_folder(c.memory_dir) if c.memory_interval else None
    return [f"checkpoint.memory_dir={c.memory_dir} cannot be used: {why}; choose another folder "
            "(a tmpfs such as /dev/shm)"] if why else []


def checkpoint_folder_problems(cfg: TrainConfig) -> List[str]:
    """``checkpoint.folder`` can be created and written, as its store says (an object store:
    an object written there, then deleted, within :func:`startup_bounds`: an endpoint that
    never answers is one line)."""
    key = "checkpoint.folder"
    try:
        why = store_for(cfg.checkpoint.folder).write_problem(key)
    except ValueError as err:  # credentials, a query, a chained URL, no fsspec implementation: one line
        why = f"{key}: {err}"
    return [why] if why else []


def load_from_problems(cfg: TrainConfig) -> List[str]:
    """``checkpoint.load_from``, when set, is a path or a URL of a form the stores accept (no
    credentials, query, chained file systems or surrounding whitespace: :func:`url_scheme`)."""
    source = cfg.checkpoint.load_from
    if not source:
        return []
    try:
        url_scheme(str(source))
    except ValueError as err:
        return [f"checkpoint.load_from: {err}"]
    return []


def init_from_problems(cfg: TrainConfig) -> List[str]:
    """``model.init_from``, when set, is a folder (an HF-style safetensors directory)."""
    path = cfg.model.init_from
    return [] if path is None or os.path.isdir(path) else [f"model.init_from={path} is not a folder"]


def data_problems(cfg: TrainConfig) -> List[str]:
    """The data against the config, without reading tokens or text.

    ``data=tokens``: the files' sidecars against ``data.dtype``, ``model.vocab_size`` and
    ``data.tokenizer``, the file sizes against the sidecars, and the samples the validation
    split holds against ``eval.steps``. ``data=text``: the files exist and the tokenizer loads
    and fits ``model.vocab_size`` (token counts are known only once tokenized, at start-up).
    With ``training.document_mask``: each document ends with one token. Synthetic data reads no file.
    """
    d, t, evaluating = cfg.data, cfg.training, cfg.eval.every > 0
    try:
        if isinstance(d, TokensDataConfig):
            sources = build_sources(d, seq_len=t.seq_len, seed=t.seed, vocab_size=cfg.model.vocab_size,
                                    with_val=evaluating)
            if sources.val is not None:
                check_eval_steps(sources.val, t.global_batch_size, cfg.eval.steps)
            ends_documents = sources.train.eos_id is not None
        elif isinstance(d, TextDataConfig):
            paths = ([d.paths] if isinstance(d.paths, str) else list(d.paths)) + ([d.val_path] if d.val_path else [])
            files = expand_paths(paths, TEXT_SUFFIXES)
            if any(f.endswith(".parquet") for f in files):
                require("pyarrow.parquet", "reading .parquet files")
            tokenizer = load_tokenizer(d.tokenizer, d.eos_token)
            check_vocab(tokenizer, cfg.model.vocab_size)
            ends_documents = len(tokenizer.separator) == 1
    except (ValueError, FileNotFoundError, MissingDependency) as err:
        return [f"data={d.kind}: {err}"]
    if t.document_mask and isinstance(d, (TokensDataConfig, TextDataConfig)) and not ends_documents:
        return [f"training.document_mask=true needs documents that each end with one token: data={d.kind} has none "
                "(the bytes tokenizer joins documents with two; a token file's sidecar needs its eos_id, which "
                "scripts/prepare_data.py writes)"]
    return []


def package_problems(cfg: TrainConfig) -> List[str]:
    """The optional packages the settings need are installed (each missing one a line naming
    its extra)."""
    asked = {"training.float8": ("torchao", cfg.training.float8),
             "logging.tensorboard": ("tensorboard", cfg.logging.tensorboard),
             "logging.wandb": ("wandb", cfg.logging.wandb)}
    return [f"{install_hint(package, f'{key}=true')}, or set {key}=false"
            for key, (package, on) in asked.items() if on and not available(package)]


def resume_problems(cfg: TrainConfig) -> List[str]:
    """``checkpoint.resume=false`` must not write into a folder holding another run's checkpoints."""
    folder = cfg.checkpoint.folder
    if cfg.checkpoint.resume:
        return []
    try:
        steps = store_for(folder).committed_steps()
    except ValueError:  # a URL of an unknown scheme: checkpoint_folder_problems names it
        return []
    if not steps:
        return []
    return [f"checkpoint.resume=false, but checkpoint.folder={folder} holds checkpoints of an earlier run "
            f"(step-{', step-'.join(map(str, steps))}); a new run there would overwrite them and its "
            "retention would delete them. Use a new output_dir (or checkpoint.folder), delete the "
            "old checkpoints, or resume (checkpoint.resume=true)"]


class MemoryEstimate(NamedTuple):
    """A lower bound of the bytes one rank needs, by part (activations beyond the logits not counted)."""

    parameters: int       # parameter count of the whole model
    model_state: int      # this rank's shard of parameters, gradients and AdamW moments (fp32)
    gathered: int         # the largest FSDP group unsharded at once (the root: embeddings, head; one of them with PP)
    logits: int           # one (pipeline) micro-batch's fp32 logits and their gradient
    rope: int             # the RoPE cos/sin tables (max_seq_len x head_dim)
    data: int             # the data source's tables, in host memory

    @property
    def device_bytes(self) -> int:
        return self.model_state + self.gathered + self.logits + self.rope


def _sizes(llama: Union[LlamaConfig, MoEConfig]) -> BlockSizes:
    """The parameter counts of the project's model of ``llama``, from one block of each kind on the
    meta device (an MoE model's dense first blocks count as dense)."""
    kinds = [(llama.n_layers, {})]
    if isinstance(llama, MoEConfig):
        dense = min(llama.first_k_dense, llama.n_layers)
        kinds = [(llama.n_layers - dense, {"first_k_dense": 0}), (dense, {"first_k_dense": 1})]
    root, blocks = 0, []
    for count, overrides in kinds:
        if count:
            with torch.device("meta"):
                one_block = build_transformer(dataclasses.replace(llama, n_layers=1, **overrides))
            size = sum(p.numel() for p in one_block.layers["0"].parameters())
            root = sum(p.numel() for p in one_block.parameters()) - size
            blocks.append((count, size))
    return BlockSizes(root + sum(count * size for count, size in blocks), root, max(size for _, size in blocks))


def estimate_memory(cfg: TrainConfig, dims: ParallelDims, meta_model: Optional[RecipeModel] = None) -> MemoryEstimate:
    """A lower bound of one rank's memory for this config, from shapes alone (nothing allocated).
    ``meta_model``: with ``model=hf``, the model validation built on the meta device, whose own
    parameters are counted (else the project's model of the ``model`` keys)."""
    llama = model_config(cfg.model)  # a LlamaConfig or an MoEConfig: the fields read here are in both
    parameters, root, block = block_sizes(meta_model) if meta_model is not None else _sizes(llama)
    param_bytes = 2 if cfg.parallel.mixed_precision == "bf16" else 4
    t = cfg.training
    micro_batch = t.global_batch_size // (dims.dp_size * t.grad_accum_steps)
    if dims.pp > 1:  # a stage holds the embedding or the output (untied), and one pipeline micro-batch's logits
        root, micro_batch = root // 2, max(1, micro_batch // cfg.parallel.microbatches)
    data = (MarkovSource.memory_bytes(llama.vocab_size, cfg.data.branching)
            if isinstance(cfg.data, SyntheticDataConfig) else 0)
    return MemoryEstimate(
        parameters=parameters,
        model_state=_STATE_BYTES_PER_PARAM * parameters // (dims.shard * dims.tp * dims.pp),  # the stages at best even
        gathered=param_bytes * max(root, block) // dims.tp,
        logits=2 * 4 * micro_batch * t.seq_len * llama.vocab_size // dims.tp,  # vocab-parallel
        rope=4 * llama.max_seq_len * llama.head_dim,
        data=data,
    )


def available_memory() -> tuple[Optional[int], Optional[int]]:
    """(bytes of host memory available now, bytes of this rank's accelerator or None on CPU)."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        host = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    platform = get_platform()
    if not platform.is_accelerator:
        return host, None
    accelerators = platform.device_module  # this rank's own device: no context on another rank's
    return host, accelerators.get_device_properties(platform.local_rank % accelerators.device_count()).total_memory


def memory_problems(cfg: TrainConfig, dims: ParallelDims, ranks_per_node: int,
                    meta_model: Optional[RecipeModel] = None) -> List[str]:
    """The estimate (:func:`estimate_memory`) against the machine: every rank of this node on the
    host (CPU training), or one rank per accelerator."""
    est = estimate_memory(cfg, dims, meta_model)
    host, device = available_memory()
    on_accelerator = device is not None and cfg.training.device == "auto"
    fb = format_bytes
    parts = (f"{est.parameters:,} parameters: model state {fb(est.model_state)}, gathered root "
             f"{fb(est.gathered)}, logits {fb(est.logits)}, RoPE tables {fb(est.rope)}"
             + (f", synthetic chain {fb(est.data)}" if est.data else ""))
    need_host = ranks_per_node * (est.data + (0 if on_accelerator else est.device_bytes))
    fix = ("; make the model, the micro-batch (training.global_batch_size / ranks / "
           "training.grad_accum_steps) or model.max_seq_len smaller, or shard over more ranks")
    problems = []
    if on_accelerator and est.device_bytes > device:
        problems.append(f"the job needs at least {fb(est.device_bytes)} per accelerator ({parts}) "
                        f"but one has {fb(device)}{fix}")
    if host is not None and need_host > host:
        problems.append(f"the job needs at least {fb(need_host)} of host memory for {ranks_per_node} "
                        f"rank(s) on this machine ({parts}) but {fb(host)} is available{fix}")
    return problems

