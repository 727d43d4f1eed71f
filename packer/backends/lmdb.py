"""The LMDB backend: writer, per-process readers, the sequential walk over a data file, and the checks
of its pages and keys.

py-lmdb refuses to open the same file twice in a process (it keys on its device and inode) and an
environment must not be used across fork(), so LMDB environments live in a per-process registry
keyed by each data file's identity (a dataset of several segments has several: ``data.mdb``,
``data-00001.mdb``, ...): every reader of that file shares one, whichever version of the dataset it
belongs to (a refresh links the old version's data files into the new one), a data file of another
version gets its own, and a forked child drops the inherited handles before opening its own. Each
environment's PageGuard is per file too. An environment is opened from the reader's pinned
descriptor, so it is the version the reader pinned, even once deleted. A batch's LMDB records are
fetched by a few threads per process (see :data:`FETCH_THREADS`); every thread, the caller's
included, reads through its own read transaction, as LMDB wants one transaction per thread. Before
liblmdb is asked for a record, packer.backends.lmdbguard has checked the pages the lookup will touch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import lmdb
import numpy as np

from ..format import DatasetError, LmdbLayout, Manifest, fd_path, lmdb_key, lmdb_segment_name, open_regular
from . import locality
from .base import Backend, Buffer, ExtraKeys, OnFirstUse, Pinned, Raw, Reader, Shard, close_fds
from .lmdbguard import Damaged, PageGuard
from .write import open_written

EnvKey = tuple[int, int]  # (st_dev, st_ino) of an LMDB data file: what py-lmdb's "already open" guard keys on


class _Env:
    """One open environment (one LMDB data file) in this process, and the pinned versions (readers)
    that use it: a refresh that keeps a segment file shares it between the old version and the new."""

    def __init__(self, pinned: Pinned, k: int, keys: int) -> None:
        self.pid, self.root = os.getpid(), pinned.root
        label = os.path.join(pinned.root, pinned.data_names[k])
        try:
            self.env = lmdb.open(
                pinned.data_path(k), readonly=True, lock=False, readahead=False, max_readers=2048, subdir=False
            )
        except lmdb.Error as e:
            raise DatasetError(f"{label}: cannot open LMDB environment ({e})") from None
        try:
            self.guard = PageGuard(pinned.data_fds[k], keys)
        except Damaged as e:
            self.env.close()
            raise DatasetError(f"{label}: {e}") from None
        if isinstance(self.guard.mm, mmap.mmap):  # a walk reads its page, not the readahead around it
            self.guard.mm.madvise(mmap.MADV_RANDOM)  # (docs/PERFORMANCE.md, "Block order")
        self.users: weakref.WeakSet[Pinned] = weakref.WeakSet([pinned])
        self.closed = False

    def close(self) -> None:
        """Close the environment (liblmdb's descriptor and map, and with them every transaction on
        it: none is used again, see _thread_txn) and the guard's mapping: nothing of the file stays
        mapped, so the disk space of an evicted file is freed with this (packer.read.remote)."""
        self.closed = True
        try:
            self.env.close()
        except Exception:  # pragma: no cover - best effort on a handle we must not use
            pass
        if isinstance(self.guard.mm, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view of it still alive: it goes with that view
                self.guard.mm.close()


_LMDB_ENVS: dict[EnvKey, _Env] = {}
_LMDB_LOCK = threading.Lock()


def _drop(root: Optional[str] = None, everything: bool = False, key: Optional[EnvKey] = None) -> None:
    """Close environments inherited across fork (never to be used) and those no live reader uses
    (``root``/``key``/``everything``: those of that path / that file / all of them); the caller
    holds _LMDB_LOCK."""
    pid = os.getpid()
    for k, entry in list(_LMDB_ENVS.items()):
        if entry.pid != pid or not entry.users or everything or entry.root == root or k == key:
            del _LMDB_ENVS[k]
            entry.close()


def close_lmdb(path: str | os.PathLike | None = None, file: Optional[EnvKey] = None) -> None:
    """Close this process's environments for the dataset at ``path`` and the data file whose
    (st_dev, st_ino) is ``file`` (every one when neither is given), e.g. before opening it with plain
    py-lmdb, which refuses a second open in one process. A reader that still uses one reopens it,
    from its pinned descriptor, on its next read."""
    with _LMDB_LOCK:
        _drop(
            root=str(Path(path).resolve()) if path is not None else None,
            everything=path is None and file is None,
            key=file,
        )


def check_lmdb_pages(path: str | os.PathLike, label: str | os.PathLike = "") -> None:
    """Refuse a data.mdb with malformed pages anywhere, using py-lmdb's pure-Python verifier
    (py-lmdb >= 3.0): ``packer verify``'s whole-file check (a pass over every page). ``path`` is the
    environment directory, or the data file itself; ``label`` names it in errors."""
    try:
        from lmdb.verify import VerifyError
        from lmdb.verify import verify as verify_pages
    except ImportError:  # py-lmdb < 3.0: nothing to check with; the read path's PageGuard still applies
        return
    data = str(path) if not os.path.isdir(path) else os.path.join(path, "data.mdb")
    label = label or data
    if not os.path.isfile(data):
        raise DatasetError(f"{path}: data.mdb is missing")
    try:
        problems = verify_pages(data, subdir=False)
    except (VerifyError, OSError) as e:
        raise DatasetError(f"{label}: not a valid LMDB file ({e})") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DatasetError(f"{label}: damaged LMDB structure: {problems[0]}{more}")


def check_lmdb_tree(data: str | os.PathLike) -> None:
    """Refuse the LMDB data file ``data`` unless every branch and leaf page is sound and every value
    lies inside the file (packer.backends.lmdbguard; cost in docs/PERFORMANCE.md): what must hold before a
    cursor walks all its keys (packer.backends.walk), whatever the file's mtime."""
    try:
        fd = open_regular(data)
    except FileNotFoundError:
        raise DatasetError(f"{data}: missing") from None
    try:
        PageGuard(fd, 0).check_tree()
    except Damaged as e:
        raise DatasetError(f"{data}: damaged LMDB structure ({e})") from None
    finally:
        os.close(fd)


