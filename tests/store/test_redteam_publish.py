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

from packer.errors import BuildError, ObjectNotFound, PreconditionFailed, StoreError
from packer.store import open_store
from packer.store.base import ObjectInfo
from packer.store.published import LEASE, Lease, _machine
from packer.store.s3 import S3Store

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
                in_time(lambda: Lease(store, ttl_s=TTL, quiet=True).__enter__())
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
        t.join(ATTEMPT_S)  # bounds a hang only: the waiter takes the lease once the holder let go
        assert got and got[0] >= left and not waiter.lost
        waiter.__exit__(None, None, None)

    _each(SKEWS, attempt)


def test_skewed_clock_still_takes_a_dead_lease_over(s3_server: S3Server, proxy: Proxy) -> None:
    """For each skew: a lease its holder left (another machine's, not renewed), the Date off by
    ``skew``: a writer with --wait takes it over (no hang: its wait's timeout and the attempt's
    bound), and not before it watched the lease unchanged for two renewal periods."""

    def attempt(skew: float) -> None:
        store = _skewed(proxy, s3_server, f"dead{skew:+.0f}", skew)
        doc = {"holder": "elsewhere pid 7", "token": "x", "since": time.time(), "ttl_s": TTL, "machine": "m", "pid": 7}
        store.put(LEASE, json.dumps(doc).encode())
        t0 = time.monotonic()
        lease = in_time(lambda: Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=30, quiet=True).__enter__())
        took = time.monotonic() - t0
        lease.__exit__(None, None, None)
        assert took >= 2 * TTL / 3, took  # a lower bound: a slow box only waits longer

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
    "holder-escape-codes": json.dumps({"holder": "\x1b[2J\x1b[31mh\x07", "ttl_s": TTL}).encode(),
    "deep-nesting": b"[" * 100_000 + b"]" * 100_000,
    "ttl-huge-finite": json.dumps({"holder": "h", "ttl_s": 1e300}).encode(),
    "pid-true-here": json.dumps({"holder": "h", "ttl_s": TTL, "machine": _machine(), "pid": True}).encode(),
}


def _refused(work: Callable[[], object]) -> Optional[str]:
    """The BuildError ``work()`` (which must end: :func:`in_time`) fails with, None where it succeeds."""
    try:
        in_time(work)
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
        assert busy is None or busy.isprintable(), "the lease's own control characters shown"
        if kind == "ttl-huge-finite":  # taken at a day: a dead writer's lease does not keep every other out for ages
            assert busy is not None and "taken over 86400 s after" in busy, busy
        store.put(LEASE, HOSTILE_LEASES[kind])
        waited = Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=2 * TTL + 1, quiet=True)
        gave_up = _refused(lambda: waited.__enter__())
        assert gave_up is None or ("gave up waiting" in gave_up and "\n" not in gave_up), gave_up
        assert gave_up is None or len(gave_up) < 500, "a message of the lease's own size"
        if gave_up is None:
            waited.__exit__(None, None, None)
            assert list(store.list()) == []

    _each(list(HOSTILE_LEASES), attempt)


class _Lagging(S3Store):
    """A store whose reads of the lease lag its writes: a PUT If-None-Match is refused (the lease
    exists) while a GET still finds none."""

    def read(self, key: str, *, etag: str = "") -> tuple[bytes, ObjectInfo]:
        if key == LEASE:
            raise ObjectNotFound(self.name(key))
        return super().read(key, etag=etag)


def test_a_lease_refused_but_not_found_is_not_asked_forever(s3_server: S3Server) -> None:
    """A live lease that the second writer's store cannot read back: the writer gives up in one
    line (at once without --wait, at its wait timeout with it), never asks the store in a loop."""
    url = f"s3://{s3_server.bucket}/redteam-lease/lagging"
    with Lease(open_store(url), ttl_s=TTL, quiet=True):
        busy = _refused(lambda: Lease(_Lagging(url), ttl_s=TTL, quiet=True).__enter__())
        assert busy is not None and "had none to read, 5 times in a row" in busy and "\n" not in busy, busy
        waited = _refused(lambda: Lease(_Lagging(url), ttl_s=TTL, wait=True, wait_timeout_s=1, quiet=True).__enter__())
        assert waited is not None and "had none to read" in waited, waited


