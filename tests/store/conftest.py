"""A real S3 server for the store tests (SeaweedFS on 127.0.0.1, tests/store/seaweed.py), started once
per test session and stopped at the end, and the fault proxy in front of it (tests/store/proxy.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .proxy import Proxy, start
from .seaweed import S3Server, seaweed


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The server, with AWS_* set in this process's environment (DataLoader workers inherit it)."""
    with seaweed(tmp_path_factory.mktemp("seaweedfs")) as server:
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def _proxy_server(s3_server: S3Server) -> Iterator[Proxy]:
    proxy, server = start(s3_server.endpoint)
    yield proxy
    server.shutdown()


@pytest.fixture
def proxy(_proxy_server: Proxy, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    """The fault proxy in front of the server, as this test's (and its workers') S3 endpoint."""
    _proxy_server.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", _proxy_server.url)
    yield _proxy_server
    _proxy_server.clear()
