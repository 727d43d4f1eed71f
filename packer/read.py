"""Record readers, one per backend, with handles opened lazily in each process.

py-lmdb refuses to open the same files twice in a process (it keys on their device and inode) and an
environment must not be used across fork(), so LMDB environments live in a per-process registry
keyed by path: every reader over that path shares one, and a forked child drops the inherited handle
before opening its own. An entry whose data.mdb was deleted or replaced (a rebuild with --force, a
deleted temporary dataset whose inode a new one reuses) is closed rather than served stale. Readers
keep no handle in their pickled state, so they cross the spawn start method cleanly. A batch's LMDB
records are fetched by a few threads per process (see :data:`FETCH_THREADS`), each with its own
read transaction on the shared environment, as LMDB wants one transaction per thread.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import lmdb
import numpy as np

from .format import DatasetError, Manifest, lmdb_key

Buffer = memoryview  # zero-copy view of one record's bytes, valid while its reader lives

FileId = Optional[tuple[int, int]]  # (st_dev, st_ino) of data.mdb, None when it is missing
_LMDB_ENVS: dict[str, tuple[int, FileId, lmdb.Environment, lmdb.Transaction]] = {}  # path -> (pid, files, env, txn)
_LMDB_LOCK = threading.Lock()


def _files(path: str) -> FileId:
    """Identity of the environment's data file, as py-lmdb's "already open" guard sees it."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _drop_stale(pid: int) -> None:
    """Close entries inherited across fork (never to be used) and those whose files were deleted or
    replaced; the caller holds _LMDB_LOCK."""
    for path, (owner, files, env, _) in list(_LMDB_ENVS.items()):
        if owner != pid or _files(path) != files:
            del _LMDB_ENVS[path]
            try:
                env.close()
            except Exception:  # pragma: no cover - best effort on a handle we must not use
                pass


def close_lmdb(path: str | os.PathLike | None = None) -> None:
    """Close this process's shared environment for ``path`` (every one when None), e.g. before opening
    the same dataset with plain py-lmdb, which refuses a second open in one process. A reader that
    still uses it reopens on its next read."""
    with _LMDB_LOCK:
        for key in [str(Path(path).resolve())] if path is not None else list(_LMDB_ENVS):
            entry = _LMDB_ENVS.pop(key, None)
            if entry is not None:
                entry[2].close()


_PAGES_CHECKED: set[str] = set()  # data.mdb versions this process has checked or written


def _pages_key(data_mdb: str) -> str:
    """A data.mdb version: identity, size and mtime (a rename keeps it; any rewrite changes it)."""
    st = os.stat(data_mdb)
    raw = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _marker_dir() -> Path:
    return Path(os.environ.get("PACKER_CACHE_DIR") or Path.home() / ".cache" / "packer") / "lmdb-checked"


def check_lmdb_pages(path: str | os.PathLike) -> None:
    """Refuse a data.mdb with malformed pages, using py-lmdb's pure-Python verifier (py-lmdb >= 3.0).

    liblmdb trusts every page it maps, so a damaged or hostile file can crash a reader (SIGBUS,
    wild reads) instead of raising. The check reads the whole file (~16 us per record).
    """
    try:
        from lmdb.verify import VerifyError, verify as verify_pages
    except ImportError:  # py-lmdb < 3.0: nothing to check with; liblmdb's own checks still apply
        return
    data = os.path.join(path, "data.mdb")
    if not os.path.isfile(data):
        raise DatasetError(f"{path}: data.mdb is missing")
    try:
        problems = verify_pages(data, subdir=False)
    except (VerifyError, OSError) as e:
        raise DatasetError(f"{data}: not a valid LMDB file ({e})") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DatasetError(f"{data}: damaged LMDB structure: {problems[0]}{more}")


def mark_lmdb_pages_checked(path: str | os.PathLike) -> None:
    """Record that this data.mdb version is sound (checked, or just written by packer itself), so
    later opens on this machine skip the check. Best effort: an unwritable cache only costs time."""
    key = _pages_key(os.path.join(path, "data.mdb"))
    _PAGES_CHECKED.add(key)
    try:
        _marker_dir().mkdir(parents=True, exist_ok=True)
        (_marker_dir() / key).touch()
    except OSError:
        pass


