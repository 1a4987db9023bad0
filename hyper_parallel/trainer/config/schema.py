"""The recipe config's schema: one dataclass per config group (one per ``data`` kind), each key
with its type, default, range and meaning in one place.

The defaults are registered in Hydra's ConfigStore (:func:`register_schemas`); the YAML files
under ``configs/`` extend them (``defaults: [schema, _self_]``) and hold only what a preset
changes. Consumers read the typed :class:`TrainConfig` that validation makes
(``compose.validate_config``). The ``model`` group's schema is in ``model.py``, the ``data``
kinds' in ``data.py``. Adding a key is one line in its class, e.g.
``eval_every: int = key(0, min=0)  # ...``, plus its row in docs/recipes.md; a check between keys
goes in the class's ``problems`` (what is checked where: the package's docstring). A new data
kind is one :class:`DataConfig` subclass in ``data.py``.

Each ``problems(ok)`` lists what is wrong between the class's keys; ``ok(name)`` says whether a
key passed its own type and range check (a check reads only keys that did).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from hydra.core.config_store import ConfigStore

from hyper_parallel.models.llama import LlamaConfig
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.trainer.config.data import DATA_KINDS, SEED_MAX, DataConfig, SyntheticDataConfig
from hyper_parallel.trainer.config.memory import MemorySnapshotKeys
from hyper_parallel.trainer.config.model import ModelConfig, llama_config
from hyper_parallel.trainer.config.moe import moe_config
from hyper_parallel.trainer.config.parallel import ParallelConfig, ParallelDims
from hyper_parallel.trainer.config.rules import defaults, field_rules, key
from hyper_parallel.models.float8 import RECIPES as FLOAT8_RECIPES, float8_layer_problems

# Training-state entries that checkpoint.exclude may name (the model is always loaded).
EXCLUDABLE = ("optim", "lr_schedule", "data", "rng")
# dtypes a model-only last checkpoint may be written in (checkpoint.export_dtype).
EXPORT_DTYPE_NAMES = ("float32", "bfloat16", "float16")
SCHEMA_NAME = "schema"  # each group's ConfigStore entry, extended by its YAML presets
DEFAULT_FLOAT8_RECIPE = "tensorwise"  # training.float8_recipe=null

Ok = Callable[[str], bool]


@dataclass
class TrainingConfig:
    """The ``training`` keys: run length, batch, seed, device, compile and early stops."""

    steps: int = key(200, min=1)                      # optimizer steps in total (a resumed job runs up to this step)
    global_batch_size: int = key(16, min=1)           # samples per optimizer step, over all ranks and accumulation steps
    seq_len: int = key(64, min=1)                     # tokens per sample fed to the model
    seed: int = key(0, min=0, max=SEED_MAX)           # model init and data order
    grad_accum_steps: int = key(1, min=1)             # micro-batches per optimizer step on each rank
    max_grad_norm: float = key(1.0, min=0)            # gradient clipping; 0 disables it
    loss_chunks: int = key(1, min=1)                  # the loss over N pieces of each sequence at a time: logits never whole (1: at once)
    document_mask: bool = key(False)                  # packed documents attend only within themselves (each EOS token ends one)
    device: str = key("auto", choices=("auto", "cpu"))  # auto (the platform's accelerator, else cpu) | cpu
    compile: bool = key(False)                        # torch.compile each block (after activation checkpointing, before fully_shard)
    compile_backend: str = key("inductor")            # torch.compile backend when compile=true (aot_eager: no codegen)
    float8: bool = key(False)                           # torchao float8 linears (hyper_parallel[float8]); the output layer stays high precision
    float8_recipe: Optional[str] = key(None, choices=FLOAT8_RECIPES)  # null: tensorwise (float8 all-gather) | rowwise
    stop_after_steps: Optional[int] = key(None, min=1)  # stop (with a checkpoint) after N steps of this job
    time_limit_minutes: Optional[float] = key(None, min=0, min_open=True)  # stop (with a checkpoint) before N minutes
    peak_tflops: Optional[float] = key(None, min=0, min_open=True)  # per-device peak for MFU (null: the built-in table)

    @property
    def float8_mode(self) -> Optional[str]:
        """The float8 recipe in use: ``float8_recipe`` (by default tensorwise) when ``float8``
        is on, else None."""
        if not self.float8:
            return None
        return self.float8_recipe if self.float8_recipe is not None else DEFAULT_FLOAT8_RECIPE

    def problems(self, ok: Ok) -> List[str]:
        problems = []
        if self.compile is True and ok("compile_backend") and self.compile_backend not in _compile_backends():
            problems.append(f"training.compile_backend={self.compile_backend!r} is not a torch.compile backend; "
                            f"known: {', '.join(_compile_backends())}")
        if self.float8 is False and ok("float8_recipe") and self.float8_recipe is not None:
            problems.append(f"training.float8_recipe={self.float8_recipe} needs training.float8=true (it has no "
                            "effect without it); set training.float8=true or remove it")
        return problems


@dataclass
class LoggingConfig:
    """The ``logging`` keys: console progress and the optional TensorBoard / W&B sinks."""

    log_every: int = key(10, min=1)          # console progress every N steps (metrics.jsonl gets every step)
    tensorboard: bool = key(False)           # also write TensorBoard events to ${output_dir}/tensorboard
    wandb: bool = key(False)                 # also log to Weights & Biases (WANDB_MODE=offline works)
    wandb_project: str = key("hyper_parallel")
    wandb_run_name: Optional[str] = key(None)  # null: the name of output_dir


@dataclass
class EvalConfig:
    """The ``eval`` keys: the held-out loss, when and over how many batches."""

    every: int = key(0, min=0)               # validation loss every N steps and at the last step; 0 disables it
    steps: int = key(4, min=1)               # global batches of validation data per evaluation (the same each time)


@dataclass
class ProfilingConfig:
    """The ``profiling`` keys: a torch.profiler window."""

    enable: bool = key(False)                # torch.profiler trace per rank over start_step .. start_step+steps-1
    start_step: int = key(3, min=1)
    steps: int = key(2, min=1)
    folder: str = key("${output_dir}/profiles", path=True)
    memory_snapshot: bool = key(False)       # also a CUDA memory snapshot over the window (CUDA only)


@dataclass
class OptimConfig:
    """The ``optim`` group (``adamw``): AdamW with a linear warm-up and a cosine decay."""

    name: str = key("adamw", choices=("adamw",))
    lr: float = key(3.0e-3, min=0, min_open=True)    # peak learning rate
    weight_decay: float = key(0.1, min=0)
    betas: List[float] = key([0.9, 0.95], min=0, max=1, max_open=True, length=2)
    eps: float = key(1.0e-8, min=0, min_open=True)
    warmup_steps: int = key(10, min=0)                # linear warm-up from 0 to lr
    min_lr_ratio: float = key(0.1, min=0, max=1)      # cosine decay down to lr * min_lr_ratio at training.steps


@dataclass
class CheckpointConfig(MemorySnapshotKeys):
    """The ``checkpoint`` group (``default``): saving, retention and what to start from (and
    the in-memory snapshots' keys, ``config/memory.py``)."""

    folder: str = key("${output_dir}/checkpoints", path=True)
    interval: int = key(50, min=1)                   # save every N steps (and always at the last step)
    keep_last_n: int = key(2, min=1)                 # committed checkpoints kept; older ones are deleted
    async_save: bool = key(False)                    # write in the background while training continues
    resume: bool = key(True)                         # start from the latest complete checkpoint in folder, if any
    save_on_sigterm: bool = key(True)                # on SIGTERM all ranks stop at the next step boundary and save
    load_step: Optional[int] = key(None, min=0)      # resume from this step instead of the latest
    load_from: Optional[str] = key(None, path=True)  # a checkpoint (step-N dir or folder) to start from when folder holds none
    load_only: bool = key(False)                     # with load_from: the model weights only, starting at step 0
    exclude: List[str] = key([], choices=EXCLUDABLE, allow_empty=True)  # state not loaded
    last_save_model_only: bool = key(False)          # the checkpoint after the last step holds the model only
    export_dtype: str = key("float32", choices=EXPORT_DTYPE_NAMES)  # the model-only last checkpoint's dtype

    def problems(self, ok: Ok) -> List[str]:
        if self.load_only is True and not self.load_from:
            return ["checkpoint.load_only=true needs checkpoint.load_from (the checkpoint to take the model from)"]
        return self.memory_problems(ok)


# The config groups: each one a folder under configs/ whose options extend the schema.
GROUPS: Dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
                           "checkpoint": CheckpointConfig}


