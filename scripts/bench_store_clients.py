#!/usr/bin/env python3
"""The measurement behind packer.store's client choice: range GETs through botocore's own client,
through urllib3 with botocore's SigV4 signer (what packer.store uses), and through obstore when it is
installed (`pip install obstore`; not a dependency), against SeaweedFS on 127.0.0.1; then whether
each still works in a child process (fork, spawn, forkserver) after its parent used it.

    python scripts/bench_store_clients.py

Prints per client: the latency of one 112 KB range GET, the GET rate with 16 threads, the MiB/s of
one 64 MiB object in 8 MiB parts fetched by 8 threads, and "ok" or "HANG" per start method.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.store import open_store  # noqa: E402
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


def _child_entry(endpoint: str, name: str, done: mp.Queue, inherited: bool) -> None:
    get = _INHERITED[name] if inherited else clients(endpoint)[name]
    done.put(len(get(0, 100)))


if __name__ == "__main__":
    main()
