"""Compose the Hydra config from the command line, validate it against the schema
(``schema.py``) before anything starts, and make the typed config the consumers read."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hyper_parallel.trainer.config import hf_model
from hyper_parallel.trainer.config.rules import Range, accepts, build, describe, field_rules, leaves
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.data import DATA_KEYS, DATA_KINDS, DataConfig
from hyper_parallel.trainer.config.model import ModelConfig, shape
from hyper_parallel.trainer.config.schema import TrainConfig, register_schemas

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs"))
# Hydra's message for an override of a key the config lacks.
_UNKNOWN_OVERRIDE = re.compile(r"Could not override '([^']+)'\.\s*To append to your config")


class ConfigError(ValueError):
    """The configuration cannot run; the message lists every problem found."""


@dataclasses.dataclass(frozen=True)
class ValidConfig:
    """A config that passed :func:`validate_config`, typed once: what a run reads."""

    cfg: TrainConfig       # the typed config the code reads
    dims: ParallelDims     # the world's layout
    composed: DictConfig   # as composed and resolved: the run's config.yaml, its W&B run's config
    # model=hf: the model validation built on the meta device from model.path, the one the run
    # trains (built once per process); None otherwise.
    meta_model: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)


def _rules(data_cls: Optional[type]) -> Dict[str, Tuple[Any, Range]]:
    """dotted key -> (type, Range) of the schema, with the keys of ``data_cls`` (if any)."""
    rules = dict(field_rules(TrainConfig))
    for group, cls in typing.get_type_hints(TrainConfig).items():
        if dataclasses.is_dataclass(cls) and cls is not DataConfig:
            rules.update({f"{group}.{name}": rule for name, rule in field_rules(cls).items()})
    rules["data.kind"] = (str, Range(choices=tuple(DATA_KINDS)))
    if data_cls is not None:
        rules.update({f"data.{name}": rule for name, rule in field_rules(data_cls).items() if name != "kind"})
    return rules


def all_keys() -> List[str]:
    """Every key of the schema, those of every data kind included, sorted."""
    keys = set(_rules(None))
    for cls in DATA_KINDS.values():
        keys |= set(_rules(cls))
    return sorted(keys)


def unknown_key_message(key: str, known: List[str], data_kind: Optional[str] = None) -> str:
    """Why ``key`` is refused: another data kind's key, or unknown (with the closest known keys)."""
    owners = [kind for kind, keys in DATA_KEYS.items() if key.startswith("data.") and key[5:] in keys]
    if owners:
        chosen = f"data={data_kind}" if data_kind else "the chosen data option"
        return f"{key} is not a key of {chosen} (it belongs to data={' / data='.join(owners)})"
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unknown key {key}{hint}; `recipes/train.py --cfg` lists every key"


def _data_kind(values: Dict[str, Any]) -> Optional[str]:
    data = values.get("data")
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) and kind in DATA_KINDS else None


def schema_problems(values: Dict[str, Any]) -> Dict[str, str]:
    """Every key of the plain config ``values`` that is unknown or not of its type and range:
    dotted key -> one readable line (empty: none)."""
    kind = _data_kind(values)
    rules = _rules(DATA_KINDS[kind] if kind else None)
    problems: Dict[str, str] = {}
    for name, value in leaves(values):
        rule = rules.get(name)
        if rule is not None:
            if not accepts(*rule, value):
                problems[name] = f"{name}={value!r} must be {describe(*rule)}"
        elif name.startswith("data.") and kind is None:
            continue  # data.kind itself is wrong: its keys cannot be judged
        else:
            problems[name] = unknown_key_message(name, sorted(rules), kind)
    return problems


def _typed(values: Dict[str, Any]) -> TrainConfig:
    def pick(hint: type, node: Any) -> Optional[type]:
        if hint is DataConfig:
            return DATA_KINDS.get(node.get("kind")) if isinstance(node, dict) else None
        return hint
    return build(TrainConfig, values, pick)


def typed_config(cfg: DictConfig) -> TrainConfig:
    """The typed config of a composed ``cfg``, not validated (a run reads
    :func:`validate_config`'s)."""
    return _typed(OmegaConf.to_container(cfg, resolve=True))