#: Threads per process that fetch a batch's LMDB records together. py-lmdb's ``get`` touches every
#: page of a value (with the GIL released), and packer opens LMDB without readahead (random reads
#: of data bigger than RAM), so a record not in the page cache is read one page after another:
#: fetching in threads keeps that many reads in flight: much faster cold, no slower once cached
#: (measured: docs/PERFORMANCE.md, "Cold reads").
FETCH_THREADS = 8

_TXNS = threading.local()  # per thread: {id(_Env): (_Env, txn)}, the thread's own read transactions
_POOL: tuple[int, Optional[ThreadPoolExecutor]] = (-1, None)  # (pid, executor) of this process


def _fetch_pool() -> ThreadPoolExecutor:
    """This process's fetch threads (a forked child starts its own: threads do not survive fork)."""
    global _POOL
    with _LMDB_LOCK:
        pid, pool = _POOL
        if pid != os.getpid() or pool is None:
            pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="packer-fetch")
            _POOL = (os.getpid(), pool)
        return pool


def _lmdb_env(pinned: Pinned, k: int, keys: int) -> _Env:
    """This process's environment for ``pinned``'s LMDB data file ``k``: shared by the readers of
    that file, opened (from the pinned descriptor) on first use in each process; its PageGuard
    covers at least key numbers below ``keys``."""
    key = pinned.data_key(k)[:2]
    with _LMDB_LOCK:
        entry = _LMDB_ENVS.get(key)
        if entry is not None and entry.pid == os.getpid():
            entry.users.add(pinned)
            entry.guard.reserve(keys)
            return entry
        _drop()
        entry = _LMDB_ENVS[key] = _Env(pinned, k, keys)
        return entry


def _thread_txn(entry: _Env) -> lmdb.Transaction:
    """This thread's read transaction on ``entry`` (an LMDB transaction belongs to one thread);
    renewed when that file's environment was closed and reopened. Keyed by the entry and checked to
    be that entry, open: a closed one's transaction is never used, even where a new environment
    gets its number; those of closed environments are dropped when this thread begins another."""
    mine = _TXNS.__dict__.setdefault("txns", {})
    held = mine.get(id(entry))
    if held is None or held[0] is not entry or entry.closed:
        for old in [k for k, (other, _) in mine.items() if other.closed]:
            del mine[old]
        held = mine[id(entry)] = (entry, entry.env.begin(buffers=True))
    return held[1]


