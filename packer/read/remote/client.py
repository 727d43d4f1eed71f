"""Remote: the dataset at a URL as a local version of the cache: pinned, its units opened and held,
fetched once per node, prefetched for the sampler's next blocks, let go of after each batch."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import glob
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar, cast

import numpy as np

from ...backends import BACKENDS, data_files, record_places
from ...backends.base import FileKey, Pinned, Shard
from ...backends.memmap import Mapping
from ...backends.pin import pin
from ...errors import CacheWaitTimeout
from ...format import (
    INDEX,
    MANIFEST,
    DatasetError,
    Manifest,
    map_npy,
    open_regular,
)
from ...store import ObjectNotFound, Store, open_store
from ...store.base import ObjectInfo, PerProcess
from ...store.published import FILES, parse_files
from ..draw import Order
from . import settings, turns
from .checks import ROWS_DTYPE, Expected, Received, checked_for, rows_of, sidecar_bytes, unit_problem
from .download import download, starts
from .eviction import (
    BLOCK,
    Files,
    Full,
    NoRoom,
    cache_locked,
    create,
    evicted_too_often,
    fixed_room,
    footprint,
    free_room,
    make_room,
    room_for,
    too_small,
)
from .locks import HOLDERS, LOCKING, Held, close_held, hold, let_go, locked, open_held, waiting
from .nextuse import NextUses
from .paths import LOCKS, PARTIAL, SIDECAR, UNITS, VERSIONS, digest, log_of, remove, sidecar_of, unit_span
from .ranges import read_records
from .settings import VERIFY_ATTEMPTS, default_cache_dir, parse_limit
from .units import RangedShard, Units
from .versions import fetch_version, suspect_files

T = TypeVar("T")


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
        self.home = self.cache_dir / f"{tail}-{digest(self.url)}"
        self.version = ""  # sha256 of the manifest opened: the version this object reads
        self._store: Optional[tuple[int, Store]] = None
        self._settings: Optional[dict[str, Any]] = None  # a store resolved elsewhere (__setstate__)
        self.per_unit = 0  # records per memmap unit (a power of two), fixed by the first pin()
        # the sampler's order of each epoch, for eviction by next use in processes that do not iterate
        # it (its DataLoader workers: ShardDataset.ordered_by); None: no ShardSampler told one
        self.order: Optional[Order] = None
        self._hold_units()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: self.__dict__[k] for k in ("url", "cache_dir", "limit", "home", "version", "per_unit", "order")}
        return state | {"settings": self.store.settings()}  # the store as this process resolved it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state.pop("settings")
        self.__dict__.update(state)
        self._store = None
        self._hold_units()

    def _hold_units(self) -> None:
        """Start holding no units: ``_held`` maps a unit's path to a descriptor with its shared flock
        (no process evicts it), all closed when this object goes (its readers went before it)."""
        self._held = Held()
        HOLDERS.add(self._held)
        self._lock = PerProcess(threading.Lock)  # a fork may copy it held by a thread of the parent
        weakref.finalize(self, close_held, self._held)
        self._version_hold = Held()  # the version's folder -> a descriptor with its shared flock (pin)
        weakref.finalize(self, close_held, self._version_hold)
        self._pending: PerProcess[dict[str, concurrent.futures.Future]] = PerProcess(dict)  # name -> its fetch
        self._infos: PerProcess[dict[str, ObjectInfo]] = PerProcess(dict)  # object key -> its HEAD
        # version directory -> (manifest, index, each record's file and position): _places
        self._versions: PerProcess[dict[Path, tuple[Manifest, np.ndarray, np.ndarray, np.ndarray]]] = PerProcess(dict)
        self._next = NextUses()  # when each unit is next needed, as far as this process knows
        self._pinned: Optional[weakref.ReferenceType[Pinned]] = None  # the reader's, to drop its mappings
        # set by pin(): the version's units (not the Pinned: that refers back to this object, and a
        # cycle would keep the units held until the garbage collector runs)
        self._units: Optional[Units] = None
        self._keys: Optional[tuple[str, dict[str, str]]] = None  # (version, data file -> object key): _key
        # per thread (a batch is read in one thread): (shard, byte position) -> a record the batch
        # being read took past the cache (no room for its unit, or its unit still downloading)
        self._past: PerProcess[threading.local] = PerProcess(threading.local)
        # the batches being read in this process's threads (from their prefetch to their release), and
        # the lock a batch's start and the last one's letting go of its LMDB files take (_let_go_files)
        self._reading: PerProcess[list[int]] = PerProcess(lambda: [0])
        self._batches = PerProcess(threading.Lock)

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
            listed = self.home / VERSIONS / self.version / FILES
            files = parse_files(listed.read_bytes(), where=str(listed)) if listed.is_file() else {}
            self._keys = (self.version, {file: entry.key for file, entry in files.items()})
        return self._keys[1].get(name, name)

    def _named(self, unit: str) -> str:
        """Unit ``unit`` for messages: its object's URL, and the byte range of a part of it."""
        file, span = unit_span(unit)
        return self.store.name(self._key(file)) + (f" (bytes {span[0]}-{span[1]})" if span is not None else "")

    # --- versions -------------------------------------------------------------------------------

    def pin(self, expect: Optional[dict[str, FileKey]] = None) -> Pinned:
        """The version this object reads (the dataset's current one, the first time), pinned; its
        data files are fetched as readers first need them."""
        fresh = not self.version
        for _ in range(VERIFY_ATTEMPTS):
            if not self.version:
                try:
                    self.version = self._until_room(self._fetch_version)
                except OSError as e:
                    raise self._disk_full(f"{self.url}/{MANIFEST}", e) from None
            root = self.home / VERSIONS / self.version
            if self._hold_version(root):
                break
            if not fresh:
                raise DatasetError(
                    f"{self.url}: version {self.version} is no longer cached in {self.home}; open it again"
                )
            self.version = ""  # evicted (a version no reader held) between its fetch and the hold: again
        else:
            raise evicted_too_often(f"{self.url}/{MANIFEST}")
        try:
            pinned = pin(str(root), expect, fetch=lambda name: self._open_file(root, name))
        except DatasetError as e:  # the version's index refused: named by its URL, not the cache's folder
            raise type(e)(str(e).replace(str(root), f"{self.url} (version {self.version})")) from None
        manifest = pinned.manifest
        ranged = BACKENDS[manifest.backend].concatenated
        if ranged and not self.per_unit:
            self.per_unit = settings.unit_records(sum(int(s["bytes"]) for s in manifest.shards), len(pinned.index))
        units = self._units = Units(manifest, pinned.index, self.per_unit if ranged else 0)
        if ranged:  # the reader maps each shard's units as it reads them, not whole shards
            pinned.shards = [
                cast(
                    Shard,
                    (
                        RangedShard(
                            int(s["bytes"]),
                            units,
                            k,
                            lambda key: self._map_unit(root, key),
                            self._batch_past,
                            functools.partial(self._record_past, root),
                        ),
                        None,
                    ),
                )
                for k, s in enumerate(manifest.shards)
            ]
        self._pinned = weakref.ref(pinned)
        if self.limit is not None and len(units.sizes) and int(units.sizes.max()) > 0:  # format 1-2 LMDB: at its HEAD
            largest = int(np.argmax(units.sizes))
            part = self.home / PARTIAL / units.keys[largest]
            rows = np.zeros(int(np.count_nonzero(units.of == largest)), ROWS_DTYPE)
            need = room_for(_with_sidecar(starts(part, int(units.sizes[largest])), part, rows))
            fixed = fixed_room(self.cache_dir)
            if need + fixed > self.limit:
                refused = too_small(self.limit, self.url, self._named(units.keys[largest]), need, fixed)
                if not ranged:  # an LMDB batch cannot read its records past the cache
                    refused = DatasetError(
                        f"{refused}; an LMDB batch needs all its data files in the cache at once, so a "
                        f"limit below their sum works for an order whose batches each read few of them"
                    )
                raise refused
        return pinned

    def reopen(self) -> Pinned:
        """The store's current version, pinned in place of the one this object reads (ShardSampler's
        agreement of DDP ranks that opened different versions: packer.read.sampler._agree_on_version),
        with ``per_unit`` fixed again by it, as a first open fixes it: every rank then names the same
        units, and draws the same blocks. Once it is pinned, the old version is let go of (its hold,
        its held units, what this process read of it), so that eviction may take it; the caller
        drops its readers of it. DataLoader workers forked before keep their copy of its hold and
        read it; those made after (forked or spawned) read the new one. A failure leaves this object
        reading the old version."""
        old = self.version, self.per_unit, self._units, self._pinned
        self.version, self.per_unit = "", 0
        try:
            pinned = self.pin()
        except BaseException:
            if self.version not in ("", old[0]):  # held, then refused (its index, a limit too small)
                self._let_go_version(self.home / VERSIONS / self.version)
            self.version, self.per_unit, self._units, self._pinned = old
            raise
        if self.version != old[0]:
            self._let_go_version(self.home / VERSIONS / old[0])
            self._pending.get().clear()  # fetches of its units: the new version's are its own
            self._infos.get().clear()  # a synced copy's objects replaced in place: asked again
            self._next = NextUses()  # its units' next uses
        return pinned

    def _fetch_version(self) -> str:
        """The dataset's current version, its metadata fetched into the cache unless it has it."""
        reserve = functools.partial(self._make_room, name=None, demand=True)
        return fetch_version(self.store, self.url, self.home, reserve=reserve)

    def _let_go_version(self, root: Path) -> None:
        """Let go of the cached version at ``root``: its hold (closed, not unlocked: a forked child
        that reads it keeps its copy), the units held of it, its places read (:meth:`_places`)."""
        hold = self._version_hold.pop(str(root), None)
        if hold is not None:
            os.close(hold)
        with self._lock.get():
            units = [self._held.pop(p) for p in [p for p in self._held if os.path.dirname(p) == str(root)]]
        for fd in units:
            let_go(fd)
        self._versions.get().pop(root, None)

    def _hold_version(self, root: Path) -> bool:
        """Hold the cached version at ``root`` for this object's life (a shared flock on its manifest,
        kept by forked children too: they read it), so that no process evicts its folder
        (eviction.evict_version); its folder touched, as the version opened last. False where it is not
        cached, or was evicted before the lock was taken."""
        try:
            fd = os.open(root / MANIFEST, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            hold(fd, named=f"{self.url} (version {root.name})")
            if os.fstat(fd).st_nlink == 0:  # deleted under the lock's wait
                os.close(fd)
                return False
            os.utime(root)  # its folder, not its manifest: a pickled copy checks the manifest's mtime
        except BaseException:
            os.close(fd)
            raise
        old = self._version_hold.pop(str(root), None)
        self._version_hold[str(root)] = fd
        if old is not None:
            os.close(old)  # closed, not unlocked: a forked child's copy would release the parent's lock
        return True

    def _map_unit(self, root: Path, key: str) -> Optional[np.ndarray]:
        """Unit ``key`` of the version at ``root``, mapped (fetched first unless the cache has it);
        None when the cache has no room for it (its records are read past the cache)."""
        fd = self._open_unit(root, key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            mapping = Mapping(fd, size) if size else None
        finally:
            os.close(fd)
        if mapping is None:
            return np.zeros(0, np.uint8)
        mapping.madvise(mmap.MADV_RANDOM)
        return np.asarray(mapping)

    def _batch_past(self) -> dict[tuple[int, int], bytes]:
        """The records the batch this thread reads took past the cache: its own, which no other
        batch's :meth:`release` clears."""
        local = self._past.get()
        if not hasattr(local, "records"):
            local.records = {}
        return cast(dict[tuple[int, int], bytes], local.records)

    def release(self) -> None:
        """The batch this thread read is done: the records it read past the cache go, the LMDB
        files of the batches read in this process are closed once none is being read
        (:meth:`_let_go_files`), and the units this process holds are let go of
        (:meth:`_let_go_units`)."""
        self._batch_past().clear()
        local = self._past.get()
        with self._batches.get():
            reading = self._reading.get()
            if getattr(local, "reading", False):
                local.reading = False
                reading[0] -= 1
            if not reading[0]:
                self._let_go_files()
        self._let_go_units()

    def _begin_batch(self) -> None:
        """A batch is being read in this thread until its :meth:`release` (waiting for another
        thread's :meth:`_let_go_files` to end: it closes what this batch may open)."""
        local = self._past.get()
        if not getattr(local, "reading", False):
            with self._batches.get():
                local.reading = True
                self._reading.get()[0] += 1

    def _let_go_files(self) -> None:
        """With a cache limit, close the LMDB data files this process opened for its batches (their
        environments, mappings and descriptors: packer.backends.base.Backend.let_go_files), which
        the next batch that needs one opens again, fetched first if it was evicted: an evicted
        file's disk space is freed with its last mapping, and no reader holds a file between
        batches. Without a limit they stay open (no per-batch cost). No batch is being read in
        this process meanwhile (the caller holds ``_batches``)."""
        pinned = self._pinned() if self._pinned is not None else None
        if self.limit is None or pinned is None or not pinned.data_fds:
            return
        BACKENDS[pinned.manifest.backend].let_go_files(pinned)

    def _let_go_units(self) -> None:
        """Let go of the units this process holds, with a memmap reader (see packer.read.remote), or
        an LMDB one under a cache limit: after each batch, so that a cache of a few units serves an
        epoch, and by a batch's download that finds no room (in any thread: the records other
        batches read past the cache stay theirs). With a cache limit a memmap unit's mappings go
        too (the disk space of an evicted unit is freed with its last mapping; an LMDB file's go
        after the batch, :meth:`_let_go_files`)."""
        pinned = self._pinned() if self._pinned is not None else None
        if pinned is None:
            return
        ranged = bool(pinned.shards) and isinstance(pinned.shards[0][0], RangedShard)
        if not ranged and self.limit is None:  # LMDB without a limit: held for the reader's life
            return
        with self._lock.get():
            held = dict(self._held)
            self._held.clear()
        if self.limit is not None and ranged:
            for shard, _ in pinned.shards:
                cast(RangedShard, shard).opened.clear()  # a mapping goes with its last buffer
        for fd in held.values():
            let_go(fd)

    def prefetch(
        self,
        records: np.ndarray,
        *,
        wait: bool = False,
        epoch: Optional[int] = None,
        read: Optional[int] = None,
        draw: Optional[int] = None,
    ) -> None:
        """Fetch the data files that ``records`` lie in and this version does not have yet, up to
        :data:`PREFETCH_UNITS` at a time, in this process's background threads: the sampler's next
        blocks (``wait`` False), or a batch about to be read (``wait``: until they are in, raising
        the first failure; a failed fetch is forgotten once raised, so a later batch tries again).
        A batch of ShardSampler's ``epoch`` counts its records read: a unit this process has read
        every record of this epoch is not needed again in it. ``read``: the draws of the planned
        ``epoch`` read by now in other processes (the sampler's, whose DataLoader workers read
        them), for eviction by next use; a process that reads batches itself counts them instead.
        ``draw``: a batch's first global draw of ``epoch``, where the process that reads it does not
        iterate the sampler (its DataLoader workers): with the sampler's :attr:`order` it places the
        batch in the epoch's plan (NextUses.follow)."""
        assert self._units is not None, "pin() first"
        pace = self._next.told_read(epoch, read)
        if pace is not None:
            turns.process_turns.get().consumed(pace * self._units.record_bytes)
        units = self._units
        root = self.home / VERSIONS / self.version
        pending = self._pending.get()
        futures = {}
        numbers = units.of[records]
        if wait:
            self._begin_batch()
            if self.limit is not None and self.order is not None and epoch is not None and draw is not None:
                self._next.follow(units, epoch, draw, records, self.order)
            self._next.reading, self._next.reading_epoch = len(records), epoch
        _, first = np.unique(numbers, return_index=True)
        order = numbers[np.sort(first)].tolist()  # in the order the records need them
        if not wait:
            self._next.count(units, numbers, wait, epoch)
            order.sort(key=self._next.soonest)  # the next needed first
        wanted = [units.keys[u] for u in order]
        if wait and self.limit is not None:  # from now until the batch is read: no prefetch evicts them
            for name in wanted:  # all before any fetch: one that waits lets go of them (_fetch_locked)
                if name not in pending:
                    self._hold_cached(root / name)
        folder = f"{root}{os.sep}"  # a string, not a Path per unit: this runs for every batch
        missing = [n for n in wanted if n not in pending and not os.path.exists(folder + n)]
        bypass = self._past_at_once(missing) if wait else []
        for name in wanted:
            if name in missing and name not in bypass:
                pool, fetch = turns.prefetcher.get(), functools.partial(self._fetch_into, root, name, demand=wait)
                if wait:
                    pending[name] = pool.submit(fetch)
                else:  # entered as it is submitted (its turn known before its thread starts); forgotten once done
                    rank = self._next.soonest(units.numbers[name])
                    pending[name] = turns.process_turns.get().enter(
                        self._turn_key(name), rank, functools.partial(pool.submit, fetch)
                    )
                    pending[name].add_done_callback(functools.partial(_forget, pending, name))
            if name in pending:
                futures[name] = pending[name]
        if not wait:
            return
        past = self._await(futures) + bypass
        # a prefetch that found no room left its unit to this batch; one evicted since, too
        again = [n for n in wanted if n not in past and not os.path.exists(folder + n)]
        pool = turns.prefetcher.get()
        for name in again:  # in pending while they run: a later batch waits for them, not a second download
            if name not in pending:
                pending[name] = pool.submit(self._fetch_into, root, name, demand=True)
        past += self._await({n: pending[n] for n in again})
        if past:  # no room in the cache for them: the batch's records of them read past it
            self._read_past(root, records[np.isin(numbers, [units.numbers[n] for n in past])])
        # read from now on: until its units are in, the batch is what comes next (needed_before)
        self._next.count(units, numbers, wait, epoch)

    def _past_at_once(self, names: list[str]) -> list[str]:
        """Of the memmap units ``names`` a batch needs and the cache does not have, those whose records
        it reads past the cache without trying to download them: no eviction would pay for them
        (NextUses.after: None) and the cache's free room, counted once for the batch, holds them
        no more (a global shuffle through a full cache, where each unit's try would take the
        cache's lock and count all of it to find that out)."""
        units = self._units
        if self.limit is None or units is None or not units.ranged or not names:
            return []
        room = [footprint(int(units.sizes[units.numbers[n]])) + 2 * BLOCK for n in names]
        fits = max(1, self.limit // max(room))
        lazy = [(n, r) for n, r in zip(names, room) if self._next.after(units.numbers[n], fits) is None]
        if not lazy:
            return []
        free, out = free_room(self.cache_dir, self.limit), []
        for name, need in lazy:
            if need <= free:
                free -= need  # left to its download, which reserves it (or finds it taken meanwhile)
            else:
                out.append(name)
        return out

    def _await(self, futures: dict[str, concurrent.futures.Future]) -> list[str]:
        """Wait for the fetches ``futures`` of a batch, raising the first failure (a failed fetch is
        forgotten once raised, so a later batch tries again): the units that found no room."""
        pending, past = self._pending.get(), []
        # a fetch ends by its own waits' deadlines (its lock, its turn, its room), whose lines name
        # the holder: this one backstops them, later (and a download's I/O, under its timeouts)
        deadline = time.monotonic() + 2 * settings.wait_s()
        for name, future in futures.items():
            if not future.done():
                waiting(f"the download of {name}")
            try:
                failure = future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise CacheWaitTimeout(
                    f"{self._named(name)}: waited {2 * settings.wait_s():g} s for its download in this process "
                    f"(pid {os.getpid()}; {settings.WAIT_ENV} sets the deadline)"
                ) from None
            pending.pop(name, None)  # done: a unit evicted since is fetched again when next needed
            if failure is not None:
                raise failure
            if future.result():
                past.append(name)
        return past

    def _read_past(self, root: Path, records: np.ndarray) -> None:
        """``records`` of the version at ``root``, read from the store past the cache for the batch
        being read (packer.read.remote.ranges): until :meth:`release`, its reader finds them there."""
        manifest, index, files, positions = self._places(root)
        names = data_files(manifest)
        records = np.unique(records)
        got = self._batch_past()
        for k in np.unique(files[records]).tolist():
            mine = records[files[records] == k]
            rows = rows_of(index, positions, mine)
            key = self._key(names[k])
            listed = int(manifest.shards[k]["bytes"])

            def seen(found: ObjectInfo, key: str = key, listed: int = listed) -> None:
                self._same_size(key, found, listed)
                self._infos.get().setdefault(key, found)

            try:
                data = read_records(
                    self.store, key, self._infos.get().get(key), rows, mine, seen=seen, named=self.store.name(key)
                )
            except DatasetError:
                suspect_files(root)  # as a unit refused (_fetch_unit)
                raise
            got.update(zip(((k, int(p)) for p in rows["position"].tolist()), data))

    def _record_past(self, root: Path, k: int, start: int) -> bytes:
        """The record at byte ``start`` of shard ``k``, read past the cache now: its unit has no room
        (a read the batch's :meth:`prefetch` did not foresee, or whose records a release dropped)."""
        _, _, files, positions = self._places(root)
        self._read_past(root, np.flatnonzero((files == k) & (positions == start))[:1])
        return self._batch_past()[(k, start)]

    def _fetch_into(self, root: Path, name: str, *, demand: bool) -> bool:
        """:meth:`_fetch_unit` in the background: the unit stays held (a batch's) or not (a
        prefetch, entered in the turns when submitted, whose download waits for its turn). True
        when a batch's unit found no room in the cache (its records are read past it)."""
        key = self._turn_key(name)
        try:
            if not demand and not os.path.exists(root / name):  # its turn before its unit's lock
                turns.process_turns.get().turn(key, named=self._named(name))
            fd = self._fetch_unit(root, name, demand=demand)
        finally:
            turns.process_turns.get().leave(key)
        if fd is not None:
            os.close(fd)
        return demand and fd is None

    def _turn_key(self, name: str) -> tuple[str, str]:
        """Unit ``name`` of this dataset, as the process's turns know it (they serve every dataset)."""
        return str(self.home), name

    @property
    def reads_here(self) -> bool:
        """Whether this process has read batches of a ShardSampler (else its DataLoader workers do)."""
        return self._next.reads_here

    def plan(self, epoch: int, records: np.ndarray) -> None:
        """The records this process will read in ``epoch``, in order (ShardSampler's, told when it
        is iterated in this process): eviction ranks units by their next use in it."""
        assert self._units is not None, "pin() first"
        self._next.plan(self._units, epoch, records)

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

    # --- units ----------------------------------------------------------------------------------

    def _open_file(self, root: Path, name: str) -> int:
        """:meth:`_open_unit` of a whole data file (an LMDB file; a memmap shard with no cache limit)."""
        fd = self._open_unit(root, name)
        assert fd is not None, "only a memmap unit is read past the cache, under a limit"
        return fd

    def _open_unit(self, root: Path, name: str) -> Optional[int]:
        """A descriptor of data file ``name`` of the version at ``root``: fetched and checked first
        unless the version already has it; held (shared flock) so that no process evicts it. None
        when the cache has no room for it (a memmap unit: its records are read past the cache)."""
        try:
            fd = open_regular(root / name)
        except FileNotFoundError:
            fd = -1
        if fd >= 0 and self._hold(fd, root / name):
            os.utime(fd)  # last opened: eviction takes the least recently opened first
            return fd
        if fd >= 0:
            os.close(fd)  # evicted between the open and the lock: fetch it again
        return self._fetch_unit(root, name)

    def _hold(self, fd: int, path: Path) -> bool:
        """Take the shared flock that keeps the unit open at ``fd`` (``path``) from eviction; False
        when it was evicted (unlinked) before the lock was taken."""
        held = open_held(f"/proc/self/fd/{fd}", named=str(path))
        linked = os.fstat(held).st_nlink >= 2  # else its names are gone: evicted
        if not linked:
            let_go(held)
            return False
        self._keep(held, path)
        return True

    def _keep(self, hold: int, path: Path) -> None:
        """Keep ``hold`` (a descriptor with the unit's shared flock) until :meth:`release` (a child
        forked from now on closes its copy: see _after_fork). From here on the descriptor is
        ``_held``'s: a batch's download in another thread that finds no room releases every unit
        the process holds, so the caller must not use ``hold`` again (it may be closed, and its
        number taken by another file: a reader reopening it through ``/proc/self/fd`` got
        FileNotFoundError, or the wrong file)."""
        with self._lock.get():
            old = self._held.pop(str(path), None)
            self._held[str(path)] = hold
            LOCKING.discard(hold)  # under the lock: a release closes it only after it left LOCKING
        if old is not None:
            let_go(old)

    def _until_room(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, again while it finds the cache full of units that readers hold
        (eviction.Full): between tries this process lets go of its units (another batch's download
        may need their room: two batches never wait on each other) and holds no node lock, until
        the wait's deadline (:func:`settings.wait_s`)."""
        deadline, pause = time.monotonic() + settings.wait_s(), 0.01
        while True:
            try:
                return attempt()
            except Full as full:
                self._let_go_units()
                if time.monotonic() > deadline:
                    raise full.error from None
                waiting("room in the cache")
                time.sleep(pause)
                pause = min(0.1, 2 * pause)

    def _disk_full(self, named: str, e: OSError) -> OSError | DatasetError:
        """``e`` as the one line a user reads where it says the cache's disk is full (a write of
        ``named``'s bytes into the cache), else ``e`` itself."""
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return e
        return DatasetError(
            f"{named}: the disk of the cache {self.cache_dir} is full ({e.strerror}); free room there, "
            f"or set a cache_limit that the disk holds"
        )

    def _fetch_unit(self, root: Path, name: str, *, demand: bool = True) -> Optional[int]:
        """:meth:`_fetch_locked`, a full disk said in one line naming the unit's object; a unit
        refused has the version's files.json read again at the next open (it may name the wrong key)."""
        try:
            return self._until_room(lambda: self._fetch_locked(root, name, demand=demand))
        except OSError as e:
            raise self._disk_full(self._named(name), e) from None
        except DatasetError:
            suspect_files(root)
            raise

    def _fetch_locked(self, root: Path, name: str, *, demand: bool = True) -> Optional[int]:
        """Unit ``name`` (a data file, or ``FILE@START-END``: a byte range of one) of the version at
        ``root`` in the cache, checked, linked into ``root``.
        A reader's fetch (``demand``) returns a descriptor of it, held, or None where the cache has
        no room for a memmap unit (the batch reads its records past the cache); a prefetch of the
        sampler's next blocks returns None and leaves it to eviction by next use, or skips it when
        there is no room for it without evicting what is needed sooner."""
        manifest, index, files, positions = self._places(root)
        file, span = unit_span(name)
        k = data_files(manifest).index(file)
        backend = BACKENDS[manifest.backend]
        inside = files == k
        if span is not None:
            inside &= (positions >= span[0]) & (positions < span[1])
        mine = np.flatnonzero(inside)
        rows = rows_of(index, positions, mine, span[0] if span is not None else 0)  # in the unit's own file
        order = np.argsort(rows["position"], kind="stable")
        mine, rows = mine[order], rows[order]
        # a batch that waits for another process's download of it lets go of its units first: that
        # download may wait for their room (two batches would otherwise wait on each other for good);
        # a prefetch only tries the lock: a unit another process fetches is left to it (its turn,
        # taken, would otherwise hold up the process's later prefetches behind that download)
        lock = self.home / LOCKS / f"unit-{name}"
        with locked(
            lock, named=self._named(name), waiting=self._let_go_units if demand else None, wait=demand
        ) as taken:
            if not taken:
                return None
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
                    return None  # no room: a prefetch leaves it to the batch, a batch reads past the cache
                held, unit = got
                try:
                    with contextlib.suppress(FileExistsError):
                        os.link(unit, root / name)  # held: no process can evict it meanwhile
                    # the reader's own descriptor, opened while the hold is still this thread's alone
                    # (once kept, it is any thread's release() to close: see _keep)
                    fd = os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_CLOEXEC) if demand else -1
                except BaseException:
                    let_go(held)
                    raise
                if not demand:
                    let_go(held)  # a prefetch's unit is left to eviction by next use
                    return None
                self._keep(held, root / name)
                return fd
        raise evicted_too_often(self._named(name))

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
        self, root: Path, name: str, k: int, expected: Expected, *, demand: bool
    ) -> Optional[tuple[int, Path]]:
        """A descriptor and the path of the unit of data file ``name`` (number ``k``) in ``units/``, downloaded and
        checked unless a version already has it, holding its shared flock since before it had its
        name there (so no process can evict it between its arrival and its use); None when a
        prefetch found no room. A unit is named by its object's size and version: where the
        manifest lists the size (memmap), the version of an object this process has not asked yet
        comes with its first unit's GET (no HEAD first: one first-byte wait less, the first
        batch's among them), and a cached unit is found by the records it was checked for."""
        manifest = self._places(root)[0]
        key = self._key(unit_span(name)[0])
        listed = int(manifest.shards[k]["bytes"]) if expected[0].lists_files(manifest) else None
        info = self._infos.get().get(key)
        if info is None and listed is None:
            info = self._missing_named(key, lambda: self._head(key))
        if info is not None:
            self._same_size(key, info, listed)
            cached = [self._unit_path(name, info)]
        else:
            found = (self.home / UNITS).glob(f"{glob.escape(name)}.{listed}.*")
            cached = sorted(p for p in found if not p.name.endswith(SIDECAR))
        for unit in (u for u in cached if checked_for(u, expected[2])):
            try:
                fd = open_held(unit, named=self._named(name))
            except FileNotFoundError:
                continue
            if os.fstat(fd).st_nlink >= 1:
                os.utime(fd)
                return fd, unit
            let_go(fd)  # evicted before the lock was taken: download it again
        try:
            return self._download_checked(name, key, info or ObjectInfo(cast(int, listed), ""), expected, demand=demand)
        except NoRoom:
            return None

    def _unit_path(self, name: str, info: ObjectInfo) -> Path:
        """Where unit ``name`` of the object version ``info`` is kept in ``units/``."""
        return self.home / UNITS / f"{name}.{info.size}.{digest(info.etag)}"

    def _missing_named(self, key: str, ask: Callable[[], T]) -> T:
        """``ask()`` about object ``key``, which missing is a DatasetError that says the manifest names it."""
        try:
            return ask()
        except ObjectNotFound:
            raise DatasetError(f"{self.store.name(key)}: missing (the manifest names it)") from None

    def _same_size(self, key: str, info: ObjectInfo, listed: Optional[int]) -> None:
        if listed is not None and info.size != listed:
            raise DatasetError(
                f"{self.store.name(key)}: {info.size} bytes, the manifest says {listed} (the dataset was "
                f"replaced since this version was opened, or its manifest does not match the store: open it again)"
            )

    def _download_checked(
        self, name: str, key: str, info: ObjectInfo, expected: Expected, *, demand: bool = True
    ) -> tuple[int, Path]:
        """Unit ``name`` of object ``key`` (``info``: its size, and its version unless "") downloaded
        and renamed into ``units/`` once its bytes match what ``expected`` says; a descriptor of it
        with its shared flock, taken before the rename, and its path. A concatenated backend's
        partial download is named by the records it is for (a process that knows the version and
        one that learns it from its GET resume the same one), another's by the version."""
        rows = expected[2]
        tag = digest(rows.tobytes() if expected[0].concatenated else info.etag)
        part = self.home / PARTIAL / f"{name}.{info.size}.{tag}"
        learned = [info]  # replaced by what a GET's response tells (info.etag "")

        def seen(found: ObjectInfo) -> None:
            self._same_size(key, found, info.size)
            learned[0] = found
            self._infos.get().setdefault(key, found)  # its other units ask If-Match it

        problem = ""
        for _ in range(VERIFY_ATTEMPTS):
            # a concatenated backend's records are checked as their bytes arrive (the check after
            # the download re-reads only those that did not arrive whole in one stream)
            received = Received(rows) if expected[0].concatenated else None
            get = functools.partial(
                download,
                self.store,
                part,
                key,
                learned[0],
                unit_span(name)[1],
                arrival=functools.partial(turns.process_turns.get().arrival, self._turn_key(name)),
                reserve=lambda files: self._make_room(
                    _with_sidecar(files, part, rows), name, demand=demand, past=demand and expected[0].concatenated
                ),
                received=received,
                seen=seen,
            )
            self._missing_named(key, get)
            problem = unit_problem(part, expected, received)
            if not problem:
                if not info.etag and learned[0] is info:  # resumed whole: no GET told the version
                    seen(self._missing_named(key, lambda: self._head(key)))
                unit = self._unit_path(name, learned[0])
                sidecar_of(part).write_bytes(sidecar_bytes(rows))  # reserved with the part (a resumed one: again)
                os.replace(sidecar_of(part), sidecar_of(unit))
                held = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
                LOCKING.add(held)  # until it is kept or closed: a child forked meanwhile closes its copy
                try:
                    hold(held, named=self._named(name))
                    # under the lock that counts the cache: a count between its listing of units/ and
                    # of partial/ would otherwise miss the unit in neither, and reserve its room again
                    counted = self.limit is not None
                    with cache_locked(self.cache_dir) if counted else contextlib.nullcontext():
                        os.replace(part, unit)
                except BaseException:
                    let_go(held)
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(log_of(part))
                return held, unit
            remove(part, log_of(part), sidecar_of(part))
        raise DatasetError(f"{self._named(name)}: {problem} after {VERIFY_ATTEMPTS} downloads")

    def _make_room(self, files: Files, name: Optional[str], *, demand: bool, past: bool = False) -> None:
        """Room under the cache limit for the ``files`` a download of unit ``name`` (None: a
        version's metadata) starts with, reserved (packer.read.remote.eviction.make_room), and the
        files made; a limit that cannot hold a unit fails, or where the batch can read its records
        past the cache (``past``) raises NoRoom (one that cannot hold the metadata and the largest
        unit fails in pin())."""
        if self.limit is None:
            create(files)
            return
        make_room(
            self.cache_dir,
            self.limit,
            files,
            home=self.home,
            demand=demand,
            next_use=self._next_use,
            needed_before=lambda there: (
                0 if name is None else self._next.needed_before(self._units, name, there, room_for(files))
            ),
            url=self.url,
            named=None if name is None else self._named(name),
            past=past,
            after=lambda fits: (
                -1 if self._units is None or not name else self._next.after(self._units.numbers[name], fits)
            ),
        )

    def _next_use(self, unit: Path) -> Optional[int]:
        """When cached ``unit`` is next needed (NextUses.rank; None: another dataset's)."""
        numbers = self._units.numbers if self._units is not None and unit.parent.parent == self.home else {}
        k = numbers.get(unit.name.rsplit(".", 2)[0])
        return None if k is None else self._next.rank(k)


def _with_sidecar(files: Files, part: Path, rows: np.ndarray) -> Files:
    """``files`` with the sidecar of download ``part``, checked for ``rows``: reserved and written
    with the part, so that the cache's count holds it from the start."""
    return {**files, sidecar_of(part): sidecar_bytes(rows)}


def _forget(pending: dict[str, concurrent.futures.Future], name: str, done: concurrent.futures.Future) -> None:
    """Forget prefetch ``done`` of unit ``name`` (a newer one of it stays)."""
    if pending.get(name) is done:
        del pending[name]


@contextlib.contextmanager
def local_version(url: str) -> Iterator[Path]:
    """The cache directory (default cache) of the current version of the dataset at ``url``: its
    manifest, index and label arrays (``packer info`` on a URL reads this local copy; ``verify``
    checks the store itself, packer.tools.verify). Held for the block (no process evicts it while
    it is read), let go of as the block ends, not when a garbage collection finds the Remote."""
    remote = Remote(url)
    root = Path(remote.pin().root)
    try:
        yield root
    finally:
        remote._let_go_version(root)
