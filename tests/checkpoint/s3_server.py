"""An S3-compatible server on loopback for the object storage tests: moto's server mode in a
subprocess on a free port, started once per test session and stopped by its process id; and
an endpoint that accepts connections and never answers (a hung store). No test touches the
network beyond 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Iterator

import pytest

from hyper_parallel.platform import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
_START_TIMEOUT_S = 60


def _start() -> Iterator[str]:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    # Its request log goes to a file: a pipe nobody reads would fill and stall the server.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"moto server exited with {proc.returncode}: "
                                   f"{log.read().decode(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer on {endpoint} within {_START_TIMEOUT_S}s")
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()  # this process's child, by its pid
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on 127.0.0.1 (skips without moto/s3fs)."""
    pytest.importorskip("moto.server", reason="S3 tests need moto: pip install 'moto[server]'")
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'hyper_parallel[s3]'")
    yield from _start()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch, request) -> Iterator[Dict[str, str]]:
    """A fresh bucket on the moto server; AWS_* variables point botocore/s3fs at it (for this
    process; ranks get them through :func:`with_env`). Yields the environment, with the
    bucket's URL under ``"url"``."""
    import s3fs

    env = dict(CREDENTIALS, AWS_ENDPOINT_URL=s3_endpoint)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    bucket = "ckpt-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    fs.mkdir(bucket)
    yield dict(env, url=f"s3://{bucket}")
    fs.rm(bucket, recursive=True)
    s3fs.S3FileSystem.clear_instance_cache()


def with_env(env: Dict[str, str], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` in a rank process with ``env`` set (the rank pool outlives one test's env)."""
    import s3fs

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        return fn(*args, **kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def silent_s3(monkeypatch) -> Iterator[str]:
    """AWS_* variables pointing s3fs at an endpoint on 127.0.0.1 whose socket listens (the
    kernel completes each connection) but never answers a request; yields its URL. Closed
    afterwards. Skips without s3fs."""
    s3fs = pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'hyper_parallel[s3]'")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(128)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        for key, value in dict(CREDENTIALS, AWS_ENDPOINT_URL=endpoint).items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        yield endpoint
    finally:
        server.close()
        s3fs.S3FileSystem.clear_instance_cache()