def _forget_txn(entry: _Env) -> None:
    """Drop this thread's transaction after an LMDB error: liblmdb marks it unusable (MDB_BAD_TXN)."""
    _TXNS.__dict__.setdefault("txns", {}).pop(id(entry), None)


class LmdbReader(Reader):
    """Records from the LMDB data files: row ``i`` is key ``offset`` of segment ``shard`` (versions 1
    and 2: key ``i`` of data.mdb; :func:`packer.format.record_places`), looked up per batch."""

    def __init__(self, pinned: Pinned, index: Optional[np.ndarray] = None) -> None:
        super().__init__(pinned, index)
        self._legacy = self.manifest.format_version < 3
        top = np.zeros(len(pinned.data_fds), np.int64)  # per data file: the largest key named, plus one
        if len(self.index) and self._legacy:
            top[0] = len(self.index)
        elif len(self.index):
            np.maximum.at(top, self.index["shard"], self.index["offset"].astype(np.int64) + 1)
        self._top = top.tolist()
        self._guard_keys: dict[int, int] = {}

    def _places(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``at``'s (data file, key number)."""
        if self._legacy:
            return np.zeros(len(at), np.int64), at
        rows = self.index[at]
        return rows["shard"].astype(np.int64), rows["offset"].astype(np.int64)

    def _env(self, k: int) -> _Env:
        keys = self._guard_keys.get(k)
        if keys is None:
            # PageGuard keeps a length per key number: as many as this version names, and no more than
            # the file can hold (a leaf entry takes over 16 bytes), so a tampered key allocates nothing.
            # Per file on first use: a remote dataset's data file is fetched then (packer.read.remote).
            size = os.fstat(self.pinned.data_fds[k]).st_size
            keys = self._guard_keys[k] = min(self._top[k], size // 16 + 1)
        return _lmdb_env(self.pinned, k, keys)

    def get(self, i: int) -> Buffer:
        return self._fetch([i])[0]

    def get_many(self, indices: Sequence[int]) -> list[Buffer]:
        """A batch's records, fetched by :data:`FETCH_THREADS` threads (each every n-th record)."""
        n = FETCH_THREADS
        self._check_pages(indices)  # in this thread, once: the walk is Python, under the GIL anyway
        if n <= 1 or len(indices) < 2 * n:
            return self._fetch(indices)
        parts = list(_fetch_pool().map(self._fetch, [indices[k::n] for k in range(n)]))
        out: list[Buffer] = [None] * len(indices)  # type: ignore[list-item]
        for k, part in enumerate(parts):
            out[k::n] = part
        return out

    def _check_pages(self, indices: Sequence[int]) -> None:
        """Refuse a record whose way through its data file is damaged, or whose value is not as long
        as the index says, before liblmdb touches it (see packer.backends.lmdbguard)."""
        at = np.asarray(indices, dtype=np.int64)
        segments, keys = self._places(at)
        wanted = self.index["length"][at].astype(np.int64)
        for k in np.unique(segments).tolist():
            guard = self._env(k).guard
            mine = np.flatnonzero(segments == k)
            known = guard.known(keys[mine])
            for j in mine[known != wanted[mine]].tolist():
                i, name = int(at[j]), self.pinned.data_names[k]
                try:
                    found = guard.length(int(keys[j]))
                except Damaged as e:
                    raise self._bad(i, f"damaged LMDB structure in {name} ({e})") from None
                if found is None:
                    raise self._bad(i, f"missing from {name}")
                if found != wanted[j]:
                    raise self._bad(i, f"has {found} bytes, index says {int(wanted[j])}")

    def _fetch(self, indices: Sequence[int]) -> list[Buffer]:
        self._check_pages(indices)
        values: list[Buffer] = []
        entries: dict[int, _Env] = {}
        segments, keys = self._places(np.asarray(indices, dtype=np.int64))
        for i, k, key in zip(indices, segments.tolist(), keys.tolist()):
            entry = entries.get(k) or entries.setdefault(k, self._env(k))
            try:
                value = _thread_txn(entry).get(lmdb_key(key))
            except lmdb.Error as e:  # a damaged B-tree (MDB_PAGE_NOTFOUND, MDB_CORRUPTED, ...)
                _forget_txn(entry)
                raise self._bad(i, f"unreadable in {self.pinned.data_names[k]} ({e})") from None
            if value is None:  # the guard found it: only a file changed under a running reader gets here
                raise self._bad(i, f"missing from {self.pinned.data_names[k]}")
            # lmdb's stub says bytes | memoryview; a buffers=True transaction returns a memoryview
            values.append(value)  # type: ignore[arg-type]
        return values

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Records written in key order (packer's builds append) lie in key order in their data
        file: a block's values (their overflow pages, the places packer.backends.lmdbguard's walk finds) are
        one run of it, asked of the pinned descriptor with posix_fadvise."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        segments, keys = self._places(locality.records(ranges, len(self.index)))
        for k in np.unique(segments).tolist():
            offsets, lengths = self._env(k).guard.extents(keys[segments == k])
            size = locality.advice_bytes(self.pinned.data_key(k)[0])
            for start, length in locality.pieces(locality.runs(offsets, lengths), size):
                advise(self.pinned.data_fds[k], start, length, os.POSIX_FADV_WILLNEED)

    def txn(self, k: int = 0) -> lmdb.Transaction:
        """This thread's read transaction on data file ``k`` (segment 0: data.mdb)."""
        return _thread_txn(self._env(k))


class LmdbWriter:
    """Sequential keys with ``append=True`` and batched commits; MapFullError grows the map and replays.

    The uncommitted batch is kept until its commit succeeds, so a MapFullError raised by ``put`` or by
    ``commit`` loses nothing: the transaction is aborted, the map doubled outside any transaction, and
    the whole batch written again (tensorpack #1562 dropped records here; Caffe #3731 did this).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | None = None,
        map_size: int = 1 << 30,
        batch_records: int = 1000,
        batch_bytes: int = 64 << 20,
        segment: int = 0,
    ) -> None:
        # segment k of the dataset at ``path`` (docs/FORMAT.md "Segments"): one LMDB file of its own,
        # without a lock file (packer's readers open data files lock-free; the build lock keeps out
        # a second writer)
        self.root, self.segment, self.name = Path(path), segment, lmdb_segment_name(segment)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = str(self.root / self.name)
        # liblmdb opens a path itself: give it the file packer opened (created, or checked: see
        # open_written), by a path that cannot lead anywhere else
        self._fd = open_written(self.path, new=state is None)
        try:
            self.env = lmdb.open(
                fd_path(self._fd) or self.path,
                map_size=map_size,
                subdir=False,
                lock=False,
                sync=False,
                metasync=False,
                meminit=False,
                max_dbs=0,
                readahead=False,
            )
        except BaseException:
            os.close(self._fd)
            raise
        self.count = int(state["count"]) if state else 0
        self._discard_from(self.count)
        self.batch_records, self.batch_bytes = batch_records, batch_bytes
        self._batch: list[bytes] = []
        self._batch_size = 0

    def _discard_from(self, start: int) -> None:
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(lmdb_key(start)):
                while cursor.delete():
                    pass

    def append(self, data: bytes) -> tuple[int, int]:
        """Where the record goes: (segment, key number)."""
        key = self.count + len(self._batch)
        self._batch.append(data)
        self._batch_size += len(data)
        if len(self._batch) >= self.batch_records or self._batch_size >= self.batch_bytes:
            self._commit()
        return self.segment, key

    def _commit(self) -> None:
        if not self._batch:
            return
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for i, data in enumerate(self._batch):
                        txn.put(lmdb_key(self.count + i), data, append=True)
                break
            except lmdb.MapFullError:  # raised by put or by the commit; the txn was aborted
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
        self.count += len(self._batch)
        self._batch, self._batch_size = [], 0

    def checkpoint(self) -> dict[str, Any]:
        self._commit()
        self.env.sync(True)
        return {"count": self.count}

    def close(self) -> list[dict[str, Any]]:
        """The data file written: ``[{"file", "count", "bytes"}]`` (the manifest's ``shards``)."""
        self.checkpoint()
        self.env.close()
        size = os.fstat(self._fd).st_size
        os.close(self._fd)
        return [{"file": self.name, "count": self.count, "bytes": size}]


def _walk(
    path: Path, rows: np.ndarray, keys: np.ndarray, extra_keys: Optional[ExtraKeys]
) -> Generator[Raw, None, None]:
    """A cursor over the keys of one LMDB data file in key order, through an environment with readahead
    on; ``rows`` (sorted by their ``keys``) get their values, or None where the file lacks the key."""
    try:
        fd = open_regular(path)  # the dataset's own file, not what a symlink there leads to
    except FileNotFoundError:
        yield from ((i, None) for i in rows.tolist())
        return
    try:
        st = os.fstat(fd)
        close_lmdb(path.parent, file=(st.st_dev, st.st_ino))  # py-lmdb opens a file once per process
        where = fd_path(fd) or str(path)
        env = lmdb.open(where, readonly=True, lock=False, readahead=True, subdir=False, max_readers=8)
    except lmdb.Error as e:
        raise DatasetError(f"{path}: cannot open LMDB environment ({e})") from None
    finally:
        os.close(fd)  # liblmdb holds its own
    extra = extra_bytes = 0
    wanted, numbers = keys.tolist(), rows.tolist()
    at = 0  # the next row to serve
    try:
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                k = _key_number(bytes(key))
                while at < len(wanted) and k is not None and wanted[at] < k:  # keys the file lacks
                    yield numbers[at], None
                    at += 1
                if k is None or at == len(wanted) or wanted[at] != k:
                    extra += 1
                    extra_bytes += len(value)
                    continue
                while at < len(wanted) and wanted[at] == k:
                    yield numbers[at], value
                    at += 1
            while at < len(wanted):
                yield numbers[at], None
                at += 1
    except lmdb.Error as e:
        raise DatasetError(f"{path}: damaged ({e})") from None
    finally:
        env.close()
    if extra and extra_keys is not None:
        extra_keys(path.name, extra, extra_bytes)


def _key_number(key: bytes) -> Optional[int]:
    """The record number of a packer key (``lmdb_key``), or None for any other key."""
    return int(key) if len(key) == len(lmdb_key(0)) and key.isdigit() else None


class Lmdb(LmdbLayout, Backend):
    """LMDB: one file per segment (data.mdb, data-NNNNN.mdb), record ``i`` under key ``offset`` of
    file ``shard``; versions 1 and 2: data.mdb alone, record ``i`` under key ``i``."""

    suffix, keyed = ".lmdb", True
    write_errors = (lmdb.Error,)
    cold_advice = ("memmap shards read from disk faster than LMDB (`--backend memmap`)",)
    reader = LmdbReader

    def open_writer(
        self, path: str | os.PathLike, state: Optional[dict[str, Any]], shard_size: int, first: int = 0, size: int = 0
    ) -> LmdbWriter:
        return LmdbWriter(
            path, state, map_size=max(1 << 30, int(size * 1.25) + (64 << 20)) if size else 1 << 30, segment=first
        )

    def written_from(self, root: Path, first: int) -> list[Path]:
        return [root / lmdb_segment_name(first)]  # one segment per write

    def pin_files(
        self, root: str, manifest: Manifest, open_file: Callable[[str], int], *, lazy: bool = False
    ) -> tuple[Sequence[int], Sequence[Shard]]:
        names = self.data_files(manifest)
        if lazy:
            return OnFirstUse(len(names), lambda k: open_file(names[k])), []
        fds: list[int] = []
        try:
            for name in names:
                fds.append(open_file(name))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds, []

    def walk_file(
        self, path: Path, rows: np.ndarray, positions: np.ndarray, lengths: np.ndarray, extra: Optional[ExtraKeys]
    ) -> Generator[Raw, None, None]:
        return _walk(path, rows, positions, extra)

    def check_walkable(self, path: Path) -> None:
        check_lmdb_tree(path)

    def check_files(self, root: Path, manifest: Manifest) -> list[str]:
        for name in self.data_files(manifest):  # before liblmdb maps a file: a damaged page must not crash verify
            check_lmdb_pages(root / name)
        return []

    def close(self, root: Optional[str | os.PathLike] = None) -> None:
        close_lmdb(root)

    def let_go_files(self, pinned: Pinned) -> None:
        """Each data file's environment closed too, unless another reader in this process uses it
        (another dataset object of that file, which lets go of it in turn)."""
        if not isinstance(pinned.data_fds, OnFirstUse):
            return
        opened = pinned.data_fds.forget()
        with _LMDB_LOCK:
            for k in opened:
                entry = _LMDB_ENVS.get(pinned.files[pinned.data_names[k]][:2])
                if entry is not None:
                    entry.users.discard(pinned)
            _drop()  # those no reader uses now (and any inherited across fork)
        close_fds(list(opened.values()))
