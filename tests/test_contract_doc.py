"""docs/contract.md names only what exists: every config key of its table is a key of the
recipe's schema, every ``hp.``/``hdcp.`` name is exported, every CLI command is accepted."""

from __future__ import annotations

import dataclasses
import os
import re
import typing

import pytest

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint import cli
from hyper_parallel.trainer.config import TrainConfig

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "contract.md")


def _doc() -> str:
    with open(DOC) as f:
        return f.read()


def _dataclass_of(node: type, name: str, field: dataclasses.Field):
    """The dataclass a field holds (its default's, or the one its annotation names, also in
    ``Optional[...]``: ``model.moe`` is null by default), or None for a leaf."""
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    if dataclasses.is_dataclass(default):
        return type(default)
    hint = typing.get_type_hints(node).get(name)
    found = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return found[0] if found else None


def _schema_has(dotted: str) -> bool:
    node = TrainConfig
    parts = dotted.split(".")
    for at, part in enumerate(parts):
        if node is None:
            return False
        names = {f.name: f for f in dataclasses.fields(node)}
        if part not in names:
            return False
        node = _dataclass_of(node, part, names[part]) if at + 1 < len(parts) else None
    return True


def test_config_keys_exist_in_schema():
    table = _doc().split("## Recipe", 1)[1]
    keys = {k for k in re.findall(r"`([a-z_]+(?:\.[a-z0-9_]+)*)`", table)
            if "." in k and not k.endswith((".py", ".yaml", ".jsonl", ".md"))}
    keys |= {"output_dir"}
    assert len(keys) > 15, keys
    missing = sorted(k for k in keys if not _schema_has(k))
    assert not missing, f"docs/contract.md names config keys the schema lacks: {missing}"


def test_every_parallel_and_moe_key_is_listed():
    """The layout keys (CP and EP included) and every ``model.moe`` key are in the contract."""
    from hyper_parallel.trainer.config.moe import MoEOptions
    from hyper_parallel.trainer.config.parallel import ParallelConfig

    table = _doc().split("## Recipe", 1)[1]
    for prefix, options in (("parallel", ParallelConfig), ("model.moe", MoEOptions)):
        missing = [f.name for f in dataclasses.fields(options) if f"`{prefix}.{f.name}`" not in table]
        assert not missing, f"docs/contract.md does not list {prefix}.{missing}"
    assert _schema_has("model.moe.num_experts") and not _schema_has("model.moe.no_such_key")


def test_api_names_are_exported():
    doc = _doc()
    for prefix, module in (("hp", hp), ("hdcp", hdcp)):
        names = set(re.findall(rf"\b{prefix}\.([A-Za-z_]\w*)", doc))
        assert names, prefix
        missing = sorted(n for n in names if not hasattr(module, n))
        assert not missing, f"docs/contract.md names {prefix}.{missing}, which are not exported"


def test_cli_commands_exist(capsys):
    line = re.search(r"python -m hyper_parallel\.checkpoint ([\w|-]+)", _doc()).group(1)
    commands = line.split("|")
    assert len(commands) >= 5
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--help"])
        assert exited.value.code == 0, f"the CLI has no {command!r} command"
    with pytest.raises(SystemExit) as exited:
        cli.main(["no-such-command", "--help"])
    assert exited.value.code != 0
