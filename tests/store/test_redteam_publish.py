"""Red-team of the remote path, part 3: the writers' side. The lease under a skewed store clock (the
proxy rewrites the ``Date`` of its answers, the age the lease judges expiry by) and with hostile lease
documents in the bucket."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import pytest

from packer.errors import BuildError
from packer.store import open_store
from packer.store.published import LEASE, Lease, _machine

from .proxy import Faults, Proxy
from .redteam import ATTEMPT_S, in_time
from .seaweed import S3Server

TTL = 1.5  # seconds: an expiry takes a test seconds
#: Store clocks ahead of or behind the time its Last-Modified says, in seconds.
SKEWS = [-86400.0 * 365, -3600.0, -2 * TTL, -0.5, 0.5 * TTL, 2 * TTL, 3600.0, 86400.0 * 365]


def _store(s3_server: S3Server, name: str) -> Any:
    return open_store(f"s3://{s3_server.bucket}/redteam-lease/{name}")


def _each(cases: list[Any], attempt: Callable[[Any], None]) -> None:
    """``attempt(case)`` for every case at once, each in its own thread (the lease's waits are
    seconds of sleep, not work): every failure is reported with its case, and none may hang."""
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {case: pool.submit(attempt, case) for case in cases}
        failed = {}
        for case, future in futures.items():
            try:
                future.result(timeout=ATTEMPT_S)
            except Exception as e:  # every attempt's failure, reported together
                failed[case] = f"{type(e).__name__}: {str(e)[:300]}"
    assert not failed, failed


def _skewed(proxy: Proxy, s3_server: S3Server, name: str, skew: float) -> Any:
    """The store of lease ``name``, whose Date the proxy moves by ``skew`` seconds."""
    proxy.faults.append(Faults(match=f"redteam-lease/{name}/{LEASE}", date_skew=skew))
    return _store(s3_server, name)


def test_skewed_clock_never_hands_a_live_lease_over(s3_server: S3Server, proxy: Proxy) -> None:
    """For each skew: a holder renewing its lease; a second writer whose store answers with a Date
    off by ``skew`` (its lease looks older or younger than it is): the second never takes the live
    lease over (it fails in one line, or with --wait waits), the holder never loses it, and the
    waiter gets it once the holder lets go."""

    def attempt(skew: float) -> None:
        store = _skewed(proxy, s3_server, f"live{skew:+.0f}", skew)
        holder = Lease(store, ttl_s=TTL, quiet=True)
        with holder:
            with pytest.raises(BuildError, match=r"is being built by .* \(lease renewed \d+ s ago"):
                in_time(lambda: Lease(store, ttl_s=TTL, quiet=True).__enter__(), 4 * TTL)
            waiter = Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=30, quiet=True)
            got: list[float] = []

            def wait_for_it() -> None:
                waiter.__enter__()
                got.append(time.monotonic())

            t = threading.Thread(target=wait_for_it, daemon=True)
            t.start()
            time.sleep(2.5 * TTL)  # longer than the ttl: a lease judged by the skewed Date alone would go
            holder.check()  # still the holder's
            assert not got, "took over a live lease"
            left = time.monotonic()
        t.join(4 * TTL)
        assert got and got[0] >= left and not waiter.lost
        waiter.__exit__(None, None, None)

    _each(SKEWS, attempt)


def test_skewed_clock_still_takes_a_dead_lease_over(s3_server: S3Server, proxy: Proxy) -> None:
    """For each skew: a lease its holder left (another machine's, not renewed), the Date off by
    ``skew``: a writer with --wait takes it over after at most its ttl and a little (no hang), and
    not before it watched the lease unchanged for two renewal periods."""

    def attempt(skew: float) -> None:
        store = _skewed(proxy, s3_server, f"dead{skew:+.0f}", skew)
        doc = {"holder": "elsewhere pid 7", "token": "x", "since": time.time(), "ttl_s": TTL, "machine": "m", "pid": 7}
        store.put(LEASE, json.dumps(doc).encode())
        t0 = time.monotonic()
        lease = in_time(lambda: Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=30, quiet=True).__enter__(), 10 * TTL)
        took = time.monotonic() - t0
        lease.__exit__(None, None, None)
        assert 2 * TTL / 3 <= took <= 2 * TTL + 5, took

    _each(SKEWS, attempt)


HOSTILE_LEASES: dict[str, bytes] = {
    "not-json": b"{oops",
    "a-list": b"[1, 2]",
    "empty": b"",
    "ttl-text": json.dumps({"holder": "h", "ttl_s": "abc"}).encode(),
    "ttl-nan": b'{"holder": "h", "ttl_s": NaN}',
    "ttl-infinite": b'{"holder": "h", "ttl_s": 1e999}',
    "ttl-negative": json.dumps({"holder": "h", "ttl_s": -5}).encode(),
    "ttl-a-list": json.dumps({"holder": "h", "ttl_s": [1]}).encode(),
    "since-far-future": json.dumps({"holder": "h", "ttl_s": TTL, "since": 1e20}).encode(),
    "since-nan": b'{"holder": "h", "ttl_s": 1.5, "since": NaN}',
    "since-text": json.dumps({"holder": "h", "ttl_s": TTL, "since": "yesterday"}).encode(),
    "pid-huge-here": json.dumps({"holder": "h", "ttl_s": TTL, "machine": _machine(), "pid": 2**70}).encode(),
    "pid-negative-here": json.dumps({"holder": "h", "ttl_s": TTL, "machine": _machine(), "pid": -1}).encode(),
    "holder-a-megabyte": json.dumps({"holder": "h" * (1 << 20), "ttl_s": TTL}).encode(),
    "holder-multiline": json.dumps({"holder": "h\nTraceback (most recent call last):", "ttl_s": TTL}).encode(),
}


def _refused(work: Callable[[], object]) -> Optional[str]:
    """The BuildError ``work()`` (which must end within 10 ttls) fails with, None where it succeeds."""
    try:
        in_time(work, 10 * TTL)
    except BuildError as e:
        return str(e)
    return None


def test_hostile_lease_documents(s3_server: S3Server) -> None:
    """For each lease object packer did not write: a writer fails in one line (a BuildError naming
    the dataset), or takes it over at once where its ttl has passed; with --wait it takes it over
    once it expires or gives up in one line within its bound, never hangs, never crashes."""

    def attempt(kind: str) -> None:
        store = _store(s3_server, f"hostile-{kind}")
        store.put(LEASE, HOSTILE_LEASES[kind])
        busy = _refused(lambda: Lease(store, ttl_s=TTL, quiet=True).__enter__().__exit__(None, None, None))
        assert busy is None or (busy.startswith(f"{store.url} is being built by") and "\n" not in busy), busy
        assert busy is None or len(busy) < 500, "a message of the lease's own size"
        store.put(LEASE, HOSTILE_LEASES[kind])
        waited = Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=2 * TTL + 1, quiet=True)
        gave_up = _refused(lambda: waited.__enter__())
        assert gave_up is None or ("gave up waiting" in gave_up and "\n" not in gave_up), gave_up
        assert gave_up is None or len(gave_up) < 500, "a message of the lease's own size"
        if gave_up is None:
            waited.__exit__(None, None, None)
            assert list(store.list()) == []

    _each(list(HOSTILE_LEASES), attempt)
