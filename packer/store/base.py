"""What every object store provides (:class:`Store`): to the read side, the size and version of an
object, a byte range of it, a whole object with its size and version in one plain GET, and a whole
object streamed into a local file in parallel ranged parts;
to a publish (where the store is :attr:`~Store.writable`), conditional PUTs, uploads of a file in
parallel parts, deletes and listings.

The fault handling lives here, once for every store: connect and idle-read timeouts, retries with
jittered exponential backoff on what a store says is passing (5xx, 429, S3's SlowDown, a reset or
a body cut short), and a broken transfer resumed from the byte it reached, pinned to the object's
version with ``If-Match`` so that a replaced object is never spliced into the old one. What will not
pass by retrying (403, 404, a version that changed) is raised at once as :class:`StoreError`, naming
the object. A store holds no threads or connections across ``fork``: each process opens its own.

Writes retry the same way. A conditional PUT whose attempt broke after it was sent may have landed:
when the retry is then refused (412, the object is no longer what the condition named), the object is
read back, and the same bytes there mean the write was ours (:meth:`Store.put`).
"""

from __future__ import annotations

import abc
import builtins
import functools
import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

from ..errors import ObjectNotFound, PreconditionFailed, StoreError, URLNotSupported

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
#: S3's limit on the parts of one multipart upload (a larger file gets larger parts).
MAX_PARTS = 10_000


class Passing(Exception):
    """A failure that may pass on retrying: 5xx, 429, SlowDown, a reset, a timeout, a short body."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object's size and version (its ETag, "" where the store gives none); its user metadata
    (S3's ``x-amz-meta-*`` headers, names lower-case, without the prefix); when it was last written
    and the time the server answered, both by the server's clock (0.0 where it gives none): their
    difference is the object's age with no clock of this machine involved (the lease's expiry)."""

    size: int
    etag: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    modified: float = 0.0
    served: float = 0.0


@dataclass(frozen=True)
class Listed:
    """One object of a listing: its key (relative to the store's URL), size, ETag and last write."""

    key: str
    size: int
    etag: str
    modified: float


@dataclass(frozen=True)
class Upload:
    """A multipart upload begun and neither completed nor aborted (a publish that died mid-file)."""

    key: str
    upload_id: str
    initiated: float


