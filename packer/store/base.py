"""What every object store provides to the read side (:class:`Store`): the size and version of an
object, a byte range of it, and a whole object streamed into a local file in parallel ranged parts.

The fault handling lives here, once for every store: connect and idle-read timeouts, retries with
jittered exponential backoff on what a store says is passing (5xx, 429, S3's SlowDown, a reset or
a body cut short), and a broken transfer resumed from the byte it reached, pinned to the object's
version with ``If-Match`` so that a replaced object is never spliced into the old one. What will not
pass by retrying (403, 404, a version that changed) is raised at once as :class:`StoreError`, naming
the object. A store holds no threads or connections across ``fork``: each process opens its own.
"""

from __future__ import annotations

import abc
import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

from ..errors import StoreError

T = TypeVar("T")

#: Attempts per request (the first included) before a passing failure is given up as a StoreError.
ATTEMPTS = 6
BACKOFF_S = 0.1  # the first retry's longest wait; doubled per attempt (full jitter), at most BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0  # the longest a response may stay silent (first byte, or between two reads)
#: Bytes per ranged part of a download; parts in flight at once per download (AWS advises 8-16 MB
#: ranges, and one connection is throughput-capped).
PART_BYTES = 8 << 20
PART_THREADS = 8


class Passing(Exception):
    """A failure that may pass on retrying: 5xx, 429, SlowDown, a reset, a timeout, a short body."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object's size and version (its ETag, "" where the store gives none)."""

    size: int
    etag: str


class Store(abc.ABC):
    """One location in an object store (``url``: ``s3://bucket/prefix``, ``https://host/path``);
    objects are named relative to it. Subclasses implement :meth:`_head` and :meth:`_stream`, each
    raising :class:`Passing` for what a retry may fix and :class:`StoreError` for what it will not."""

    def __init__(self, url: str, *, settings: Optional[dict[str, Any]] = None) -> None:
        self.url = url.rstrip("/")

    def settings(self) -> dict[str, Any]:
        """What this store resolved from its process's environment (endpoint, region, credentials),
        as plain values: ``open_store(url, settings=...)`` in another process (a DataLoader worker)
        reaches the same store even where that process's environment differs (a forkserver started
        before the variables were set)."""
        return {}

    def name(self, key: str) -> str:
        """The object's URL, for messages."""
        return f"{self.url}/{key}"

    @abc.abstractmethod
    def _head(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    def _stream(self, key: str, start: int, end: int, etag: str) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (exclusive) of the object, in pieces as they arrive; only the
        version ``etag`` when it is not empty. Fewer bytes than asked for raise Passing."""

    def head(self, key: str) -> ObjectInfo:
        return self._retrying(key, lambda: self._head(key))

    def get(self, key: str, start: int = 0, end: int | None = None, *, etag: str = "") -> bytes:
        """Bytes ``start`` to ``end`` (the object's end when None: one HEAD first) of the object."""
        if end is None:
            info = self.head(key)
            end, etag = info.size, etag or info.etag
        pieces: list[bytes] = []
        self.fetch(key, start, end, etag, pieces.append)
        return b"".join(pieces)

    def fetch(self, key: str, start: int, end: int, etag: str, sink: Callable[[bytes], object]) -> None:
        """Bytes ``start`` to ``end`` of version ``etag`` of the object, given to ``sink`` in order;
        a transfer that breaks is resumed from the byte it reached."""
        at = [start]

        def attempt() -> None:
            for piece in self._stream(key, at[0], end, etag):
                sink(piece)
                at[0] += len(piece)

        self._retrying(key, attempt, done=lambda: at[0] >= end, progress=lambda: at[0])

    def download(
        self,
        key: str,
        fd: int,
        info: ObjectInfo,
        *,
        skip: frozenset[int] = frozenset(),
        part_done: Callable[[int], object] = lambda part: None,
        start: int = 0,
        end: Optional[int] = None,
    ) -> None:
        """The object (``info``: its size and version), or its bytes ``start`` to ``end``, written
        into the open file ``fd`` from its offset 0, in parts of :data:`PART_BYTES` fetched by up to
        :data:`PART_THREADS` threads; parts numbered in ``skip`` are already there (a download
        resumed), ``part_done(n)`` is told of each one written."""
        end = info.size if end is None else end
        parts = [n for n in range(-(-(end - start) // PART_BYTES)) if n not in skip]

        def one(n: int) -> None:
            offset = [n * PART_BYTES]

            def write(piece: bytes) -> None:
                os.pwrite(fd, piece, offset[0])
                offset[0] += len(piece)

            self.fetch(key, start + n * PART_BYTES, min(end, start + (n + 1) * PART_BYTES), info.etag, write)
            part_done(n)

        if len(parts) <= 1:
            for n in parts:
                one(n)
            return
        with ThreadPoolExecutor(min(PART_THREADS, len(parts)), thread_name_prefix="packer-download") as pool:
            for future in [pool.submit(one, n) for n in parts]:
                future.result()  # the first failure is raised; the other parts finish or fail on their own

    def _retrying(
        self,
        key: str,
        attempt: Callable[[], T],
        done: Callable[[], bool] = lambda: False,
        progress: Callable[[], int] = lambda: 0,
    ) -> T:
        """``attempt()``, tried again with backoff while it raises Passing (and ``done()`` is false:
        what was read before a failure is kept), until :data:`ATTEMPTS` failures in a row made no
        ``progress()`` (bytes received)."""
        failures, reached = 0, progress()
        while True:
            try:
                return attempt()
            except Passing as e:
                if done():
                    return None  # type: ignore[return-value]  # fetch's attempt returns None anyway
                if progress() != reached:
                    failures, reached = 0, progress()
                failures += 1
                if failures == ATTEMPTS:
                    raise StoreError(f"{self.name(key)}: failed {ATTEMPTS} times, last: {e}") from None
                time.sleep(random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (failures - 1))))


class PerProcess(Generic[T]):
    """One value per process (a connection pool): a forked child must not use its parent's sockets,
    so it makes its own on first use. No lock: two threads racing make two, and one is kept."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._mine: tuple[int, T] | None = None

    def get(self) -> T:
        mine = self._mine
        if mine is None or mine[0] != os.getpid():
            mine = self._mine = (os.getpid(), self._make())
        return mine[1]
