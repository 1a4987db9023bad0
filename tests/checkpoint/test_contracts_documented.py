"""The planner and storage contracts document every method a subclass implements or may
override, each in its own docstring (as torch DCP's do), and docs/checkpoint.md's table from our
names to DCP's names only methods that exist."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from hyper_parallel import checkpoint as hdcp

CONTRACTS = (hdcp.SavePlanner, hdcp.LoadPlanner, hdcp.StorageWriter, hdcp.AsyncCommitWriter,
             hdcp.StorageReader, hdcp.CheckpointStore)
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "checkpoint.md")


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.__name__)
def test_every_method_of_a_contract_has_its_own_docstring(contract):
    methods = {name: member for name, member in vars(contract).items()
               if inspect.isfunction(member) and not name.startswith("_")}
    assert methods
    undocumented = sorted(name for name, member in methods.items() if not (member.__doc__ or "").strip())
    assert not undocumented, f"{contract.__name__} methods without a docstring: {undocumented}"
    for name in getattr(contract, "__abstractmethods__", ()):
        assert name in methods or (getattr(contract, name).__doc__ or "").strip(), (contract.__name__, name)


def test_the_dcp_table_names_our_methods():
    section = open(DOC).read().split("Coming from torch DCP, the same steps under our names:", 1)[1]
    table = section.strip().split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 15
    for row in rows:
        ours = row.split("|")[1]
        owner = hdcp  # a method after its class (`SavePlanner.get_data`, `AsyncCommitWriter` (`publish_result`))
        for name in re.findall(r"`([\w.]+)`", ours):
            owner_name, _, name = name.rpartition(".")
            if owner_name:
                owner = getattr(hdcp, owner_name)
            target = owner if name[0].islower() and owner is not hdcp and not hasattr(hdcp, name) else hdcp
            assert hasattr(target, name), f"docs/checkpoint.md maps {name!r}, which {target.__name__} lacks"
            if name[0].isupper():
                owner = getattr(hdcp, name)