class Store(abc.ABC):
    """One location in an object store (``url``: ``s3://bucket/prefix``, ``https://host/path``);
    objects are named relative to it. Subclasses implement :meth:`_head`, :meth:`_open` and
    :meth:`_stream`, each raising :class:`Passing` for what a retry may fix and :class:`StoreError`
    for what it will not."""

    #: Whether :meth:`put`, :meth:`put_file`, :meth:`delete` and :meth:`list` work here (a plain web
    #: server is read-only: they raise URLNotSupported).
    writable = False

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
    def _open(self, key: str, etag: str) -> tuple[ObjectInfo, Iterator[bytes]]:
        """One plain GET of the whole object (only the version ``etag`` when it is not empty): its
        size and version as the response gives them, and its body in pieces as they arrive. Fewer
        bytes than that size raise Passing."""

    @abc.abstractmethod
    def _stream(
        self, key: str, start: int, end: int, etag: str, seen: Optional[Callable[[ObjectInfo], object]] = None
    ) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (exclusive) of the object, in pieces as they arrive; only the
        version ``etag`` when it is not empty. ``seen`` is told the object's size and version as the
        response gives them, before its first piece. Fewer bytes than asked for raise Passing."""

    def head(self, key: str) -> ObjectInfo:
        return self._retrying(key, lambda: self._head(key))

    def get(self, key: str, start: int = 0, end: int | None = None, *, etag: str = "") -> bytes:
        """Bytes ``start`` to ``end`` of the object; ``end`` None: to its end, from the whole object
        read in one GET (:meth:`read`)."""
        if end is None:
            return self.read(key, etag=etag)[0][start:]
        pieces: list[bytes] = []
        self.fetch(key, start, end, etag, pieces.append)
        return b"".join(pieces)

    def read(self, key: str, *, etag: str = "") -> tuple[bytes, ObjectInfo]:
        """The whole object and its size and version, from one plain GET (only version ``etag`` when
        it is not empty): no HEAD first, so a small object costs one first-byte wait, and the bytes
        and the ETag are of one version even while a writer replaces the object. A body that breaks
        is resumed by :meth:`fetch` from the byte it reached, pinned to that response's ETag (where
        the store gives one): a replaced object is never spliced in (ObjectChanged)."""
        pieces: list[bytes] = []

        def first() -> ObjectInfo:
            info, body = self._open(key, etag)
            try:
                for piece in body:
                    pieces.append(piece)  # noqa: PERF402 (one at a time: what arrived before a break is kept)
            except Passing:
                pass  # the rest is fetched below
            return info

        info = self._retrying(key, first)
        self.fetch(key, sum(map(len, pieces)), info.size, info.etag, pieces.append)
        return b"".join(pieces), info

    def fetch(
        self,
        key: str,
        start: int,
        end: int,
        etag: str,
        sink: Callable[[bytes], object],
        *,
        seen: Optional[Callable[[ObjectInfo], object]] = None,
    ) -> None:
        """Bytes ``start`` to ``end`` of version ``etag`` of the object, given to ``sink`` in order;
        a transfer that breaks is resumed from the byte it reached. ``etag`` "": the version the
        first response gives (told to ``seen``, with the object's size), pinned for the resumptions."""
        at, pinned = [start], [etag]

        def learned(info: ObjectInfo) -> None:  # asked only while no version is pinned
            pinned[0] = info.etag
            if seen is not None:
                seen(info)

        def attempt() -> None:
            for piece in self._stream(key, at[0], end, pinned[0], learned if not pinned[0] else None):
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
        progress: Callable[[int, bytes], object] = lambda at, piece: None,
        start: int = 0,
        end: Optional[int] = None,
        part_bytes: int = PART_BYTES,
        seen: Optional[Callable[[ObjectInfo], object]] = None,
    ) -> None:
        """The object (``info``: its size and version), or its bytes ``start`` to ``end``, written
        into the open file ``fd`` from its offset 0, in parts of ``part_bytes`` fetched by up to
        :data:`PART_THREADS` threads; parts numbered in ``skip`` are already there (a download
        resumed), ``part_done(n)`` is told of each one written, ``progress(at, piece)`` of each piece
        written at offset ``at`` of ``fd`` (from the parts' threads). ``info.etag`` "": the version
        the first response gives (told to ``seen``; a HEAD's first-byte wait saved), pinned for the
        other parts, which follow the first."""
        end = info.size if end is None else end
        parts = [n for n in range(-(-(end - start) // part_bytes)) if n not in skip]
        etag = [info.etag]

        def learned(found: ObjectInfo) -> None:
            etag[0] = found.etag
            if seen is not None:
                seen(found)

        def one(n: int) -> None:
            offset = [n * part_bytes]

            def write(piece: bytes) -> None:
                written = 0
                while written < len(piece):  # a short write (a full disk) is not the piece written
                    written += os.pwrite(fd, memoryview(piece)[written:], offset[0] + written)
                progress(offset[0], piece)
                offset[0] += len(piece)

            ask = etag[0]  # "" for the first part only (the others follow it)
            self.fetch(key, start + n * part_bytes, min(end, start + (n + 1) * part_bytes), ask, write, seen=learned)
            part_done(n)

        if parts and not etag[0]:  # the version from the first part's response, then the others
            one(parts.pop(0))
        if len(parts) <= 1:
            for n in parts:
                one(n)
            return
        with ThreadPoolExecutor(min(PART_THREADS, len(parts)), thread_name_prefix="packer-download") as pool:
            for future in [pool.submit(one, n) for n in parts]:
                future.result()  # the first failure is raised; the other parts finish or fail on their own

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_match: str = "",
        if_none_match: bool = False,
        metadata: Mapping[str, str] = {},
    ) -> ObjectInfo:
        """Write ``data`` as the object in one PUT (readers see the old object or this one, whole):
        only where it is still version ``if_match``, or (``if_none_match``) where none exists yet, else
        PreconditionFailed. A retry refused after an attempt that broke once sent reads the object
        back: our own bytes there mean the first attempt landed."""
        self._check_writable()
        headers = self._put_headers(metadata)
        if if_match:
            headers["If-Match"] = if_match
        if if_none_match:
            headers["If-None-Match"] = "*"
        sent = [False]

        def attempt() -> ObjectInfo:
            try:
                etag = self._put(key, data, headers)
            except Passing:
                sent[0] = True
                raise
            except PreconditionFailed:
                if not (sent[0] and self._holds(key, data)):
                    raise
                return self.head(key)
            return ObjectInfo(len(data), etag, {k.lower(): v for k, v in metadata.items()})

        return self._retrying(key, attempt)

    def put_file(
        self,
        key: str,
        path: str | os.PathLike,
        *,
        metadata: Mapping[str, str] = {},
    ) -> ObjectInfo:
        """Upload the local file ``path`` as the object: one PUT up to :data:`PART_BYTES`, else a
        multipart upload whose parts go up to :data:`PART_THREADS` at a time, each retried on its own;
        a part that keeps failing aborts the upload (no parts left behind to pay for) and raises."""
        self._check_writable()
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= PART_BYTES:
                return self.put(key, f.read(), metadata=metadata)
            step = max(PART_BYTES, -(-size // MAX_PARTS))
            fd = f.fileno()
            upload = self._retrying(key, lambda: self._create_upload(key, self._put_headers(metadata)))
            try:

                def one(n: int) -> str:
                    data = os.pread(fd, step, n * step)
                    return self._retrying(key, lambda: self._upload_part(key, upload, n + 1, data))

                parts = -(-size // step)
                pool = ThreadPoolExecutor(min(PART_THREADS, parts), thread_name_prefix="packer-upload")
                try:
                    etags = list(pool.map(one, range(parts)))
                finally:  # a part that failed for good: the parts not begun are not sent for nothing
                    pool.shutdown(cancel_futures=True)
                expected = _multipart_etag(etags)
                sent = [False]

                def complete() -> str:
                    try:
                        return self._complete_upload(key, upload, etags)
                    except Passing:
                        sent[0] = True
                        raise
                    except ObjectNotFound:  # NoSuchUpload: an attempt that broke did complete it
                        if sent[0] and expected and self.head(key).etag.strip('"') == expected:
                            return expected
                        raise

                etag = self._retrying(key, complete)
            except BaseException:
                self._abort_quietly(key, upload)
                raise
        return ObjectInfo(size, etag, {k.lower(): v for k, v in metadata.items()})

    def delete(self, key: str, *, if_match: str = "") -> None:
        """Delete the object (one that is not there is fine); with ``if_match`` only that version of
        it (PreconditionFailed otherwise, where the store checks: S3 and SeaweedFS do)."""
        self._check_writable()
        headers = {"If-Match": if_match} if if_match else {}
        try:
            self._retrying(key, lambda: self._delete(key, headers))
        except ObjectNotFound:  # S3 answers 204 for an absent key; a store that says 404 means the same
            pass

    def list(self, prefix: str = "") -> Iterator[Listed]:
        """Every object whose key starts with ``prefix``, in key order, a page at a time."""
        self._check_writable()
        token = ""
        while True:
            page, token = self._retrying(prefix, functools.partial(self._list, prefix, token))
            yield from page
            if not token:
                return

    def uploads(self, prefix: str = "") -> builtins.list[Upload]:
        """Multipart uploads begun under ``prefix`` and never completed or aborted."""
        self._check_writable()
        return self._retrying(prefix, lambda: self._uploads(prefix))

    def abort(self, upload: Upload) -> None:
        """Abort a multipart upload, freeing its parts (one already gone is fine)."""
        self._check_writable()
        self._retrying(upload.key, lambda: self._abort_upload(upload.key, upload.upload_id))

    def _check_writable(self) -> None:
        if not self.writable:
            raise URLNotSupported(
                f"{self.url}: packer cannot write here (a web server's URL is read-only); "
                "publish to an s3:// URL (any S3-compatible store) and read it from there or over its https:// address"
            )

    @staticmethod
    def _put_headers(metadata: Mapping[str, str]) -> dict[str, str]:
        return {f"x-amz-meta-{k.lower()}": v for k, v in metadata.items()}

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether the object is there with exactly ``data`` (a PUT that broke after it was sent)."""
        try:
            return self.get(key) == data
        except ObjectNotFound:
            return False

    def _abort_quietly(self, key: str, upload: str) -> None:
        """Abort after a failure: the failure is what the caller needs to see, not a second one."""
        try:
            self._retrying(key, lambda: self._abort_upload(key, upload))
        except StoreError:
            pass  # left for `packer clean URL`, which aborts stale uploads

    # What a writable store implements; each raises Passing for what a retry may fix.
    def _put(self, key: str, data: bytes, headers: dict[str, str]) -> str:
        """One PUT of the object; its ETag."""
        raise NotImplementedError

    def _delete(self, key: str, headers: dict[str, str]) -> None:
        raise NotImplementedError

    def _list(self, prefix: str, token: str) -> tuple[builtins.list[Listed], str]:
        """One page of the listing from ``token`` ("" first), and the next page's token ("" at the end)."""
        raise NotImplementedError

    def _create_upload(self, key: str, headers: dict[str, str]) -> str:
        """A new multipart upload's id."""
        raise NotImplementedError

    def _upload_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        """Part ``number`` (from 1) of the upload; its ETag."""
        raise NotImplementedError

    def _complete_upload(self, key: str, upload: str, etags: builtins.list[str]) -> str:
        """The upload made the object from its parts, in order; the object's ETag."""
        raise NotImplementedError

    def _abort_upload(self, key: str, upload: str) -> None:
        raise NotImplementedError

    def _uploads(self, prefix: str) -> builtins.list[Upload]:
        raise NotImplementedError

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


def _multipart_etag(etags: list[str]) -> str:
    """The ETag S3 gives an object made of parts with these ETags: the MD5 of their MD5s, "-N"."""
    try:
        md5s = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    except ValueError:  # not MD5s (SSE-KMS): nothing to compare with
        return ""
    return f"{hashlib.md5(md5s).hexdigest()}-{len(etags)}"


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
