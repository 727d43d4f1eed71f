#!/usr/bin/env python3
"""The measurement behind packer.store's client choice: range GETs through botocore's own client,
through urllib3 with botocore's SigV4 signer (what packer.store uses), and through obstore when it is
installed (`pip install obstore`; not a dependency), against SeaweedFS on 127.0.0.1; then whether
each still works in a child process (fork, spawn, forkserver) after its parent used it.

    python scripts/bench_store_clients.py

Prints per client: the latency of one 112 KB range GET, the GET rate with 16 threads, the MiB/s of
one 64 MiB object in 8 MiB parts fetched by 8 threads, and "ok" or "HANG" per start method. Then
what the read cache's downloads cost the process that runs them: packer's ``Store.download`` of the
64 MiB object into a file, a CRC-32 of each piece as it arrives (as packer.read.remote checks a
unit), straight from the server and through the fault proxy (tests/store/proxy.py, in a process of
its own) at a bandwidth cap: MiB/s, this process's CPU seconds per 100 MB and the pieces read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

from bench_remote import ProxyProcess  # noqa: E402

from packer.store import open_store  # noqa: E402
from tests.store.proxy import Faults  # noqa: E402
from tests.store.seaweed import ACCESS, BUCKET, REGION, SECRET, seaweed  # noqa: E402

BIG = 64 << 20
Get = Callable[[int, int], bytes]  # (start, end exclusive) -> bytes of the test object


def clients(endpoint: str) -> dict[str, Get]:
    import botocore.session

    boto = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET
    )
    store = open_store(f"s3://{BUCKET}")
    out: dict[str, Get] = {
        "botocore client": lambda a, b: boto.get_object(Bucket=BUCKET, Key="big", Range=f"bytes={a}-{b - 1}")[
            "Body"
        ].read(),
        "urllib3 + SigV4 (packer)": lambda a, b: store.get("big", a, b),
    }
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return out
    ob = S3Store(
        BUCKET,
        endpoint=endpoint,
        access_key_id=ACCESS,
        secret_access_key=SECRET,
        region=REGION,
        client_options={"allow_http": True},
    )
    out["obstore"] = lambda a, b: bytes(obstore.get_range(ob, "big", start=a, end=b))
    return out


def measure(name: str, get: Get, data: bytes) -> None:
    r = random.Random(0)
    ranges = [(o, o + 112_000) for o in (r.randrange(0, BIG - 120_000) for _ in range(400))]
    t = time.perf_counter()
    for a, b in ranges:
        assert get(a, b) == data[a:b]
    serial = (time.perf_counter() - t) / len(ranges)
    with ThreadPoolExecutor(16) as pool:
        t = time.perf_counter()
        list(pool.map(lambda ab: get(*ab), ranges * 2))
        rate = 2 * len(ranges) / (time.perf_counter() - t)
    parts = [(o, min(o + (8 << 20), BIG)) for o in range(0, BIG, 8 << 20)]
    with ThreadPoolExecutor(8) as pool:
        t = time.perf_counter()
        whole = b"".join(pool.map(lambda ab: get(*ab), parts))
        mib_s = 64 / (time.perf_counter() - t)
    assert whole == data
    print(
        f"{name:26s} one 112 KB GET {serial * 1e3:5.2f} ms; 16 threads {rate:6.0f} GET/s; "
        f"64 MiB in parts {mib_s:4.0f} MiB/s"
    )


def download_cpu(endpoint: str, tmp: Path, label: str, runs: int = 5) -> None:
    """Store.download of the test object into a file, a CRC-32 per piece: MiB/s, CPU per 100 MB."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    store = open_store(f"s3://{BUCKET}")
    info = store.head("big")
    pieces, walls, cpus = [0], [], []

    def piece(at: int, data: bytes) -> None:
        pieces[0] += 1
        zlib.crc32(data)

    for _ in range(runs):
        pieces[0] = 0
        fd = os.open(tmp / "big.part", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, info.size)
        t, c = time.perf_counter(), time.process_time()
        store.download("big", fd, info, progress=piece)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        os.close(fd)
    print(
        f"Store.download, {label:34s} {BIG / 2**20 / statistics.median(walls):4.0f} MiB/s; "
        f"{statistics.median(cpus) * 100e6 / BIG:.3f} CPU s per 100 MB; {pieces[0]} pieces"
    )


_INHERITED: dict[str, Get] = {}  # the parent's clients, used before a fork


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, seaweed(Path(tmp)) as server:
        os.environ.update(server.env())
        data = os.urandom(BIG)
        server.client.put_object(Bucket=BUCKET, Key="big", Body=data)
        _INHERITED.update(clients(server.endpoint))
        for name, get in _INHERITED.items():
            measure(name, get, data)
        for method in ("fork", "spawn", "forkserver"):
            ctx: Any = mp.get_context(method)
            for name in _INHERITED:
                done = ctx.Queue()
                # fork inherits the parent's used client; spawn and forkserver children make their own
                p = ctx.Process(target=_child_entry, args=(server.endpoint, name, done, method == "fork"))
                p.start()
                p.join(15)
                if p.is_alive():
                    p.kill()
                    p.join()
                    print(f"{method:10s} {name:26s} HANG (killed after 15 s)")
                else:
                    print(f"{method:10s} {name:26s} {'ok' if not done.empty() and done.get() == 100 else 'failed'}")
        download_cpu(server.endpoint, Path(tmp), "straight from the server:")
        proxy = ProxyProcess(server.endpoint)
        for rate in (80e6, 300e6):
            proxy.rule(Faults(delay=0.02, rate=rate))
            download_cpu(proxy.url, Path(tmp), f"through the proxy at {rate / 1e6:.0f} MB/s:")
        proxy.stop()


def _child_entry(endpoint: str, name: str, done: mp.Queue, inherited: bool) -> None:
    get = _INHERITED[name] if inherited else clients(endpoint)[name]
    done.put(len(get(0, 100)))


if __name__ == "__main__":
    main()
