"""The one schema of the recipe config: every key, its type and its range.

``SCHEMA`` maps each dotted key to a :class:`Rule`; keys of the ``data`` group depend on
``data.kind`` and live in ``DATA_SCHEMA[kind]``. :func:`schema_problems` checks a composed
config against them: unknown keys (with or without Hydra's ``+``), keys the schema expects but
the config files lack, and every value's type and range. Checks between keys (mesh, batch
split, model shape) are in ``config.py``.

Adding a key is one line here, next to its YAML default in ``configs/``, e.g.::

    "training.eval_every": Int(min=0),           # in SCHEMA
    "seq_file": Path(),                          # in DATA_SCHEMA["mykind"]

A key that may be absent from the config files (its reader has a default) takes
``required=False``. A new data kind is one ``DATA_SCHEMA`` entry (its keys; ``data.kind``
accepts every entry) next to its ``configs/data/<kind>.yaml``.
"""

from __future__ import annotations

import difflib
import math
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

SEED_MAX = 2**32 - 1  # numpy's and the loader's seed range
# Training-state entries that checkpoint.exclude may name (the model is always loaded).
EXCLUDABLE = ("optim", "lr_schedule", "data", "rng")
# dtypes a model-only last checkpoint may be written in (checkpoint.export_dtype).
EXPORT_DTYPE_NAMES = ("float32", "bfloat16", "float16")


class Rule(ABC):
    """What one config value must be.

    Args:
        required: the config files must define the key (False: it may be absent).
    """

    def __init__(self, *, required: bool = True):
        self.required = required

    @abstractmethod
    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is valid."""

    @abstractmethod
    def describe(self) -> str:
        """What a valid value is, completing "must be ..."."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounds(low: Optional[float], high: Optional[float], low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


class Int(Rule):
    """An integer (not a bool, not a float such as ``1e29``) in ``[min, max]``."""

    def __init__(self, min: Optional[int] = None, max: Optional[int] = None, **kw: Any):
        super().__init__(**kw)
        self.min, self.max = min, max

    def accepts(self, value: Any) -> bool:
        return (_is_int(value) and (self.min is None or value >= self.min)
                and (self.max is None or value <= self.max))

    def describe(self) -> str:
        if self.min == 1 and self.max is None:
            return "a positive integer"
        return "an integer" + _bounds(self.min, self.max, False, False)


class Float(Rule):
    """A finite number in the given range (``*_open``: the bound itself is excluded)."""

    def __init__(self, min: Optional[float] = None, max: Optional[float] = None, *,
                 min_open: bool = False, max_open: bool = False, **kw: Any):
        super().__init__(**kw)
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def accepts(self, value: Any) -> bool:
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            return False
        above = self.min is None or (value > self.min if self.min_open else value >= self.min)
        below = self.max is None or (value < self.max if self.max_open else value <= self.max)
        return above and below

    def describe(self) -> str:
        return "a finite number" + _bounds(self.min, self.max, self.min_open, self.max_open)


class Bool(Rule):
    """``true`` or ``false``."""

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)

    def describe(self) -> str:
        return "true or false"


class Str(Rule):
    """A non-empty string."""

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value.strip() != ""

    def describe(self) -> str:
        return "a non-empty string"


class Path(Str):
    """A non-empty path string."""

    def describe(self) -> str:
        return "a path"


class Choice(Rule):
    """One of a fixed set of strings."""

    def __init__(self, *options: str, **kw: Any):
        super().__init__(**kw)
        self.options = options

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.options

    def describe(self) -> str:
        return "one of " + ", ".join(self.options)


class Nullable(Rule):
    """``null`` or a value ``inner`` accepts."""

    def __init__(self, inner: Rule, **kw: Any):
        super().__init__(**kw)
        self.inner = inner

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def describe(self) -> str:
        return f"null or {self.inner.describe()}"


class ListOf(Rule):
    """A list of values ``item`` accepts (of exactly ``length`` items if given; empty only if
    ``allow_empty``)."""

    def __init__(self, item: Rule, length: Optional[int] = None, *, or_single: bool = False,
                 allow_empty: bool = False, **kw: Any):
        super().__init__(**kw)
        self.item, self.length, self.or_single, self.allow_empty = item, length, or_single, allow_empty

    def accepts(self, value: Any) -> bool:
        if self.or_single and self.item.accepts(value):
            return True
        if not isinstance(value, (list, tuple, ListConfig)) or not (len(value) or self.allow_empty):
            return False
        return (self.length is None or len(value) == self.length) and all(self.item.accepts(v) for v in value)

    def describe(self) -> str:
        count = f"{self.length} " if self.length else ""
        single = f"{self.item.describe()}, or " if self.or_single else ""
        return f"{single}a list of {count}values, each {self.item.describe()}"


# ----------------------------------------------------------------------------- the schema

# data.<key> for each data.kind (the group option's keys; ``kind`` itself is in SCHEMA).
DATA_SCHEMA: Dict[str, Dict[str, Rule]] = {
    "synthetic": {
        "chain_seed": Int(min=0, max=SEED_MAX),
        "branching": Int(min=1),
        "concentration": Float(min=0, min_open=True),
    },
    "text": {
        "paths": ListOf(Path(), or_single=True),
        "tokenizer": Path(),  # "bytes" or a tokenizer.json
        "eos_token": Nullable(Str()),
        "shuffle": Bool(),
        "val_fraction": Float(min=0, max=1, max_open=True),
        "val_path": Nullable(Path()),
    },
    "tokens": {
        "path": Path(),
        "dtype": Choice("uint16", "uint32"),
        "tokenizer": Nullable(Path()),
        "shuffle": Bool(),
        "val_fraction": Float(min=0, max=1, max_open=True),
        "val_path": Nullable(Path()),
    },
}