def _check_pages_once(path: str) -> None:
    """check_lmdb_pages, once per data.mdb version per machine (see mark_lmdb_pages_checked)."""
    try:
        key = _pages_key(os.path.join(path, "data.mdb"))
    except OSError:
        return  # lmdb.open reports the missing file
    if key in _PAGES_CHECKED or (_marker_dir() / key).exists():
        _PAGES_CHECKED.add(key)
        return
    check_lmdb_pages(path)
    mark_lmdb_pages_checked(path)


#: Threads per process that fetch a batch's LMDB records together. py-lmdb's ``get`` touches every
#: page of a value (with the GIL released), and packer opens LMDB without readahead (random reads
#: of data bigger than RAM), so a record not in the page cache is read one page after another:
#: fetching in threads keeps that many reads in flight. Measured on a cold dataset here, 8 threads:
#: raw records 4.3x, JPEG 4.2x faster to fetch; no slower once cached.
FETCH_THREADS = 8

_FETCH = threading.local()  # per thread: {path: (env, txn)} for the fetch threads' own transactions
_POOL: tuple[int, Optional[ThreadPoolExecutor]] = (-1, None)  # (pid, executor) of this process


def _fetch_pool() -> ThreadPoolExecutor:
    """This process's fetch threads (a forked child starts its own: threads do not survive fork)."""
    global _POOL
    with _LMDB_LOCK:
        if _POOL[0] != os.getpid() or _POOL[1] is None:
            _POOL = (os.getpid(), ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="packer-fetch"))
        return _POOL[1]


def _thread_txn(path: str) -> lmdb.Transaction:
    """A read transaction of this thread on the process's environment for ``path`` (an LMDB
    transaction belongs to one thread); renewed when that environment was closed and reopened."""
    env, _ = _lmdb_env_txn(path)  # opens, or reopens a replaced dataset
    mine = _FETCH.__dict__.setdefault("txns", {})
    entry = mine.get(path)
    if entry is None or entry[0] is not env:
        entry = mine[path] = (env, env.begin(buffers=True))
    return entry[1]


def _lmdb_txn(path: str) -> lmdb.Transaction:
    """This process's long-lived read transaction for ``path`` (see :func:`_lmdb_env_txn`)."""
    return _lmdb_env_txn(path)[1]


def _lmdb_env_txn(path: str) -> tuple[lmdb.Environment, lmdb.Transaction]:
    """This process's shared read-only environment and long-lived read transaction for ``path``."""
    with _LMDB_LOCK:
        pid = os.getpid()
        entry = _LMDB_ENVS.get(path)
        if entry is not None and entry[0] == pid:
            return entry[2], entry[3]
        _drop_stale(pid)
        _check_pages_once(path)
        try:
            env = lmdb.open(
                path, readonly=True, lock=False, readahead=False, max_readers=2048, subdir=True
            )
        except lmdb.Error as e:
            raise DatasetError(f"{path}: cannot open LMDB environment ({e})") from None
        _check_lmdb_size(path, env)
        txn = env.begin(buffers=True)
        _LMDB_ENVS[path] = (pid, _files(path), env, txn)
        return env, txn


def _check_lmdb_size(path: str, env) -> None:
    """A truncated data.mdb would fault (SIGBUS) on access; refuse it up front instead."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    if size < needed:
        env.close()
        raise DatasetError(f"{path}: data.mdb is truncated ({size} bytes, needs {needed})")


class Reader:
    """Fetches record bytes by index. Subclasses open their handles on first use in each process."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> None:
        self.root = str(Path(root).resolve())
        self.manifest = manifest
        self.index = index

    def get(self, i: int) -> Buffer:
        raise NotImplementedError

    def get_many(self, indices: Sequence[int]) -> list[Buffer]:
        """Records ``indices``' bytes, fetched together (a batch's worth: fewer per-record steps).
        A DatasetError names the record it was raised for in its ``record``."""
        out = []
        for i in indices:
            try:
                out.append(self.get(i))
            except DatasetError as e:
                e.record = i if e.record is None else e.record
                raise
        return out

    def _bad(self, i: int, why: str) -> DatasetError:
        return DatasetError(f"{self.root}: record {i}: {why}", record=i)


