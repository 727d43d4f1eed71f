"""Datasets in object storage (``s3://bucket/prefix/train.lmdb``, ``https://...``), read through a
node-local cache that the readers open as a local dataset.

A dataset URL resolves to a directory of the cache holding one version: its manifest, index and
label arrays, fetched and checked against the manifest's digests when the version is first opened
on the node, and its data, fetched in units when a reader first needs them and hard-linked in. The
readers (packer.backends) then read local files as they read any dataset; nothing of the store
reaches them.

- **Units**: an LMDB segment is fetched whole (packer.pin's ``fetch``: the environment maps the
  file). A memmap shard is fetched in ranges of a power of two records (about :data:`UNIT_BYTES`;
  global record numbers ``u * per_unit`` and up, cut at shard ends, so ShardSampler's blocks of a
  power of two records up to that never straddle two units), each its own file
  ``FILE@START-END`` (a whole shard is named as its file): one file per range, not a sparse file
  per shard, so that a unit is evicted, held and counted as a file (unlink, flock, size) with
  no byte-range locks or hole punching, and a unit never exists in part. The reader maps each
  unit as it first reads a record of it (:class:`_RangedShard`). A unit is downloaded in
  :data:`UNIT_STREAMS` parallel ranged parts (packer.store.base; parts of at most its
  ``PART_BYTES``) into ``partial/``, then renamed into ``units/``. A broken part is resumed from
  the byte it reached (``If-Match`` pins the object's version); parts already written by a process
  that died are kept and skipped (``.parts`` lists them, after the part size they were cut at).
  A memmap unit asks no HEAD first: the manifest lists its shard's size, and its GET's response
  gives the version, which the shard's other units then ask ``If-Match``.
- **Checked before any decoder sees a byte**: the size against the manifest, then every record the
  version's index names in the unit by length and CRC-32 (a memmap unit's computed as its bytes
  are written; LMDB files after their page tree is checked, as ``packer verify`` does); a mismatch
  is fetched again, up to :data:`VERIFY_ATTEMPTS` times, then a DatasetError names the object and
  the record.
- **Versions**: the version directory is keyed by the manifest's sha256 and units by file name,
  size and ETag, so a refreshed dataset gets a new version directory that reuses every unchanged
  segment (a sidecar lists the records each unit was checked for) and never serves a byte of the
  old one; a ShardDataset keeps reading the version it opened (its pickled copies reopen that one).
- **One fetch per node**: every process of the node (ranks, DataLoader workers) takes the file
  lock of a unit (flock: released by the kernel when its holder dies) before fetching it, and finds
  it fetched once the lock is theirs. Nothing is kept in shared memory.
- **Who fetches**: ShardSampler's next blocks are fetched by the process that iterates the sampler
  (with DataLoader workers: the training process), in its background threads, the unit needed
  next first; the workers that decode find their units cached or wait for the fetch in flight, so
  a download's receiving, writing and checking take no CPU from them. The prefetches of a process
  receive in the order they are needed, one unit at a time while one stream alone outpaces the
  readers (:class:`_Turns`): the next one's GET goes out as the one before it is a first-byte
  wait from its end, so the store's latency is covered and the unit needed next does not share
  the bandwidth with ones needed after it (four at once, the first of them came when all four
  did); where one stream is slower than the readers consume, as many receive at once as they
  need. A batch whose unit is neither (the first ones, a sampler that announces nothing) is
  fetched by the process reading it; a process that reads its batches itself (no workers)
  fetches the next blocks after each batch's own.
- **cache_limit**: units no reader holds are evicted before a download would take the cache (every
  dataset under ``cache_dir``) past the limit; a download reserves its whole size first, so
  concurrent fetches never overshoot. Eviction takes first the units this process knows no next use
  of (other datasets, blocks already read), least recently opened first, then those the sampler's
  next blocks (a Draw's ``ahead``) need, the one needed furthest in the future first (Belady);
  units whose records this process has not all read this epoch come after the announced ones. A
  background prefetch takes free room or evicts units of no known next use only, else it leaves
  the unit to the batch that needs it. The room a failed or killed download reserved goes first
  (no process holds its unit's lock). A limit below one unit is refused at once; a batch that
  cannot make room lets go of its own units (they are opened again, fetched again if evicted
  meanwhile), so two batches never wait on each other, and waits up to :data:`ROOM_WAIT` seconds
  for other readers to let go, then fails clearly. Every count of the cache and every change to
  it (a reservation, an eviction, a download renamed into ``units/``) is under one lock.
- **Holding and letting go**: a process holds a unit (a shared flock on its own descriptor: no
  process evicts it; the kernel drops it if the holder dies) from before its download is renamed
  into ``units/`` (so none evicts it between its arrival and its first use), or from when it
  opens it; a forked child closes the holds it inherited (it holds only what it opens itself).
  A memmap reader lets go after each batch (:meth:`Remote.release`; a dataset has thousands of
  units, more than ``ulimit -n`` would let it hold): without a limit it keeps its mappings (a unit
  evicted by another process's limit stays readable through them); with a limit the unit's
  mapping is dropped first, then the flock, and the next batch that needs it opens (or fetches)
  it again. Eviction unlinks a
  unit only under an exclusive flock, so never one that a reader holds or is reading; a buffer of a
  released unit that a caller still keeps stays valid (an unlinked file stays readable through its
  mapping on Linux; its disk space is freed with the last mapping). LMDB readers keep their
  environments open, so they hold every segment they opened until the dataset goes: each thread
  keeps a long-lived read transaction per environment whose buffers are zero-copy views of the
  map, and an environment closed while another thread's transaction or a caller's view is alive
  is a use-after-unmap, so no batch boundary of one thread is a safe point to close it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import glob
import hashlib
import math
import mmap
import os
import re
import shutil
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar, cast

import numpy as np

from ..backends import BACKENDS, Backend, data_files, record_places
from ..backends.base import FileKey, Pinned, Shard
from ..backends.memmap import Mapping
from ..backends.pin import pin
from ..format import (
    INDEX,
    LABELS,
    MANIFEST,
    SOURCES,
    TARGETS,
    DatasetError,
    Manifest,
    index_digest,
    logical_digest,
    map_npy,
    open_regular,
)
from ..format.label_arrays import arrays_digest
from ..store import ObjectChanged, ObjectNotFound, Store, open_store
from ..store import base as store_base
from ..store.base import ObjectInfo, PerProcess
from ..store.published import FILES, files_json, parse_files, read_files, read_pointer, version_key

#: Units a process prepares at once in the background (the cache's room, the download, the check);
#: their downloads take turns (:class:`_Turns`).
PREFETCH_UNITS = 4
#: Ranged GETs a unit is downloaded in at once (parts of at most packer.store.base.PART_BYTES;
#: larger units, LMDB files, in more): one fills a node's bandwidth alone, and more cost the store
#: and this process CPU (docs/PERFORMANCE.md, "A cold first epoch from S3"); more are for a store
#: whose one stream is slower than the readers consume.
UNIT_STREAMS = 1
#: About the bytes of a memmap unit: a range of a shard of a power of two records (AWS advises
#: 8-16 MB ranges), whole shards when they are smaller.
UNIT_BYTES = 8 << 20
#: Downloads of a unit (or of a version's index) whose bytes do not match the manifest, before the
#: DatasetError: a transfer damaged on the way is fetched again, a damaged object fails.
VERIFY_ATTEMPTS = 3
#: Seconds a batch's download waits for other readers to let go of units when the cache is full.
ROOM_WAIT = 60.0
_UNITS, _PARTIAL, _VERSIONS, _LOCKS = "units", "partial", "versions", "locks"
_SIDECAR = ".rows.npy"  # per unit: (position, length, crc32) of the records it was checked for
_ROWS_DTYPE = np.dtype([("position", "<i8"), ("length", "<u8"), ("crc32", "<u4")])
#: A unit's backend, the index rows it holds, and their (position, length, crc32) sorted by position.
_Expected = tuple[Backend, np.ndarray, np.ndarray]
T = TypeVar("T")
_UNITS_LIMIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def default_cache_dir() -> Path:
    """``$PACKER_CACHE_DIR``, else ``packer`` in the user's cache directory ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get("PACKER_CACHE_DIR"):
        return Path(os.environ["PACKER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packer"


def parse_limit(limit: int | str | None) -> Optional[int]:
    """Bytes from ``cache_limit``: an int, or text like "200GB" (powers of 1000) or "1.5GiB" (of 1024)."""
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool)):
        if limit is not None and limit <= 0:
            raise ValueError(f"cache_limit must be positive, not {limit}")
        return limit
    found = _UNITS_LIMIT.match(str(limit))
    if not found:
        raise ValueError(f"cache_limit must be bytes or a size like '200GB' or '1.5GiB', not {limit!r}")
    number, unit, binary = found.groups()
    scale = (1024 if binary else 1000) ** "KMGT".find(unit.upper()) * (1024 if binary else 1000) if unit else 1
    value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"cache_limit must be positive, not {limit!r}")
    return value


