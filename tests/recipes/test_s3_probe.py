"""``train.py --check`` with ``checkpoint.folder`` on an object store that accepts connections
but never answers: one line naming the endpoint within a bound of seconds (its requests are
bounded, ``store.STARTUP_BOUNDS``); checkpoint locations the checkpoint code refuses
(credentials, queries, chained URLs) are one line too, with no secret shown and no local
folder created."""

from __future__ import annotations

import os
import time

import pytest

from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import RequestBounds
from tests.checkpoint.s3_server import silent_s3  # noqa: F401 (fixture)
from tests.recipes.train_in_process import one_line_error

SECRET = "wJalr/XUtnFEMI+K7MDENG"


@pytest.mark.timeout(120)  # unbounded, the probe's requests are retried for many minutes
def test_check_on_a_store_that_never_answers_fails_in_one_line(check, silent_s3, monkeypatch):
    bounds = RequestBounds(timeout_s=1.0, attempts=2)
    monkeypatch.setattr(store, "STARTUP_BOUNDS", bounds)
    started = time.monotonic()
    code, _, err = check("checkpoint.folder=s3://bucket/run")
    assert time.monotonic() - started < 12 * bounds.timeout_s, err
    one_line_error(code, err, f"checkpoint.folder: s3://bucket/run: no answer from the object store at "
                              f"{silent_s3} (2 tries of 1s)")


@pytest.mark.parametrize("folder,expected", [
    (f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", "checkpoint.folder: URL 's3://***@bucket/run' holds credentials"),
    ("'s3://bucket/run?versionId=3'", "checkpoint.folder: URL 's3://bucket/run?***' has a query or fragment"),
    ("simplecache::s3://bucket/run", "checkpoint.folder: location 'simplecache::s3://bucket/run' chains file systems"),
    ("data:run", "checkpoint.folder: location 'data:run' starts with a scheme but is no <scheme>:// URL"),
])
def test_check_refuses_checkpoint_locations_in_one_line(check, folder, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = check(f"checkpoint.folder={folder}")
    one_line_error(code, err, expected)
    assert SECRET not in err and "AKIAEXAMPLE" not in err
    assert os.listdir(tmp_path) == ["out"]  # output_dir only: no folder named after the location
