"""Checkpoint locations are classified in one place (``utils/fileio.url_scheme``): URLs with
credentials, a query or a fragment, chained URLs and ``<scheme>:`` without ``//`` are refused
in one line by save, load, ``CheckpointManager`` and the CLI alike, nothing is written (no local
folder of that name either), and no message shows a secret typed into the URL. An object store
that does not answer is one CLI line with exit code 2 within a bound of seconds."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import RequestBounds
from hyper_parallel.platform import free_port
from hyper_parallel.utils.fileio import redact_url, url_scheme
from tests.checkpoint.helpers import blank_state, full_state
from tests.checkpoint.s3_server import CREDENTIALS, silent_s3  # noqa: F401 (fixture)

SECRET = "wJalr/XUtnFEMI+K7MDENG"  # an AWS-style secret: it holds "/" and "+"
TOKEN = "Sig-5e3cfa"
# (location, what the one line says)
REFUSED = [
    (f"s3://AKIAEXAMPLE:{SECRET}@bucket/run/step-1", "holds credentials"),
    (f"memory://AKIAEXAMPLE:{SECRET}@bucket/run/step-1", "holds credentials"),
    (f"s3://AKIAEXAMPLE%3A{SECRET}%40bucket/run/step-1", "holds credentials"),  # percent-encoded
    (f"s3://AKIAEXAMPLE%3a{SECRET}@bucket/run/step-1", "holds credentials"),
    (f"s3://AKIAEXAMPLE:{SECRET}%40bucket/run/step-1", "holds credentials"),
    (" s3://bucket/run/step-1", "has leading or trailing whitespace"),
    ("s3://bucket/run/step-1\n", "has leading or trailing whitespace"),
    ("s3://bucket/q/step-1?versionId=x", "has a query or fragment"),
    (f"s3://bucket/q/step-1?X-Amz-Signature={TOKEN}", "has a query or fragment"),
    ("memory://bucket/q/step-1#frag", "has a query or fragment"),
    ("simplecache::s3://bucket/run/step-1", "chains file systems"),
    ("s3://bucket/run/step-1::file://x", "chains file systems"),
    ("data:text/plain,abc", "is no <scheme>:// URL"),
    ("s3:bucket/run/step-1", "is no <scheme>:// URL"),
]


def _one_line(message: str, expected: str) -> None:
    assert "\n" not in message.strip() and expected in message, message
    assert SECRET not in message and TOKEN not in message and "AKIAEXAMPLE" not in message, message


def _refusal(call) -> str:
    with pytest.raises(ValueError) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize("location,expected", REFUSED)
def test_every_entry_point_refuses_the_location_in_one_line(location, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = [
        lambda: hdcp.save(full_state(), checkpoint_id=location, no_dist=True),
        lambda: hdcp.async_save(full_state(), checkpoint_id=location, no_dist=True).result(timeout=60),
        lambda: hdcp.load(blank_state(), checkpoint_id=location, no_dist=True),
        lambda: hdcp.save(full_state(), storage_writer=hdcp.FsspecWriter(location), no_dist=True),
        lambda: hdcp.save(full_state(), storage_writer=hdcp.FileSystemWriter(location), no_dist=True),
        lambda: hdcp.CheckpointManager(location),
        lambda: hdcp.is_checkpoint(location),
        lambda: hdcp.verify_checkpoint(location),
        lambda: hdcp.read_checkpoint_metadata(location),
    ]
    for call in calls:
        _one_line(_refusal(call), expected)
    for command in ("inspect", "verify", "list"):
        assert main([command, location]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ")
        _one_line(err, expected)
    assert os.listdir(tmp_path) == []  # no local folder "simplecache::s3:", "data:...", "s3:"


def test_paths_and_plain_urls_are_classified_as_before():
    assert url_scheme("s3://bucket/run/step-1") == "s3"
    assert url_scheme("memory://x/y") == "memory"
    # A user or container name without a secret is no credential (adlfs' own URL form).
    assert url_scheme("abfs://container@account.dfs.core.windows.net/run") == "abfs"
    assert url_scheme("sftp://user@host/run") == "sftp"
    assert url_scheme(None) is None
    for path in ("/tmp/a?b#c", "relative/dir", "./data:abc", "C:/runs/x", "/tmp/user@host"):
        assert url_scheme(path) is None


def test_redact_url_hides_credentials_and_queries_only():
    assert redact_url(f"s3://AKIAEXAMPLE:{SECRET}@bucket/run") == "s3://***@bucket/run"
    assert redact_url(f"s3://bucket/run?X-Amz-Signature={TOKEN}#f") == "s3://bucket/run?***"
    assert redact_url(f"simplecache::s3://K:{SECRET}@b/r") == "simplecache::s3://***@b/r"
    assert redact_url("s3://bucket/run/step-1") == "s3://bucket/run/step-1"
    assert redact_url("/local/a@b?c") == "/local/a@b?c"
    assert redact_url("abfs://container@account/run") == "abfs://container@account/run"
    assert redact_url(f"s3://KEY:SE/{SECRET}@bucket/run") == "s3://***@bucket/run"
    assert redact_url(f"s3://KEY%3A{SECRET}%40bucket/run") == "s3://***%40bucket/run"


@pytest.mark.timeout(120)
def test_cli_on_a_store_that_never_answers_fails_in_one_line_with_exit_code_2(silent_s3, monkeypatch, capsys):
    bounds = RequestBounds(timeout_s=1.0, attempts=2)
    monkeypatch.setattr(store, "STARTUP_BOUNDS", bounds)
    for command in ("inspect", "verify", "list"):
        started = time.monotonic()
        assert main([command, "s3://bucket/run"]) == 2
        elapsed = time.monotonic() - started
        err = capsys.readouterr().err.strip()
        assert elapsed < 12 * bounds.timeout_s, elapsed  # one request's tries and back-off, not minutes
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"error: s3://bucket/run: no answer from the object store at {silent_s3} "
                              "(2 tries of 1s): ReadTimeoutError"), err


@pytest.mark.timeout(120)
def test_cli_on_a_refused_endpoint_names_it_and_hides_its_credentials(monkeypatch, capsys):
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'hyper_parallel[s3]'")
    import s3fs

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    password = "Pw9xK2secret"
    for key, value in dict(CREDENTIALS, AWS_ENDPOINT_URL=endpoint.replace("//", f"//minio:{password}@")).items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        assert main(["inspect", "s3://bucket/run/step-3"]) == 2
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and password not in err, err
    assert err.startswith("error: s3://bucket/run/step-3: no answer from the object store at "
                          f"{endpoint.replace('//', '//***@')} (2 tries of 10s): "), err


@pytest.mark.timeout(120)
def test_cli_without_credentials_fails_in_one_line_with_exit_code_2(s3_endpoint, tmp_path):
    import subprocess
    import sys

    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'hyper_parallel[s3]'")
    # A fresh process: no AWS_* credentials, no ~/.aws, no credentials cached by an earlier test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ENDPOINT_URL=s3_endpoint, AWS_DEFAULT_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true")
    done = subprocess.run([sys.executable, "-m", "hyper_parallel.checkpoint", "list", "s3://bucket/run"],
                          env=env, capture_output=True, text=True, timeout=100)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: s3://bucket/run: the object store's client failed before any answer: "
                          "NoCredentialsError: Unable to locate credentials; check the credentials"), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["load", "save", "read_checkpoint_metadata"])
def test_the_library_on_a_store_that_never_answers_fails_naming_it(silent_s3, monkeypatch, call):
    """save/load open their stores with LIBRARY_BOUNDS (made short here): an endpoint that
    accepts connections and never answers ends in one CheckpointError naming it, not minutes."""
    monkeypatch.setattr(store, "LIBRARY_BOUNDS", RequestBounds(timeout_s=1.0, attempts=2))
    calls = {"load": lambda: hdcp.load({"w": torch.zeros(2)}, checkpoint_id="s3://bucket/run", no_dist=True),
             "save": lambda: hdcp.save({"w": torch.zeros(2)}, checkpoint_id="s3://bucket/run", no_dist=True),
             "read_checkpoint_metadata": lambda: hdcp.read_checkpoint_metadata("s3://bucket/run")}
    started = time.monotonic()
    with pytest.raises(hdcp.CheckpointError) as raised:
        calls[call]()
    assert time.monotonic() - started < 20
    assert str(raised.value).startswith(f"s3://bucket/run: no answer from the object store at {silent_s3} "
                                        "(2 tries of 1s): "), str(raised.value)