def model_overrides(model: ModelConfig, config_dir: str = CONFIG_DIR) -> Dict[str, Any]:
    """The model-shape keys that differ from the preset ``configs/model/<name>.yaml`` (the
    schema's defaults with the preset's values; empty when there is no such preset)."""
    path = os.path.join(config_dir, "model", f"{model.name}.yaml")
    if not os.path.isfile(path):
        return {}
    preset = {**shape(ModelConfig()), **OmegaConf.to_container(OmegaConf.load(path))}
    return {k: v for k, v in shape(model).items() if preset[k] != v}


def compose_config(overrides: Sequence[str], config_dir: str = CONFIG_DIR,
                   config_name: str = "train") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with Hydra command-line ``overrides``.

    Uses Hydra's compose API, so nothing changes the working directory or writes ``.hydra``
    folders. The result is resolved and in struct mode. Keys added with ``+`` are accepted
    here and refused by :func:`validate_config`, like every other key the schema lacks.

    Raises:
        ConfigError: a malformed override, an unknown key or group option, or a value that
            does not resolve (the message says which).
    """
    register_schemas()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        unknown = _UNKNOWN_OVERRIDE.match(str(err))
        if unknown and unknown.group(1) in all_keys():  # a nested key of a mapping that is null here
            name, parent = unknown.group(1), unknown.group(1).rsplit(".", 1)[0]
            raise ConfigError(f"{name} cannot be set while {parent} is null: set the whole mapping, "
                              f"e.g. {parent}={{{name.rsplit('.', 1)[1]}:...}}") from None
        if unknown:  # Hydra's own hint ("use +key=...") leads to a key nothing reads
            raise ConfigError(unknown_key_message(unknown.group(1), all_keys())) from None
        cause = f"\n{str(err.__cause__).splitlines()[0]}" if err.__cause__ else ""
        raise ConfigError(_first_lines(str(err)) + cause) from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def _first_lines(message: str, limit: int = 6) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])


def validate_config(cfg: DictConfig, world_size: int) -> ValidConfig:
    """Check every key against the schema and the keys against each other; return the typed
    config with the world's layout.

    Raises:
        ConfigError: listing all problems found (unknown keys, types, ranges, mesh, batch
            split, model shape).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("required value(s) not set: " + ", ".join(missing)
                          + " (pass them as overrides, e.g. " + missing[0] + "=...)")
    values = OmegaConf.to_container(cfg, resolve=True)
    problems = schema_problems(values)
    hf_lines, hf_meta_model, set_keys = _read_hf_model(cfg, values, problems)
    typed = _typed(values)
    dims, relations = typed.problems(world_size, lambda name: name not in problems)
    if hf_meta_model is not None:
        relations += hf_model.problems(typed, hf_meta_model, set_keys, dims)
    relations = hf_lines + relations
    listing = list(problems.values()) + relations
    if listing:
        raise ConfigError(problems_message("invalid configuration", listing))
    return ValidConfig(typed, dims, cfg, hf_meta_model)


def _read_hf_model(cfg: DictConfig, values: Dict[str, Any],
                   problems: Dict[str, str]) -> Tuple[List[str], Optional[Any], List[str]]:
    """``model.path`` set (``model=hf``): the shape keys of its config.json written into ``values``
    and ``cfg`` (so config.yaml records them); returns (its problems, the model on the meta device
    or None, the shape keys the command line set although config.json decides them)."""
    model = values.get("model")
    path = model.get("path") if isinstance(model, dict) else None
    if path is None or "model.path" in problems:
        return [], None, []
    keys, lines, meta_model = hf_model.read_model_keys(os.path.expanduser(path))
    defaults = shape(ModelConfig())
    set_keys = [k for k in keys if model.get(k, defaults[k]) != defaults[k]]
    model.update(keys)
    with open_dict(cfg):
        for key, value in keys.items():
            cfg.model[key] = value
    return lines, meta_model, set_keys


def problems_message(header: str, problems: Sequence[str]) -> str:
    """One problem on one line; several as ``header:`` and one ``- problem`` line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{header}:\n  - " + "\n  - ".join(problems)