@dataclass
class TrainConfig:
    """The whole recipe config (``configs/train.yaml`` and its groups)."""

    output_dir: str = key("outputs/train", path=True)  # metrics, config.yaml, checkpoints (by default)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=SyntheticDataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def problems(self, world_size: int, ok: Ok) -> Tuple[Optional[ParallelDims], List[str]]:
        """The checks across groups and each group's own; the mesh shape when it factors."""
        def within(group: str) -> Ok:
            return lambda name: ok(f"{group}.{name}")

        problems: List[str] = []
        dims, t, m, p = None, self.training, self.model, self.parallel
        if all(ok(f"parallel.{k}") for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")):
            dims, problem = p.resolve(world_size)
            problems += [problem] if problem else []
        micro_batch = None  # samples per rank and accumulation step
        if dims is not None and ok("training.global_batch_size") and ok("training.grad_accum_steps"):
            ranks_x_accum = dims.dp_size * t.grad_accum_steps
            if t.global_batch_size % ranks_x_accum:
                problems.append(
                    f"training.global_batch_size={t.global_batch_size} does not divide over "
                    f"{dims.dp_size} data-parallel ranks x training.grad_accum_steps={t.grad_accum_steps}"
                    f" (needs a multiple of {ranks_x_accum})")
            else:
                micro_batch = t.global_batch_size // ranks_x_accum
        problems += m.problems(within("model"))
        llama = None
        model_shape: Optional[Union[LlamaConfig, MoEConfig]] = None  # for the pipeline checks
        if m.moe is not None and all(ok(f"model.{name}") for name in field_rules(ModelConfig)):
            problems += p.moe_problems(m.moe.num_experts, dims) if ok("parallel.ep") else []
            try:
                model_shape = moe_config(m)
            except (ValueError, TypeError):
                pass  # ModelConfig.problems reports it
        elif all(ok(f"model.{name}") for name in field_rules(ModelConfig)):
            # model=hf: the experts are config.json's (hf_model.problems checks ep against them)
            problems += p.ep_problems(None, dims) if ok("parallel.ep") and m.path is None else []
            try:
                llama = llama_config(m)
            except (ValueError, TypeError):
                pass  # ModelConfig.problems reports it
        if dims is not None and llama is not None and ok("training.seq_len"):
            problems += p.split_problems(llama, t.seq_len)
        model_shape = llama if llama is not None else model_shape
        if dims is not None and model_shape is not None and all(ok(f"parallel.{f.name}") for f in fields(p)):
            problems += p.pipeline_problems(model_shape, micro_batch, m.tie_embeddings)
        if all(ok(k) for k in ("parallel.cp", "parallel.tp", "parallel.pp", "training.seq_len")):
            problems += p.cp_problems(t.seq_len)
        if all(ok(k) for k in ("training.loss_chunks", "training.seq_len", "parallel.cp")) and \
                t.loss_chunks > t.seq_len // p.cp:
            problems.append(f"training.loss_chunks={t.loss_chunks} exceeds the {t.seq_len // p.cp} tokens of each "
                            "sequence per rank (training.seq_len / parallel.cp)")
        if ok("training.document_mask") and t.document_mask is True:
            if ok("data.kind") and isinstance(self.data, SyntheticDataConfig):
                problems.append("training.document_mask=true needs documents: data=synthetic has none (use data=text "
                                "or data=tokens)")
            if ok("parallel.pp") and p.pp > 1:
                problems.append(f"training.document_mask=true with parallel.pp={p.pp} is not supported yet "
                                "(the stages' attention sees no micro-batch's documents); use one or the other")
        if ok("training.seq_len") and ok("model.max_seq_len") and t.seq_len > m.max_seq_len:
            problems.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        d = self.data
        if (isinstance(d, SyntheticDataConfig) and ok("data.kind") and ok("data.branching") and ok("model.vocab_size")
                and d.branching > m.vocab_size):
            problems.append(f"data.branching={d.branching} exceeds model.vocab_size={m.vocab_size}")
        if ok("training.float8") and ok("parallel.tp") and t.float8 and p.tp > 1 and m.moe is None:
            problems.append(f"training.float8=true with parallel.tp={p.tp} is not supported yet "
                            "(float8 needs torchao's tensor-parallel styles); use one or the other")
        if ok("training.float8") and ok("parallel.pp") and t.float8 and p.pp > 1:
            problems.append(f"training.float8=true with parallel.pp={p.pp} is not supported yet "
                            "(untested with pipeline stages); use one or the other")
        if ok("training.float8") and t.float8 is True and model_shape is not None and m.path is None:
            problems += float8_layer_problems(model_shape)  # model=hf: hf_model checks its own linears
        problems += self._eval_problems(ok)
        problems += t.problems(within("training"))
        problems += self.checkpoint.problems(within("checkpoint"))
        return dims, problems

    def _eval_problems(self, ok: Ok) -> List[str]:
        """Where the validation data comes from: a corpus's ``data.val_fraction`` or
        ``data.val_path`` (not both; one of them with evaluation on); synthetic data has
        unbounded validation data, but an evaluation longer than the whole training is a typo."""
        d, e, t = self.data, self.eval, self.training
        if not all(ok(name) for name in ("data.kind", "eval.every", "eval.steps", "training.steps")):
            return []
        if isinstance(d, SyntheticDataConfig):
            if e.every > 0 and e.steps > t.steps:
                return [f"eval.steps={e.steps} is more than training.steps={t.steps}: each evaluation "
                        "would take longer than the whole training; lower eval.steps"]
            return []
        fraction, path = d.held_out()
        if not (ok("data.val_fraction") and ok("data.val_path")):
            return []
        if fraction and path:
            return [f"data.val_fraction={fraction} and data.val_path={path}: set one of them, not both"]
        if e.every > 0 and not (fraction or path):
            return [f"eval.every={e.every} needs validation data: set data.val_fraction or data.val_path"]
        return []


def register_schemas() -> None:
    """Store every group's defaults in Hydra's ConfigStore (``<group>/schema``,
    ``data/<kind>_schema``, and ``schema`` for train.yaml's own keys).

    Stored as plain values, not typed nodes: OmegaConf would refuse a bad value while composing,
    one at a time, and the recipe reports every problem together (``compose.validate_config``).
    """
    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=defaults(TrainConfig, exclude=(*GROUPS, "data")))
    for group, cls in GROUPS.items():
        cs.store(group=group, name=SCHEMA_NAME, node=defaults(cls))
    for kind, cls in DATA_KINDS.items():
        cs.store(group="data", name=f"{kind}_{SCHEMA_NAME}", node=defaults(cls))


def _compile_backends() -> List[str]:
    return torch.compiler.list_backends(exclude_tags=())