_LOCKING: set[int] = set()  # descriptors of flocks this process holds in _locked blocks, or is taking


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block: the kernel releases it if the holder dies. A
    child forked meanwhile closes its copy at once (see _after_fork): the lock is its parent's."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _LOCKING.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _let_go(fd)


def _let_go(fd: int) -> None:
    """Release the flock at ``fd`` and close it. Unlocked first: a child forked after the descriptor
    left _LOCKING but before it was closed keeps a copy of the open file, which would hold the lock
    for as long as that child lives (a persistent DataLoader worker: every other process waits)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    _LOCKING.discard(fd)
    os.close(fd)


class _Held(dict[str, int]):
    """A Remote's held units: unit path -> descriptor with its shared flock (kept in a WeakSet:
    equal and hashed by identity)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]


_HOLDERS: weakref.WeakSet[_Held] = weakref.WeakSet()  # every Remote's, to let go of in a forked child


def _after_fork() -> None:
    """In a forked child: close the inherited descriptors of the parent's flocks, which would
    otherwise keep them held after the parent's block ends or it lets go of its units (a flock
    belongs to the open file): the child holds only what it opens itself."""
    for fd in list(_LOCKING):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKING.clear()
    for held in list(_HOLDERS):
        _close_held(held)


os.register_at_fork(after_in_child=_after_fork)


def _digest(data: str | bytes) -> str:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:16]