SCHEMA: Dict[str, Rule] = {
    "output_dir": Path(),
    "training.steps": Int(min=1),
    "training.global_batch_size": Int(min=1),
    "training.seq_len": Int(min=1),
    "training.seed": Int(min=0, max=SEED_MAX),
    "training.grad_accum_steps": Int(min=1),
    "training.max_grad_norm": Float(min=0),
    "training.device": Choice("auto", "cpu"),
    "training.compile": Bool(),
    "training.compile_backend": Str(),
    "training.float8": Bool(),
    "training.float8_recipe": Choice("tensorwise", "rowwise"),
    "training.stop_after_steps": Nullable(Int(min=1)),
    "training.time_limit_minutes": Nullable(Float(min=0, min_open=True)),
    "training.peak_tflops": Nullable(Float(min=0, min_open=True)),
    "eval.every": Int(min=0),
    "eval.steps": Int(min=1),
    "profiling.enable": Bool(),
    "profiling.start_step": Int(min=1),
    "profiling.steps": Int(min=1),
    "profiling.folder": Path(),
    "profiling.memory_snapshot": Bool(),
    "logging.log_every": Int(min=1),
    "logging.tensorboard": Bool(),
    "logging.wandb": Bool(),
    "logging.wandb_project": Str(),
    "logging.wandb_run_name": Nullable(Str()),
    "model.name": Str(),
    "model.vocab_size": Int(min=1),
    "model.dim": Int(min=1),
    "model.n_layers": Int(min=1),
    "model.n_heads": Int(min=1),
    "model.n_kv_heads": Nullable(Int(min=1)),
    "model.ffn_hidden_dim": Nullable(Int(min=1)),
    "model.max_seq_len": Int(min=1),
    "model.rope_theta": Float(min=0, min_open=True),
    "model.tie_embeddings": Bool(),
    "model.activation_checkpointing": Bool(),
    "model.init_from": Nullable(Path()),
    "data.kind": Choice(*DATA_SCHEMA),
    "parallel.dp_replicate": Int(min=1),
    "parallel.dp_shard": Int(min=-1),
    "parallel.mixed_precision": Choice("fp32", "bf16"),
    "parallel.reshard_after_forward": Bool(),
    "optim.name": Choice("adamw"),
    "optim.lr": Float(min=0, min_open=True),
    "optim.weight_decay": Float(min=0),
    "optim.betas": ListOf(Float(min=0, max=1, max_open=True), length=2),
    "optim.eps": Float(min=0, min_open=True),
    "optim.warmup_steps": Int(min=0),
    "optim.min_lr_ratio": Float(min=0, max=1),
    "checkpoint.folder": Path(),
    "checkpoint.interval": Int(min=1),
    "checkpoint.keep_last_n": Int(min=1),
    "checkpoint.async_save": Bool(),
    "checkpoint.resume": Bool(),
    "checkpoint.save_on_sigterm": Bool(),
    "checkpoint.load_step": Nullable(Int(min=0)),
    "checkpoint.load_from": Nullable(Path()),
    "checkpoint.load_only": Bool(),
    "checkpoint.exclude": ListOf(Choice(*EXCLUDABLE), allow_empty=True),
    "checkpoint.last_save_model_only": Bool(),
    "checkpoint.export_dtype": Choice(*EXPORT_DTYPE_NAMES),
}

def _leaves(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain nested dict; lists are leaves."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _data_kind(cfg: DictConfig) -> Optional[str]:
    data = cfg.get("data")
    kind = data.get("kind") if isinstance(data, DictConfig) else None
    return kind if isinstance(kind, str) and kind in DATA_SCHEMA else None


def expected_keys(cfg: DictConfig) -> Dict[str, Rule]:
    """The schema for this config: ``SCHEMA`` plus the keys of its ``data.kind``."""
    rules = dict(SCHEMA)
    for key, rule in DATA_SCHEMA.get(_data_kind(cfg), {}).items():
        rules[f"data.{key}"] = rule
    return rules


def all_keys() -> List[str]:
    """Every key of the schema, those of every data kind included, sorted."""
    return sorted(set(SCHEMA) | {f"data.{key}" for keys in DATA_SCHEMA.values() for key in keys})


def unknown_key_message(key: str, known: List[str], data_kind: Optional[str] = None) -> str:
    """Why ``key`` is refused: another data kind's key, or unknown (with the closest known keys)."""
    owners = [kind for kind, keys in DATA_SCHEMA.items() if key.startswith("data.") and key[5:] in keys]
    if owners:
        chosen = f"data={data_kind}" if data_kind else "the chosen data option"
        return f"{key} is not a key of {chosen} (it belongs to data={' / data='.join(owners)})"
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unknown key {key}{hint}; `recipes/train.py --cfg` lists every key"


def schema_problems(cfg: DictConfig) -> Dict[str, str]:
    """Every way ``cfg`` departs from the schema: dotted key -> one readable line (empty: none)."""
    rules, kind = expected_keys(cfg), _data_kind(cfg)
    present = dict(_leaves(OmegaConf.to_container(cfg, resolve=True)))
    problems: Dict[str, str] = {}
    for key, value in present.items():
        rule = rules.get(key)
        if rule is not None:
            if not rule.accepts(value):
                problems[key] = f"{key}={value!r} must be {rule.describe()}"
        elif key.startswith("data.") and kind is None:
            continue  # data.kind itself is wrong: its keys cannot be judged
        else:
            problems[key] = unknown_key_message(key, sorted(rules), kind)
    for key, rule in rules.items():
        if rule.required and key not in present:
            problems[key] = f"{key} is missing from the config (its default belongs in configs/)"
    return problems
