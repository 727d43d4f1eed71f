"""The one-writer lease on the real S3 server, with real processes: one of several racing writers
wins and the others fail in one line; a holder killed with kill -9 is taken over once its lease
expires, a live one never; a lease taken from under its holder is noticed before the commit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packer.errors import BuildError
from packer.store import open_store
from packer.store.published import LEASE, Lease
from packer.store.s3 import S3Store

from .seaweed import S3Server

TTL = 2.0  # seconds: short, so that an expiry takes a test seconds, not minutes

#: A writer process: waits for the start file, takes the lease, says "won" or the one-line error,
#: and (won) holds it until its stdin closes.
WRITER = """
import os, sys, time
from packer.errors import BuildError
from packer.store import open_store
from packer.store.published import Lease
url, start, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
while not os.path.exists(start):
    time.sleep(0.005)
try:
    with Lease(open_store(url), ttl_s=ttl, quiet=True):
        print("won", flush=True)
        sys.stdin.read()
except BuildError as e:
    print(f"busy: {e}", flush=True)
"""


def _writer(url: str, start: Path, ttl: float = TTL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(start), str(ttl)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _url(s3_server: S3Server, name: str) -> str:
    return f"s3://{s3_server.bucket}/lease/{name}"


def test_racing_writers_one_wins(s3_server: S3Server, tmp_path: Path) -> None:
    url, start = _url(s3_server, "race"), tmp_path / "start"
    writers = [_writer(url, start) for _ in range(4)]
    start.touch()
    lines = {w.pid: w.stdout.readline().strip() for w in writers}  # type: ignore[union-attr]
    won = [pid for pid, line in lines.items() if line == "won"]
    assert len(won) == 1, lines
    for pid, line in lines.items():
        if pid not in won:
            assert line.startswith(f"busy: {url} is being built by {socket.gethostname()} pid {won[0]} since "), line
    for w in writers:
        w.communicate("")
        assert w.returncode == 0
    assert list(open_store(url).list()) == []  # released: deleted


def test_killed_holder_is_taken_over_after_expiry(s3_server: S3Server, tmp_path: Path) -> None:
    """A live holder is never taken over (it renews); once it is killed with kill -9, a waiting
    writer takes the lease over once it expires (its wait's timeout only bounds a hang)."""
    url, start = _url(s3_server, "killed"), tmp_path / "start"
    start.touch()
    holder = _writer(url, start)
    assert holder.stdout.readline().strip() == "won"  # type: ignore[union-attr]
    store = open_store(url)
    with pytest.raises(BuildError, match=rf"is being built by .* pid {holder.pid} since .*wait for it with --wait"):
        Lease(store, ttl_s=TTL).__enter__()
    with pytest.raises(BuildError, match=rf"pid {holder.pid} since .*gave up waiting after 5 s"):
        Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=2.5 * TTL, quiet=True).__enter__()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with Lease(store, ttl_s=TTL, wait=True, wait_timeout_s=30, quiet=True) as lease:  # 15 ttls: a hang's bound
        assert store.get(LEASE).decode().count(lease.token) == 1
        lease.check()
    assert list(store.list()) == []


def test_dead_holder_on_this_machine_is_taken_over_at_once(s3_server: S3Server, tmp_path: Path) -> None:
    """A holder of this machine killed with kill -9 is taken over without waiting out its ttl (here 10
    minutes): its pid no longer runs in this kernel's pid namespace."""
    url, start = _url(s3_server, "dead-here"), tmp_path / "start"
    start.touch()
    holder = _writer(url, start, ttl=600.0)
    assert holder.stdout.readline().strip() == "won"  # type: ignore[union-attr]
    store = open_store(url)
    with pytest.raises(BuildError, match=rf"pid {holder.pid} since "):
        Lease(store, quiet=True).__enter__()  # alive: refused
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with Lease(store, quiet=True) as lease:  # no wait=True: taken over at once
        lease.check()
    assert list(store.list()) == []


def test_lease_taken_from_under_its_holder_is_noticed(s3_server: S3Server) -> None:
    store = open_store(_url(s3_server, "lost"))
    with Lease(store, ttl_s=TTL, quiet=True) as lease:
        lease.check()
        store.put(LEASE, b'{"holder": "the other machine pid 7"}')
        deadline = time.monotonic() + 120  # bounds a hang only: the wait ends at the next renewal's refusal
        while not lease.lost:
            assert time.monotonic() < deadline, "the lease taken from under its holder was not noticed in 120 s"
            time.sleep(0.05)
        with pytest.raises(BuildError, match=r"lost its lease .* now held by the other machine pid 7\); nothing was"):
            lease.check()
    assert store.get(LEASE) == b'{"holder": "the other machine pid 7"}'  # not deleted: it is not ours


class _Unconditional(S3Store):
    """A store that ignores If-None-Match and If-Match (as some S3-compatible servers still do)."""

    def _put(self, key: str, data: bytes, headers: dict[str, str]) -> str:
        return super()._put(key, data, {k: v for k, v in headers.items() if not k.startswith("If-")})


def test_store_ignoring_conditions_is_refused_unless_unguarded(s3_server: S3Server) -> None:
    url = _url(s3_server, "unconditional")
    store = _Unconditional(url)
    with pytest.raises(BuildError, match=r"ignores conditional writes .* publish unguarded"):
        Lease(store, quiet=True).__enter__()
    assert list(store.list()) == []
    with Lease(store, unguarded=True, quiet=True):
        assert [o.key for o in store.list()] == [LEASE]