class _Stalling(S3Store):
    """A store whose renewals of the lease (PUT If-Match) hang once ``stall`` is set, until ``go`` is."""

    stall = threading.Event()
    go = threading.Event()

    def put(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        if key == LEASE and kw.get("if_match") and self.stall.is_set():
            self.go.wait(30)
        return super().put(key, data, **kw)


def test_a_holder_whose_renewals_hang_does_not_commit(s3_server: S3Server) -> None:
    """The holder's renewals stuck in a slow store (no answer yet, so not refused either) while a
    second writer takes the lease over as expired: the holder's check before its commit refuses,
    rather than trust a lease that is no longer its."""
    url = f"s3://{s3_server.bucket}/redteam-lease/stalling"
    store = _Stalling(url)
    try:
        with Lease(store, ttl_s=TTL, quiet=True) as holder:
            holder.check()
            store.stall.set()
            taker = in_time(
                lambda: Lease(open_store(url), ttl_s=TTL, wait=True, wait_timeout_s=30, quiet=True).__enter__()
            )
            with pytest.raises(BuildError, match=r"lost its lease \(not renewed for \d+ s"):
                holder.check()
            store.go.set()
        taker.check()  # the taker's, whole
        taker.__exit__(None, None, None)
    finally:
        store.go.set()


class _LostAnswer(S3Store):
    """A store that takes the holder's first renewal but whose answer is lost (StoreError)."""

    lost = 0

    def put(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        info = super().put(key, data, **kw)
        if key == LEASE and kw.get("if_match") and not self.lost:
            self.lost += 1
            raise StoreError(f"{self.name(key)}: connection reset (the write landed)")
        return info


def test_a_renewal_whose_answer_was_lost_keeps_the_lease(s3_server: S3Server) -> None:
    """A renewal the store wrote but whose answer never came: the next renewal is refused (the ETag
    moved) and the lease read back is the holder's own (its token): still held, not lost."""
    url = f"s3://{s3_server.bucket}/redteam-lease/lost-answer"
    store = _LostAnswer(url)
    with Lease(store, ttl_s=TTL, quiet=True) as lease:
        deadline = time.monotonic() + ATTEMPT_S  # bounds a hang only: the wait ends at the 4th renewal
        while lease._renewals < 4:
            assert time.monotonic() < deadline, f"{lease._renewals} renewals in {ATTEMPT_S:g} s"
            time.sleep(0.05)
        assert store.lost == 1 and lease._renewals >= 4
        lease.check()
    assert list(open_store(url).list()) == []  # released: ours to delete


class _Refusals(S3Store):
    """A store that notes when its first PUT If-None-Match of the lease was refused (a writer began to wait)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.refused = threading.Event()
        self.first_refused = 0.0

    def put(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        try:
            return super().put(key, data, **kw)
        except PreconditionFailed:
            if key == LEASE and kw.get("if_none_match") and not self.refused.is_set():
                self.first_refused = time.time()
                self.refused.set()
            raise


def test_a_waiter_records_when_it_took_the_lease(s3_server: S3Server) -> None:
    """A writer that waited for another's lease says in its own since when it took it, not when it
    began to wait (another writer's message would name the wrong time): later than its first
    refusal, which the holder lets go of only after it came."""
    url = f"s3://{s3_server.bucket}/redteam-lease/since"
    taken: list[Lease] = []
    store = _Refusals(url)
    with Lease(open_store(url), ttl_s=TTL, quiet=True):
        waiter = threading.Thread(
            target=lambda: taken.append(Lease(store, ttl_s=TTL, wait=True, quiet=True).__enter__())
        )
        waiter.start()
        assert store.refused.wait(ATTEMPT_S), "the waiter was never refused"
    waiter.join(ATTEMPT_S)
    assert taken, "the waiter never took the lease"
    since = json.loads(open_store(url).get(LEASE))["since"]
    taken[0].__exit__(None, None, None)
    assert since > store.first_refused, (since, store.first_refused)