class LmdbReader(Reader):
    def __init__(self, root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> None:
        super().__init__(root, manifest, index)
        with _LMDB_LOCK:  # a dataset opened anew may have replaced the one this process has open
            _drop_stale(os.getpid())

    def get(self, i: int) -> Buffer:
        return self._fetch([i], _lmdb_txn(self.root))[0]

    def get_many(self, indices: Sequence[int]) -> list[Buffer]:
        """A batch's records, fetched by :data:`FETCH_THREADS` threads (each every n-th record)."""
        n = FETCH_THREADS
        if n <= 1 or len(indices) < 2 * n:
            return self._fetch(indices, _lmdb_txn(self.root))
        parts = list(_fetch_pool().map(self._fetch_in_thread, [indices[k::n] for k in range(n)]))
        out: list[Buffer] = [None] * len(indices)  # type: ignore[list-item]
        for k, part in enumerate(parts):
            out[k::n] = part
        return out

    def _fetch_in_thread(self, indices: Sequence[int]) -> list[Buffer]:
        return self._fetch(indices, _thread_txn(self.root))

    def _fetch(self, indices: Sequence[int], txn: lmdb.Transaction) -> list[Buffer]:
        lengths = self.index["length"][np.asarray(indices, dtype=np.int64)].tolist()
        values = []
        for i, length in zip(indices, lengths):
            try:
                value = txn.get(lmdb_key(i))
            except lmdb.Error as e:  # a damaged B-tree (MDB_PAGE_NOTFOUND, MDB_CORRUPTED, ...)
                raise self._bad(i, f"unreadable in data.mdb ({e})") from None
            if value is None:
                raise self._bad(i, "missing from data.mdb")
            if len(value) != length:
                raise self._bad(i, f"has {len(value)} bytes, index says {length}")
            values.append(value)
        return values


class MemmapReader(Reader):
    """Records from the memmap shards. Each shard is mapped with the kernel's readahead off
    (MADV_RANDOM), and each record fetched is asked for whole (MADV_WILLNEED on its exact byte range)
    before it is read: a batch's reads are then in flight together, and nothing beyond them is read.
    With readahead on, one page fault read 8 MB around it here (the disk's read_ahead_kb): fine for a
    dataset that fits in RAM, which keeps the over-read, but ~7x slower for JPEG records (and 2x for
    raw ones) once the dataset is bigger than the page cache (docs/PERFORMANCE.md, "Cold reads")."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> None:
        super().__init__(root, manifest, index)
        self._maps: list[Optional[tuple[np.ndarray, Optional[mmap.mmap]]]] = []
        self._pid = -1

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"], state["_pid"] = [], -1
        return state

    def _shard(self, k: int) -> tuple[np.ndarray, Optional[mmap.mmap]]:
        if self._pid != os.getpid():
            self._maps, self._pid = [None] * len(self.manifest.shards), os.getpid()
        entry = self._maps[k]
        if entry is None:
            info = self.manifest.shards[k]
            path = os.path.join(self.root, str(info["file"]))
            nbytes = int(info["bytes"])
            try:
                size = os.path.getsize(path)
                if size < nbytes:
                    raise DatasetError(f"{path}: shard is truncated ({size} bytes, needs {nbytes})")
                if nbytes == 0:
                    entry = (np.zeros(0, np.uint8), None)
                else:
                    with open(path, "rb") as f:
                        mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
                    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                        mm.madvise(mmap.MADV_RANDOM)
                    entry = (np.frombuffer(mm, np.uint8), mm)
            except OSError as e:
                raise DatasetError(f"{self.root}: shard {info['file']} unreadable ({e})") from None
            self._maps[k] = entry
        return entry

    def get(self, i: int) -> Buffer:
        row = self.index[i]
        start, length = int(row["offset"]), int(row["length"])
        array, mm = self._shard(int(row["shard"]))
        if mm is not None and length and 0 <= start < len(mm) and hasattr(mmap, "MADV_WILLNEED"):
            first = start - start % mmap.PAGESIZE
            try:
                mm.madvise(mmap.MADV_WILLNEED, first, min(start + length, len(mm)) - first)
            except OSError:  # advice only: the read below still works without it
                pass
        return memoryview(array[start : start + length])


def open_reader(root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> Reader:
    cls = LmdbReader if manifest.backend == "lmdb" else MemmapReader
    return cls(root, manifest, index)