class Remote:
    """The dataset at ``url``, cached under ``cache_dir`` (default :func:`default_cache_dir`) up to
    ``cache_limit`` bytes for the whole cache (None: unlimited). Pickled (a DataLoader worker under
    spawn), it keeps the version it was opened at."""

    def __init__(
        self, url: str, *, cache_dir: Optional[str | os.PathLike] = None, cache_limit: int | str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.limit = parse_limit(cache_limit)
        tail = re.sub(r"[^A-Za-z0-9._-]+", "_", self.url.split("://", 1)[-1])[-48:]
        self.home = self.cache_dir / f"{tail}-{_digest(self.url)}"
        self.version = ""  # sha256 of the manifest opened: the version this object reads
        self._store: Optional[tuple[int, Store]] = None
        self._settings: Optional[dict[str, Any]] = None  # a store resolved elsewhere (__setstate__)
        self.per_unit = 0  # records per memmap unit (a power of two), fixed by the first pin()
        self._hold_units()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: self.__dict__[k] for k in ("url", "cache_dir", "limit", "home", "version", "per_unit")}
        return state | {"settings": self.store.settings()}  # the store as this process resolved it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state.pop("settings")
        self.__dict__.update(state)
        self._store = None
        self._hold_units()

    def _hold_units(self) -> None:
        """Start holding no units: ``_held`` maps a unit's path to a descriptor with its shared flock
        (no process evicts it), all closed when this object goes (its readers went before it)."""
        self._held = _Held()
        _HOLDERS.add(self._held)
        self._lock = PerProcess(threading.Lock)  # a fork may copy it held by a thread of the parent
        weakref.finalize(self, _close_held, self._held)
        self._pending: PerProcess[dict[str, concurrent.futures.Future]] = PerProcess(dict)  # name -> its fetch
        self._infos: PerProcess[dict[str, ObjectInfo]] = PerProcess(dict)  # object key -> its HEAD
        # version directory -> (manifest, index, each record's file and position): _places
        self._versions: PerProcess[dict[Path, tuple[Manifest, np.ndarray, np.ndarray, np.ndarray]]] = PerProcess(dict)
        # per unit number: [announcement, records of it still to read] of the sampler's next
        # blocks announced so far, oldest first; the announcements counted; this epoch's unread records
        self._soon: dict[int, collections.deque[list[int]]] = {}
        self._announced = 0
        self._first: Optional[np.ndarray] = None  # the units of the epoch's first batch
        self._unread = 0  # records of this epoch not read yet
        self._plan: Optional[tuple[int, list[np.ndarray]]] = None  # (epoch, per unit: its draws' places)
        self._at = 0  # draws of the planned epoch read so far
        self._pace: collections.deque[tuple[float, int]] = collections.deque(maxlen=_PACE)  # (when, _at)
        self._left: tuple[Optional[int], np.ndarray] = (None, np.zeros(0, np.int64))
        self._pinned: Optional[weakref.ReferenceType[Pinned]] = None  # the reader's, to drop its mappings
        # set by pin(): the version's units (not the Pinned: that refers back to this object, and a
        # cycle would keep the units held until the garbage collector runs)
        self._units: Optional[_Units] = None
        self._keys: Optional[tuple[str, dict[str, str]]] = None  # (version, data file -> object key): _key

    @property
    def store(self) -> Store:
        """This process's client (a forked child makes its own)."""
        mine = self._store
        if mine is None or mine[0] != os.getpid():
            # a forked child's from the parent's resolution: resolving again reads the AWS config and
            # credential chain, in a worker's first batch (docs/PERFORMANCE.md, "A cold first epoch from S3")
            settings = mine[1].settings() if mine is not None else self._settings
            mine = self._store = (os.getpid(), open_store(self.url, settings=settings))
        return mine[1]

    def _head(self, key: str) -> ObjectInfo:
        """Object ``key``'s size and version, asked once per process (its units share them; a
        replaced object fails their ``If-Match``)."""
        known = self._infos.get()
        if key not in known:
            known[key] = self.store.head(key)
        return known[key]

    def _key(self, name: str) -> str:
        """The object key of data file ``name`` (relative to the dataset's URL): where the files.json
        of its version puts it when the version was published (packer.tools.publish), else ``name``
        (a synced copy: no files.json). Read once per process and version."""
        if self._keys is None or self._keys[0] != self.version:
            listed = self.home / _VERSIONS / self.version / FILES
            files = parse_files(listed.read_bytes(), where=str(listed)) if listed.is_file() else {}
            self._keys = (self.version, {file: entry.key for file, entry in files.items()})
        return self._keys[1].get(name, name)

    def _named(self, unit: str) -> str:
        """Unit ``unit`` for messages: its object's URL, and the byte range of a part of it."""
        file, span = _span(unit)
        return self.store.name(self._key(file)) + (f" (bytes {span[0]}-{span[1]})" if span is not None else "")

    # --- versions -------------------------------------------------------------------------------

    def pin(self, expect: Optional[dict[str, FileKey]] = None) -> Pinned:
        """The version this object reads (the dataset's current one, the first time), pinned; its
        data files are fetched as readers first need them."""
        if not self.version:
            self.version = self._fetch_version()
        root = self.home / _VERSIONS / self.version
        if not (root / MANIFEST).is_file():
            raise DatasetError(f"{self.url}: version {self.version} is no longer cached in {self.home}; open it again")
        pinned = pin(str(root), expect, fetch=lambda name: self._open_unit(root, name))
        manifest = pinned.manifest
        ranged = BACKENDS[manifest.backend].concatenated
        if ranged and not self.per_unit:
            mean = sum(int(s["bytes"]) for s in manifest.shards) / max(1, len(pinned.index))
            self.per_unit = 1 << max(0, int(UNIT_BYTES / max(mean, 1.0)).bit_length() - 1)
        units = self._units = _Units(manifest, pinned.index, self.per_unit if ranged else 0)
        if ranged:  # the reader maps each shard's units as it reads them, not whole shards
            pinned.shards = [
                cast(Shard, (_RangedShard(int(s["bytes"]), units, k, lambda key: self._map_unit(root, key)), None))
                for k, s in enumerate(manifest.shards)
            ]
        self._pinned = weakref.ref(pinned)
        largest = int(np.argmax(units.sizes)) if len(units.sizes) else -1
        if self.limit is not None and largest >= 0 and int(units.sizes[largest]) > self.limit:
            raise _too_small(self.limit, self._named(units.keys[largest]), int(units.sizes[largest]))
        return pinned

    def _map_unit(self, root: Path, key: str) -> np.ndarray:
        """Unit ``key`` of the version at ``root``, mapped (fetched first unless the cache has it)."""
        fd = self._open_unit(root, key)
        try:
            size = os.fstat(fd).st_size
            mapping = Mapping(fd, size) if size else None
        finally:
            os.close(fd)
        if mapping is None:
            return np.zeros(0, np.uint8)
        mapping.madvise(mmap.MADV_RANDOM)
        return np.asarray(mapping)

    def release(self) -> None:
        """Let go of the units this process holds, with a memmap reader (see the module docstring):
        called after each batch, so that a cache of a few units serves an epoch. With a cache limit
        their mappings go too (the disk space of an evicted unit is freed with its last mapping)."""
        pinned = self._pinned() if self._pinned is not None else None
        if pinned is None or not pinned.shards or not isinstance(pinned.shards[0][0], _RangedShard):
            return
        with self._lock.get():
            held = dict(self._held)
            self._held.clear()
        if self.limit is not None:
            for shard, _ in pinned.shards:
                cast(_RangedShard, shard).opened.clear()  # a mapping goes with its last buffer
        for fd in held.values():
            _let_go(fd)

    def prefetch(
        self, records: np.ndarray, *, wait: bool = False, epoch: Optional[int] = None, read: Optional[int] = None
    ) -> None:
        """Fetch the data files that ``records`` lie in and this version does not have yet, up to
        :data:`PREFETCH_UNITS` at a time, in this process's background threads: the sampler's next
        blocks (``wait`` False), or a batch about to be read (``wait``: until they are in, raising
        the first failure; a failed fetch is forgotten once raised, so a later batch tries again).
        A batch of ShardSampler's ``epoch`` counts its records read: a unit this process has read
        every record of this epoch is not needed again in it. ``read``: the draws of the planned
        ``epoch`` read by now in other processes (the sampler's, whose DataLoader workers read
        them), for eviction by next use; a process that reads batches itself counts them instead."""
        assert self._units is not None, "pin() first"
        if read is not None and not self.reads_here and self._plan is not None and epoch == self._plan[0]:
            self._at = max(self._at, read)
            self._pace.append((time.monotonic(), self._at))
            (t0, at0), (t1, at1) = self._pace[0], self._pace[-1]
            if len(self._pace) >= _PACE // 2 and t1 > t0:
                _turns.get().consumed((at1 - at0) / (t1 - t0) * self._units.record_bytes)
        units = self._units
        root = self.home / _VERSIONS / self.version
        pending = self._pending.get()
        futures = {}
        numbers = units.of[records]
        _, first = np.unique(numbers, return_index=True)
        order = numbers[np.sort(first)].tolist()  # in the order the records need them
        if not wait:
            self._count(numbers, wait, epoch)
            order.sort(key=lambda u: _never if (rank := self._rank(u)) is None else rank)  # the next needed first
        wanted = [units.keys[u] for u in order]
        for name in wanted:
            if wait and self.limit is not None and name not in pending:
                self._hold_cached(root / name)  # from now until the batch is read: no prefetch evicts it
            if name not in pending and not (root / name).exists():
                pool, fetch = _prefetcher.get(), functools.partial(self._fetch_into, root, name, demand=wait)
                if wait:
                    pending[name] = pool.submit(fetch)
                else:  # entered as it is submitted (its turn known before its thread starts); forgotten once done
                    rank = _never if (r := self._rank(units.numbers[name])) is None else r
                    pending[name] = _turns.get().enter(
                        self._turn_key(name), rank, functools.partial(pool.submit, fetch)
                    )
                    pending[name].add_done_callback(functools.partial(_forget, pending, name))
            if name in pending:
                futures[name] = pending[name]
        for name, future in futures.items() if wait else ():
            failure = future.exception()
            pending.pop(name, None)  # done: a unit evicted since is fetched again when next needed
            if failure is not None:
                raise failure
        if wait:  # read from now on: until its units are in, the batch is what comes next (_needed_before)
            self._count(numbers, wait, epoch)

    def _fetch_into(self, root: Path, name: str, *, demand: bool) -> None:
        """:meth:`_fetch_unit` in the background: the unit stays held (a batch's) or not (a
        prefetch, entered in the turns when submitted, whose download waits for its turn)."""
        try:
            fd = self._fetch_unit(root, name, demand=demand)
        finally:
            _turns.get().leave(self._turn_key(name))
        if fd is not None:
            os.close(fd)

    def _turn_key(self, name: str) -> tuple[str, str]:
        """Unit ``name`` of this dataset, as the process's turns know it (they serve every dataset)."""
        return str(self.home), name

    @property
    def reads_here(self) -> bool:
        """Whether this process has read batches of a ShardSampler (else its DataLoader workers do)."""
        return self._left[0] is not None

    def plan(self, epoch: int, records: np.ndarray) -> None:
        """The records this process will read in ``epoch``, in order (ShardSampler's, told when it
        is iterated in this process): eviction ranks units by their next use in it."""
        assert self._units is not None, "pin() first"
        numbers = self._units.of[np.asarray(records, dtype=np.int64)]
        count = len(self._units.keys)
        order = np.argsort(numbers, kind="stable")
        bounds = np.searchsorted(numbers[order], np.arange(count + 1))
        self._plan = (epoch, [order[bounds[u] : bounds[u + 1]] for u in range(count)])
        self._at = 0
        self._pace.clear()

    def _count(self, files: np.ndarray, read: bool, epoch: Optional[int]) -> None:
        """Keep this process's view of the future: records of units ``files`` announced by the
        sampler (``read`` False), or read by a batch of ``epoch`` (None: not a ShardSampler's)."""
        assert self._units is not None
        count = len(self._units.keys)
        if not read:
            counts = np.bincount(files, minlength=count)
            if self._first is not None:  # the epoch's first announcement names its first batch, read already
                counts = np.maximum(counts - np.bincount(self._first, minlength=count), 0)
                self._first = None
            self._announced += 1
            for k in np.flatnonzero(counts).tolist():
                self._soon.setdefault(k, collections.deque()).append([self._announced, int(counts[k])])
            return
        numbers, counts = np.unique(files, return_counts=True)
        if epoch is not None and epoch != self._left[0]:
            self._left = (epoch, np.bincount(self._units.of, minlength=count))
            self._soon, self._first = {}, files
        if epoch is not None and self._plan is not None and epoch == self._plan[0]:
            self._at += len(files)
        if epoch is not None:
            np.subtract.at(self._left[1], files, 1)
            self._unread = int(np.clip(self._left[1], 0, None).sum())
        for k, n in zip(numbers.tolist(), counts.tolist()):
            queue = self._soon.get(k)
            while queue and n:
                taken = min(n, queue[0][1])
                queue[0][1] -= taken
                n -= taken
                if not queue[0][1]:
                    queue.popleft()
            if queue is not None and not queue:
                del self._soon[k]

    def _rank(self, k: int) -> Optional[int]:
        """When unit ``k`` is next needed, as far as this process knows: the announcement of
        its next records; after all of them when records of it are still unread this epoch, the
        later the fewer (in an order not yet known, the first of m of R unread records comes after
        R / (m + 1) on average); None when it is not known to be needed."""
        epoch, left = self._left  # the epoch of the batches read here (None: none, DataLoader workers read them)
        if self._plan is not None and epoch in (None, self._plan[0]):
            uses = self._plan[1][k] if k < len(self._plan[1]) else np.zeros(0, np.int64)
            j = int(np.searchsorted(uses, self._at))
            return int(uses[j]) if j < len(uses) else None
        queue = self._soon.get(k)
        if queue:
            return queue[0][0]
        if epoch is None or k >= len(left) or left[k] <= 0:
            return None
        return self._announced + 1 + self._unread // (int(left[k]) + 1)

    def _hold_cached(self, path: Path) -> None:
        """Hold the unit at ``path`` if the version has it."""
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            return
        try:
            self._hold(fd, path)
        finally:
            os.close(fd)

    def _fetch_version(self) -> str:
        """The current version's key, its manifest and index fetched and checked into the cache first.
        An index that does not match the manifest (a refresh was publishing between the two reads)
        is fetched again with the manifest."""
        for d in (_UNITS, _PARTIAL, _VERSIONS, _LOCKS):
            (self.home / d).mkdir(parents=True, exist_ok=True)
        (self.home / "url").write_text(self.url + "\n")
        problem = ""
        for _ in range(VERIFY_ATTEMPTS):
            pointer = read_pointer(self.store)
            if pointer is None:
                raise DatasetError(f"{self.url}: not a packer dataset (no {MANIFEST}; wrong URL?)")
            text, version = pointer.text, pointer.version
            root = self.home / _VERSIONS / version
            if (root / MANIFEST).is_file():
                return version
            with _locked(self.home / _LOCKS / f"version-{version}"):
                if (root / MANIFEST).is_file():
                    return version
                problem = self._fetch_metadata(text, root, published=pointer.published)
                if not problem:
                    return version
        raise DatasetError(f"{self.url}: {problem} after {VERIFY_ATTEMPTS} downloads")

    def _fetch_metadata(self, text: bytes, root: Path, *, published: bool) -> str:
        """Manifest ``text``'s index and label arrays downloaded and checked into ``root`` (renamed
        into place whole); what did not match ("" when all did). ``published``: the pointer says
        its version is under ``versions/<id>/`` (packer.store.published.LAYOUT_META)."""
        staging = self.home / _PARTIAL / f"{root.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            (staging / MANIFEST).write_bytes(text)
            fd = open_regular(staging / MANIFEST)
            try:
                manifest = Manifest.read(fd, f"{self.url}/{MANIFEST}")
            finally:
                os.close(fd)
            if manifest.manifest_digest and manifest.computed_digest != manifest.manifest_digest:
                return f"{MANIFEST}: its content does not match its manifest_digest"
            names = [INDEX, SOURCES]
            names += [LABELS] if manifest.label_kind == "multi" else []
            names += [TARGETS] if manifest.targets else []
            # asked together (one first-byte wait): the version's files.json (None: a synced copy) and
            # the arrays where the pointer says they are, or (it does not say) where a synced copy has them
            with concurrent.futures.ThreadPoolExecutor(2 * len(names) + 1) as pool:
                listing = pool.submit(read_files, self.store, root.name)
                keys = [version_key(root.name, name) if published else name for name in names]
                bodies = [pool.submit(self.store.get, key) for key in keys]
                listed = listing.result()
                if listed is None and published:
                    return f"{version_key(root.name, FILES)} is missing (the pointer says it was published)"
                if listed is not None:  # published (packer.tools.publish): the version's folder and files.json
                    (staging / FILES).write_bytes(files_json(listed))
                    if not published:  # by a packer that did not mark the pointer: the arrays are there too
                        keys = [version_key(root.name, name) for name in names]
                        bodies = [pool.submit(self.store.get, key) for key in keys]
            arrays = {}
            for name, key, body in zip(names, keys, bodies):
                try:
                    (staging / name).write_bytes(body.result())
                except ObjectNotFound:
                    raise DatasetError(f"{self.store.name(key)}: missing (the manifest names it)") from None
                fd = open_regular(staging / name)
                try:
                    arrays[name] = map_npy(fd, f"{self.url}/{name}")
                finally:
                    os.close(fd)
            problem = _metadata_problem(manifest, arrays)
            if problem:
                return problem
            try:
                os.rename(staging, root)
            except OSError:
                if not (root / MANIFEST).is_file():
                    raise
            return ""
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # --- units ----------------------------------------------------------------------------------

    def _open_unit(self, root: Path, name: str) -> int:
        """A descriptor of data file ``name`` of the version at ``root``: fetched and checked first
        unless the version already has it; held (shared flock) so that no process evicts it."""
        try:
            fd = open_regular(root / name)
        except FileNotFoundError:
            fd = -1
        if fd >= 0 and self._hold(fd, root / name):
            os.utime(fd)  # last opened: eviction takes the least recently opened first
            return fd
        if fd >= 0:
            os.close(fd)  # evicted between the open and the lock: fetch it again
        fetched = self._fetch_unit(root, name)
        assert fetched is not None, "a reader's fetch returns the unit"
        return fetched

    def _hold(self, fd: int, path: Path) -> bool:
        """Take the shared flock that keeps the unit open at ``fd`` (``path``) from eviction; False
        when it was evicted (unlinked) before the lock was taken."""
        hold = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        _LOCKING.add(hold)  # until it is kept or closed: a child forked meanwhile closes its copy
        fcntl.flock(hold, fcntl.LOCK_SH)
        linked = os.fstat(hold).st_nlink >= 2  # else its names are gone: evicted
        if not linked:
            _let_go(hold)
            return False
        self._keep(hold, path)
        _LOCKING.discard(hold)
        return True

    def _keep(self, hold: int, path: Path) -> None:
        """Keep ``hold`` (a descriptor with the unit's shared flock) until :meth:`release` (a child
        forked from now on closes its copy: see _after_fork)."""
        with self._lock.get():
            old = self._held.pop(str(path), None)
            self._held[str(path)] = hold
        if old is not None:
            _let_go(old)

    def _fetch_unit(self, root: Path, name: str, *, demand: bool = True) -> Optional[int]:
        """Unit ``name`` (a data file, or ``FILE@START-END``: a byte range of one) of the version at
        ``root`` in the cache, checked, linked into ``root``.
        A reader's fetch (``demand``) returns a descriptor of it, held; a prefetch of the sampler's
        next blocks returns None and leaves it to eviction by next use, or skips it when there is no
        room for it without evicting what is needed sooner."""
        manifest, index, files, positions = self._places(root)
        file, span = _span(name)
        k = data_files(manifest).index(file)
        backend = BACKENDS[manifest.backend]
        inside = files == k
        if span is not None:
            inside &= (positions >= span[0]) & (positions < span[1])
        mine = np.flatnonzero(inside)
        rows = np.empty(len(mine), _ROWS_DTYPE)
        rows["position"] = positions[mine] - (span[0] if span is not None else 0)  # in the unit's own file
        rows["length"], rows["crc32"] = index["length"][mine], index["crc32"][mine]
        order = np.argsort(rows["position"], kind="stable")
        mine, rows = mine[order], rows[order]
        with _locked(self.home / _LOCKS / f"unit-{name}"):
            for _ in range(VERIFY_ATTEMPTS):
                try:
                    fd = open_regular(root / name)  # another process fetched it meanwhile
                except FileNotFoundError:
                    pass
                else:
                    if not demand:
                        os.close(fd)
                        return None
                    if self._hold(fd, root / name):
                        return fd
                    os.close(fd)  # evicted before the lock was taken: fetch it again
                got = self._fetch_held(root, name, k, (backend, mine, rows), demand=demand)
                if got is None:
                    return None  # no room for a prefetch: the batch that needs it fetches it
                hold, unit = got
                try:
                    with contextlib.suppress(FileExistsError):
                        os.link(unit, root / name)  # held: no process can evict it meanwhile
                    if demand:
                        self._keep(hold, root / name)
                except BaseException:
                    _let_go(hold)
                    raise
                if not demand:
                    _let_go(hold)  # a prefetch's unit is left to eviction by next use
                    return None
                _LOCKING.discard(hold)
                return os.open(f"/proc/self/fd/{hold}", os.O_RDONLY | os.O_CLOEXEC)
        raise _evicted(self._named(name))

    def _places(self, root: Path) -> tuple[Manifest, np.ndarray, np.ndarray, np.ndarray]:
        """The manifest and index of the version at ``root`` and each record's data file and byte
        position, read once per process (a version never changes): every unit's fetch selects its
        rows from them."""
        known = self._versions.get()
        if root not in known:
            manifest = Manifest.load(root)
            fd = open_regular(root / INDEX)
            try:
                index = map_npy(fd, root / INDEX)
            finally:
                os.close(fd)
            known[root] = (manifest, index, *record_places(manifest, index))
        return known[root]

    def _fetch_held(
        self, root: Path, name: str, k: int, expected: _Expected, *, demand: bool
    ) -> Optional[tuple[int, Path]]:
        """A descriptor and the path of the unit of data file ``name`` (number ``k``) in ``units/``, downloaded and
        checked unless a version already has it, holding its shared flock since before it had its
        name there (so no process can evict it between its arrival and its use); None when a
        prefetch found no room. A unit is named by its object's size and version: where the
        manifest lists the size (memmap), the version of an object this process has not asked yet
        comes with its first unit's GET (no HEAD first: one first-byte wait less, the first
        batch's among them), and a cached unit is found by the records it was checked for."""
        manifest = self._places(root)[0]
        key = self._key(_span(name)[0])
        listed = int(manifest.shards[k]["bytes"]) if expected[0].lists_files(manifest) else None
        info = self._infos.get().get(key)
        if info is None and listed is None:
            info = self._missing_named(key, lambda: self._head(key))
        if info is not None:
            self._same_size(key, info, listed)
            cached = [self._unit_path(name, info)]
        else:
            found = (self.home / _UNITS).glob(f"{glob.escape(name)}.{listed}.*")
            cached = sorted(p for p in found if not p.name.endswith(_SIDECAR))
        for unit in (u for u in cached if _checked_for(u, expected[2])):
            try:
                fd = os.open(unit, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            _LOCKING.add(fd)  # until it is kept or closed: a child forked meanwhile closes its copy
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink >= 1:
                os.utime(fd)
                return fd, unit
            _let_go(fd)  # evicted before the lock was taken: download it again
        try:
            return self._download_checked(name, key, info or ObjectInfo(cast(int, listed), ""), expected, demand=demand)
        except _NoRoom:
            return None

    def _unit_path(self, name: str, info: ObjectInfo) -> Path:
        """Where unit ``name`` of the object version ``info`` is kept in ``units/``."""
        return self.home / _UNITS / f"{name}.{info.size}.{_digest(info.etag)}"

    def _missing_named(self, key: str, ask: Callable[[], T]) -> T:
        """``ask()`` about object ``key``, which missing is a DatasetError that says the manifest names it."""
        try:
            return ask()
        except ObjectNotFound:
            raise DatasetError(f"{self.store.name(key)}: missing (the manifest names it)") from None

    def _same_size(self, key: str, info: ObjectInfo, listed: Optional[int]) -> None:
        if listed is not None and info.size != listed:
            raise DatasetError(
                f"{self.store.name(key)}: {info.size} bytes, the manifest says {listed} (the dataset "
                f"was replaced since this version was opened: open it again)"
            )

    def _download_checked(
        self, name: str, key: str, info: ObjectInfo, expected: _Expected, *, demand: bool = True
    ) -> tuple[int, Path]:
        """Unit ``name`` of object ``key`` (``info``: its size, and its version unless "") downloaded
        and renamed into ``units/`` once its bytes match what ``expected`` says; a descriptor of it
        with its shared flock, taken before the rename, and its path. A concatenated backend's
        partial download is named by the records it is for (a process that knows the version and
        one that learns it from its GET resume the same one), another's by the version."""
        rows = expected[2]
        tag = _digest(rows.tobytes() if expected[0].concatenated else info.etag)
        part = self.home / _PARTIAL / f"{name}.{info.size}.{tag}"
        learned = [info]  # replaced by what a GET's response tells (info.etag "")

        def seen(found: ObjectInfo) -> None:
            self._same_size(key, found, info.size)
            learned[0] = found
            self._infos.get().setdefault(key, found)  # its other units ask If-Match it

        problem = ""
        for _ in range(VERIFY_ATTEMPTS):
            # a concatenated backend's records are checked as their bytes arrive (the check after
            # the download re-reads only those that did not arrive whole in one stream)
            received = _Received(rows) if expected[0].concatenated else None
            self._missing_named(
                key,
                functools.partial(
                    self._download, part, name, key, learned[0], demand=demand, received=received, seen=seen
                ),
            )
            problem = _unit_problem(part, expected, received)
            if not problem:
                if not info.etag and learned[0] is info:  # resumed whole: no GET told the version
                    seen(self._missing_named(key, lambda: self._head(key)))
                unit = self._unit_path(name, learned[0])
                np.save(part.with_name(part.name + _SIDECAR), rows)
                os.replace(part.with_name(part.name + _SIDECAR), unit.with_name(unit.name + _SIDECAR))
                hold = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
                _LOCKING.add(hold)  # until it is kept or closed: a child forked meanwhile closes its copy
                try:
                    fcntl.flock(hold, fcntl.LOCK_SH)
                    # under the lock that counts the cache: a count between its listing of units/ and
                    # of partial/ would otherwise miss the unit in neither, and reserve its room again
                    counted = self.limit is not None
                    with _locked(self.cache_dir / ".evict.lock") if counted else contextlib.nullcontext():
                        os.replace(part, unit)
                except BaseException:
                    _let_go(hold)
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part.with_name(part.name + ".parts"))
                return hold, unit
            _remove(part, part.with_name(part.name + ".parts"))
        raise DatasetError(f"{self._named(name)}: {problem} after {VERIFY_ATTEMPTS} downloads")

    def _download(
        self,
        part: Path,
        name: str,
        key: str,
        info: ObjectInfo,
        *,
        demand: bool = True,
        received: Optional[_Received] = None,
        seen: Optional[Callable[[ObjectInfo], object]] = None,
    ) -> None:
        """Unit ``name`` of object ``key`` (``info``) downloaded into ``part``, resuming the parts a
        previous attempt (of any process) finished: ``part``'s ``.parts`` file lists them, one
        number a line; ``received`` is given each piece written, ``seen`` the object's version
        where ``info`` has none."""
        span = _span(name)[1]
        start, end = span if span is not None else (0, info.size)
        part_bytes = max(1, min(store_base.PART_BYTES, -(-(end - start) // UNIT_STREAMS)))
        header = b"part_bytes %d\n" % part_bytes  # the parts' numbers count parts of this size
        done_file = part.with_name(part.name + ".parts")
        done: frozenset[int] = frozenset()
        # a prefetch waits for its turn before it reserves room (a reservation holds the room empty)
        arrival = _turns.get().turn(self._turn_key(name), end - start)

        def progress(at: int, piece: bytes) -> None:
            arrival(at, piece)
            if received is not None:
                received(at, piece)

        try:
            if part.exists() and part.stat().st_size == end - start and done_file.exists():
                listed = done_file.read_bytes()
                if listed.startswith(header):
                    done = frozenset(int(n) for n in listed[len(header) :].split() if n.isdigit())
            else:
                _remove(part, done_file)
                self._make_room(end - start, part, name, demand=demand)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            log = os.open(done_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                if not done:
                    os.ftruncate(log, 0)
                    os.write(log, header)
                os.ftruncate(fd, end - start)
                try:
                    self.store.download(
                        key,
                        fd,
                        info,
                        skip=done,
                        part_done=lambda n: os.write(log, b"%d\n" % n),
                        progress=progress,
                        start=start,
                        end=end,
                        part_bytes=part_bytes,
                        seen=seen,
                    )
                except ObjectChanged:
                    _remove(part, done_file)
                    raise DatasetError(
                        f"{self.store.name(key)}: replaced in the store while it was read (the dataset "
                        f"was refreshed: open it again)"
                    ) from None
                os.fsync(fd)
            finally:
                os.close(fd)
                os.close(log)
        finally:
            arrival.end()

    def _make_room(self, need: int, part: Path, name: str, *, demand: bool) -> None:
        """Evict units no reader holds (see the module docstring for the order) until ``need`` more
        bytes fit under the cache limit, and reserve them: the download's file ``part`` is made that
        size before the lock goes, so it counts for the next one (the cache never exceeds the limit).
        A batch's download (``demand``) waits for readers to let go; a prefetch evicts only units
        of no known next use (it would otherwise push out what the next batches need before it, and
        its reservation would keep their downloads from the room), leaves the room of the units
        needed before it (:meth:`_needed_before`), and else raises _NoRoom."""
        if self.limit is None:
            return
        if need > self.limit:
            raise _too_small(self.limit, self.store.name(name), need)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + ROOM_WAIT
        while True:
            with _locked(self.cache_dir / ".evict.lock"):
                units = [p for p in self.cache_dir.glob(f"*/{_UNITS}/*") if not p.name.endswith(_SIDECAR)]
                partial = [p for p in self.cache_dir.glob(f"*/{_PARTIAL}/*") if not p.name.endswith(".parts")]
                sizes = {p: _size(p) for p in units + partial}
                used = sum(sizes.values())
                for stale in partial:  # a download whose process died or gave up: its room first
                    if used + need > self.limit and sizes[stale] and _drop_partial(stale):
                        used -= sizes[stale]
                evicted = set()
                for unit, rank in sorted(((u, self._next_use(u)) for u in units), key=_eviction_order):
                    if used + need <= self.limit or (rank is not None and not demand):
                        break
                    if _evict(unit):
                        used -= sizes[unit]
                        evicted.add(unit)
                there = {p.name.rsplit(".", 2)[0] for p in units + partial if p.parent.parent == self.home}
                there -= {p.name.rsplit(".", 2)[0] for p in evicted}
                if used + need + (0 if demand else self._needed_before(name, there, need)) <= self.limit:
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    try:
                        os.ftruncate(fd, need)
                    finally:
                        os.close(fd)
                    return
            if not demand:
                raise _NoRoom()
            self.release()  # this batch's other units too: two batches that each hold some never wait on each other
            if time.monotonic() > deadline:
                raise DatasetError(
                    f"{self.url}: cache_limit {self.limit} bytes is too small: {used} bytes of the cache "
                    f"{self.cache_dir} are held by open readers or downloads, and {need} more are needed"
                )
            time.sleep(0.05)

    def _needed_before(self, name: str, there: set[str], need: int) -> int:
        """Bytes of the units this process knows are needed before unit ``name`` and are not
        ``there`` (cached or being fetched): the room a prefetch of ``name`` must leave them, or it
        would push out what they need sooner, or be pushed out itself before its use (an LMDB
        file's size is known from its HEAD only: ``need`` stands in for it)."""
        if self._units is None or name not in self._units.numbers:
            return need
        mine = self._rank(self._units.numbers[name])
        if mine is None:
            return need
        total = 0
        for u, key in enumerate(self._units.keys):
            if key != name and key not in there:
                rank = self._rank(u)
                if rank is not None and rank < mine:
                    total += int(self._units.sizes[u]) or need
        return total

    def _next_use(self, unit: Path) -> Optional[int]:
        """When cached ``unit`` is next needed (:meth:`_rank`; None: another dataset's)."""
        numbers = self._units.numbers if self._units is not None and unit.parent.parent == self.home else {}
        k = numbers.get(unit.name.rsplit(".", 2)[0])
        return None if k is None else self._rank(k)


def _span(unit: str) -> tuple[str, Optional[tuple[int, int]]]:
    """A unit's data file and byte range (None: the whole file), from its name ``FILE[@START-END]``."""
    file, _, span = unit.partition("@")
    if not span:
        return file, None
    start, _, end = span.partition("-")
    return file, (int(start), int(end))


class _Units:
    """What is fetched of one version: for memmap, each shard cut into ranges of ``per_unit``
    records (global record numbers ``u * per_unit`` and up: a power of two, so that ShardSampler
    blocks of a power of two records up to ``per_unit`` never straddle two units) at record
    boundaries; for LMDB (``per_unit`` 0) the data files. ``of``: each record's unit; ``keys``:
    each unit's name (a whole shard is named as its file, so it is the file ``packer verify``
    fetches); ``sizes``: its bytes (memmap; 0 for LMDB); ``numbers``: name -> unit; ``record_bytes``:
    the mean bytes of a record (memmap; 0.0 for LMDB)."""

    def __init__(self, manifest: Manifest, index: np.ndarray, per_unit: int) -> None:
        names = data_files(manifest)
        files, positions = record_places(manifest, index)
        if not per_unit:
            self.of = files.astype(np.int64)
            self.keys = list(names)
            self.sizes = np.zeros(len(names), np.int64)  # an LMDB file's size is known from its HEAD only
        else:
            group = files.astype(np.int64) * (len(index) // per_unit + 1) + np.arange(len(index)) // per_unit
            unique, self.of = np.unique(group, return_inverse=True)
            self.of = self.of.astype(np.int64)
            ends = positions + index["length"].astype(np.int64)
            starts = np.full(len(unique), np.iinfo(np.int64).max, np.int64)
            stops = np.zeros(len(unique), np.int64)
            np.minimum.at(starts, self.of, positions)
            np.maximum.at(stops, self.of, ends)
            shard_of = files[np.unique(self.of, return_index=True)[1]]
            self.keys = []
            for u, k in enumerate(shard_of.tolist()):
                whole = starts[u] == 0 and stops[u] == int(manifest.shards[k]["bytes"])
                self.keys.append(names[k] if whole else f"{names[k]}@{starts[u]}-{stops[u]}")
            self.sizes = stops - starts
            self.shard, self.starts, self.stops = shard_of, starts, stops
        self.numbers = {key: u for u, key in enumerate(self.keys)}
        self.record_bytes = float(self.sizes.sum()) / max(1, len(index))


class _RangedShard:
    """Memmap shard ``k`` as its reader slices it (``array[start:end]``), each unit mapped when a
    record of it is first read: ``open_unit(name)`` fetches it into the cache first. The mappings
    are kept in ``opened`` until :meth:`Remote.release` drops them."""

    def __init__(self, size: int, units: _Units, k: int, open_unit: Callable[[str], np.ndarray]) -> None:
        self.size, self._open_unit = size, open_unit
        mine = np.flatnonzero(units.shard == k)
        order = np.argsort(units.starts[mine], kind="stable")
        self._units = mine[order]
        self._starts = units.starts[self._units]
        self._keys = units.keys
        self.opened: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, where: slice) -> np.ndarray:
        j = max(0, int(np.searchsorted(self._starts, where.start, side="right")) - 1)
        array = self.opened.get(j)
        if array is None:
            array = self.opened[j] = self._open_unit(self._keys[int(self._units[j])])
        base = int(self._starts[j])
        return array[where.start - base : where.stop - base]


class _NoRoom(Exception):
    """A prefetch found no room without evicting what is needed sooner: the batch fetches it."""


def _eviction_order(entry: tuple[Path, Optional[int]]) -> tuple[int, int, int]:
    """Units of no known next use first, then furthest next use first; least recently opened first."""
    unit, rank = entry
    return (0, 0, _mtime(unit)) if rank is None else (1, -rank, _mtime(unit))


def _forget(pending: dict[str, concurrent.futures.Future], name: str, _: concurrent.futures.Future) -> None:
    pending.pop(name, None)


def _too_small(limit: int, name: str, size: int) -> DatasetError:
    return DatasetError(f"cache_limit {limit} bytes is too small: {name} alone is {size} bytes")


_never = 1 << 62  # a rank after every known next use
_prefetcher = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(PREFETCH_UNITS, thread_name_prefix="packer-prefetch")
)


class _Turns:
    """The downloads of a process's prefetches, in the order they are needed, as few receiving at once
    as keep up with the readers: one that waits for its turn (:meth:`turn`) starts once fewer
    than ``width`` are receiving and not finishing (a first-byte wait from their end at the rate
    they receive: :class:`_Arrival`), so its first bytes come as their last do and the unit needed
    next does not share the bandwidth with those needed after it. ``width`` is 1 while one stream
    alone (its rate measured while it received alone) is faster than the readers consume; where
    it is not (a store whose GETs are capped, as S3's are), enough for their consumption, up to
    :data:`PREFETCH_UNITS`. A prefetch is entered when it is submitted to this process's threads
    (:meth:`enter`, with its rank: its next use); one waits for every one entered before it with a
    rank as low or lower (entered before, its thread has started: the threads take prefetches in
    the order submitted, so no wait is for one still queued behind it). A batch's own download
    (not entered) never waits."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: dict[tuple[str, str], tuple[int, int]] = {}  # (dataset, unit) -> (rank, order entered)
        self._entered = 0
        self._busy = 0  # downloads receiving and not finishing yet
        self.receiving = 0  # downloads between their turn and their end
        self._width = 1
        self._alone = 0.0  # bytes/s of one stream receiving alone (0.0: not measured yet)
        self._consumed = 0.0  # bytes/s the readers consume (0.0: not known yet)

    def enter(
        self, key: tuple[str, str], rank: int, submit: Callable[[], concurrent.futures.Future]
    ) -> concurrent.futures.Future:
        """Prefetch ``key`` of ``rank``, entered and ``submit``-ted to the threads in one step (so
        the order entered is the order the threads take them, whatever thread submits)."""
        with self._changed:
            self._entered += 1
            self._waiting[key] = (rank, self._entered)
            return submit()

    def leave(self, key: tuple[str, str]) -> None:
        """``key``'s prefetch has ended (fetched, found cached, no room, failed)."""
        with self._changed:
            if self._waiting.pop(key, None) is not None:
                self._changed.notify_all()

    def consumed(self, rate: float) -> None:
        """The readers consume ``rate`` bytes/s (the sampler's pace)."""
        with self._changed:
            self._consumed = rate
            self._widen()

    def alone(self, rate: float) -> None:
        """A stream received ``rate`` bytes/s alone."""
        with self._changed:
            self._alone = rate if not self._alone else (self._alone + rate) / 2
            self._widen()

    def _widen(self) -> None:
        if self._alone and self._consumed:
            need = math.ceil(_HEADROOM * self._consumed / self._alone)
            self._width = max(1, min(PREFETCH_UNITS, need))
            self._changed.notify_all()

    def turn(self, key: tuple[str, str], size: int) -> _Arrival:
        """Wait for prefetch ``key``'s turn to download its ``size`` bytes (none for one not
        entered, or downloading again): what its download reports its progress to."""
        with self._changed:
            mine = self._waiting.get(key)
            if mine is None:
                return _Arrival(None, size)
            while self._busy >= self._width or any(w[1] < mine[1] and w[0] <= mine[0] for w in self._waiting.values()):
                self._changed.wait()
            del self._waiting[key]
            self._busy += 1
            self.receiving += 1
        return _Arrival(self, size)

    def finishing(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def ended(self) -> None:
        with self._changed:
            self.receiving -= 1


class _Arrival:
    """A download's progress (called with each piece's bytes, from its parts' threads): it tells
    its :class:`_Turns` when it is finishing (its bytes left would take no longer than its first
    byte did, at the rate it has received since) and has ended (:meth:`end`), and the rate it
    received at while no other download of the turns received."""

    def __init__(self, turns: Optional[_Turns], size: int) -> None:
        self._turns, self._left = turns, size
        self._finished = turns is None
        self._asked = self._last = time.monotonic()
        self._first = 0.0
        self._since = 0  # bytes received after the first piece
        self._alone = [0, 0.0]  # bytes and seconds received alone, after the first piece
        self._lock = threading.Lock()

    def __call__(self, at: int, piece: bytes) -> None:
        now = time.monotonic()
        got = len(piece)
        with self._lock:
            self._left -= got
            last, self._last = self._last, now
            if self._turns is None:
                return
            if not self._first:
                self._first = now
                return
            self._since += got
            if self._turns.receiving == 1:
                self._alone[0] += got
                self._alone[1] += now - last
            # the rate over at least a first-byte wait: the pieces buffered while the first was read
            # come at once, and the rate of those few alone would call any download finishing
            wait = self._first - self._asked
            if not self._finished and self._left * max(now - self._first, wait) <= wait * self._since:
                self._finished = True
                self._turns.finishing()

    def end(self) -> None:
        with self._lock:
            turns, self._turns = self._turns, None
            if turns is None:
                return
            if not self._finished:
                turns.finishing()
            turns.ended()
            if self._alone[1] >= _ALONE_S:
                turns.alone(self._alone[0] / self._alone[1])


_turns = PerProcess(_Turns)
_PACE = 8  # the sampler's last announcements its pace is measured over
_HEADROOM = 1.1  # streams enough for this much more than the readers consume
_ALONE_S = 0.01  # the shortest time alone a stream's rate is measured over


def _close_held(held: dict[str, int]) -> None:
    for fd in held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    held.clear()


def _metadata_problem(manifest: Manifest, arrays: dict[str, np.ndarray]) -> str:
    """What in the index and label arrays does not match the manifest's digests ("" when all do)."""
    if manifest.index_digest and index_digest(arrays[INDEX]) != manifest.index_digest:
        return f"{INDEX} does not match the manifest's index_digest"
    if manifest.sources_digest and index_digest(arrays[SOURCES]) != manifest.sources_digest:
        return f"{SOURCES} does not match the manifest's sources_digest"
    labels = arrays_digest(arrays.get(LABELS), arrays.get(TARGETS))
    if manifest.labels_digest and labels != manifest.labels_digest:
        return f"{LABELS}/{TARGETS} do not match the manifest's labels_digest"
    v3 = manifest.format_version >= 3 and len(arrays[INDEX]) == manifest.count
    if v3 and logical_digest(arrays[INDEX], labels) != manifest.digest:
        return f"{INDEX} does not match the manifest's digest"
    return ""


def _checked_for(unit: Path, rows: np.ndarray) -> bool:
    """Whether ``unit`` is in the cache and was checked for every record of ``rows`` (a version
    that keeps an old segment names the same records, or fewer, of it)."""
    sidecar = unit.with_name(unit.name + _SIDECAR)
    try:
        fd = open_regular(sidecar)
    except (OSError, DatasetError):
        return False
    try:
        known = map_npy(fd, sidecar)  # its header parsed under map_npy's lock (threads fetch at once)
    except DatasetError:
        return False
    finally:
        os.close(fd)
    if not unit.exists() or known.dtype != _ROWS_DTYPE:
        return False
    if not len(rows):
        return True
    at = np.searchsorted(known["position"], rows["position"])
    if (at >= len(known)).any():
        return False
    return bool((known[at] == rows).all())


class _Received:
    """The CRC-32s of a concatenated backend's records (``rows``: their positions in the unit's
    file, sorted) computed from the bytes a download writes, as it writes them (called with each
    piece and its offset, from the parts' threads): the check after the download then reads back
    only the records whose bytes did not all come in order in one stream (cut by two parts, or in
    a part a resumed download already had, or written twice)."""

    def __init__(self, rows: np.ndarray) -> None:
        self._starts = rows["position"].astype(np.int64)
        self._ends = self._starts + rows["length"]
        self._at = self._starts.tolist()  # each record's next byte expected
        self._crcs = [0] * len(rows)
        self._spliced = [False] * len(rows)  # bytes came out of order: read back
        self._lock = threading.Lock()

    def __call__(self, at: int, piece: bytes) -> None:
        end = at + len(piece)
        view = memoryview(piece)
        first = int(np.searchsorted(self._ends, at, "right"))  # records ending after ``at``
        last = int(np.searchsorted(self._starts, end, "left"))  # and starting before ``end``
        with self._lock:
            for r in range(first, last):
                a, b = max(at, int(self._starts[r])), min(end, int(self._ends[r]))
                if a != self._at[r]:
                    self._spliced[r] = True
                else:
                    self._crcs[r] = zlib.crc32(view[a - at : b - at], self._crcs[r])
                    self._at[r] = b

    def checked(self) -> tuple[np.ndarray, np.ndarray]:
        """Which records came whole, in order (the others are to be read back), and their CRC-32s."""
        whole = (np.array(self._at, np.int64) == self._ends) & ~np.array(self._spliced, bool)
        return whole, np.array(self._crcs, np.uint32)


def _crc_differs(record: int) -> str:
    return f"record {record}: CRC-32 differs from the index's (damaged bytes)"


def _unit_problem(path: Path, expected: _Expected, received: Optional[_Received] = None) -> str:
    """What in the downloaded data file ``path`` does not match its records' index rows ("" if
    nothing): the records ``received`` saw arrive whole by the CRC-32s it computed, the others read back."""
    backend, mine, rows = expected
    todo = np.arange(len(rows))
    if received is not None:
        whole, crcs = received.checked()
        damaged = np.flatnonzero(whole & (crcs != rows["crc32"]))
        if len(damaged):
            return _crc_differs(int(mine[damaged[0]]))
        todo = np.flatnonzero(~whole)
    try:
        backend.check_walkable(path)
        walked = backend.walk_file(path, mine[todo], rows["position"][todo], rows["length"][todo], None)
        for j, (i, data) in zip(todo.tolist(), walked):
            if data is None:
                return f"record {i} is missing"
            if len(data) != int(rows["length"][j]):
                return f"record {i} is {len(data)} bytes, the index says {int(rows['length'][j])}"
            if zlib.crc32(data) != int(rows["crc32"][j]):
                return _crc_differs(i)
    except DatasetError as e:
        return str(e).removeprefix(f"{path}: ")
    return ""


def _evict(unit: Path) -> bool:
    """Delete ``unit`` and its links in the version directories unless a reader holds it."""
    try:
        fd = os.open(unit, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        if not _lock_now(fd):
            return False
        ino = os.fstat(fd).st_ino
        name = unit.name.rsplit(".", 2)[0]
        for link in unit.parent.parent.glob(f"{_VERSIONS}/*/{name}"):
            with contextlib.suppress(FileNotFoundError):
                if link.stat().st_ino == ino:
                    link.unlink()
        _remove(unit, unit.with_name(unit.name + _SIDECAR))
        return True
    finally:
        _let_go(fd)


def _drop_partial(part: Path) -> bool:
    """Delete the reserved download ``part`` unless a process is downloading it (holds its unit's
    lock): one that died or failed left it, and its room would otherwise stay taken for good."""
    name = part.name.rsplit(".", 2)[0]
    try:
        fd = os.open(part.parent.parent / _LOCKS / f"unit-{name}", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not _lock_now(fd):
            return False
        _remove(part, part.with_name(part.name + ".parts"))
        return True
    finally:
        _let_go(fd)


def _lock_now(fd: int) -> bool:
    """Take the exclusive flock at ``fd`` if no process holds the file's lock (False: one does). Let
    go of with _let_go: a child forked meanwhile closes its copy (_after_fork), and the lock is
    released before the close, so no copy keeps it (the training process, which evicts for its
    prefetches, forks DataLoader workers)."""
    _LOCKING.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _evicted(name: str) -> DatasetError:
    return DatasetError(
        f"{name}: evicted from the cache by other readers as soon as it was fetched, {VERIFY_ATTEMPTS} times; "
        f"raise cache_limit"
    )


def _remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def local_version(url: str) -> Path:
    """The cache directory (default cache) of the current version of the dataset at ``url``: its
    manifest, index and label arrays (``packer info`` on a URL reads this local copy; ``verify``
    checks the store itself, packer.tools.verify)."""
    return Path(Remote(url).pin().root)
