"""Datasets in object storage (``s3://bucket/prefix/train.lmdb``, ``https://...``), read through a
node-local cache that the readers open as a local dataset.

A dataset URL resolves to a directory of the cache holding one version: its manifest, index and
label arrays, fetched and checked against the manifest's digests when the version is first opened
on the node, and its data files, each fetched when a reader first needs it (packer.pin's ``fetch``)
and hard-linked in. The readers (packer.backends) then read local files exactly as they read any
dataset; nothing of the store reaches them.

- **Units**: a data file is the unit fetched: a memmap shard or an LMDB segment, whole, in parallel
  ranged parts (packer.store.base), into ``partial/``, then renamed into ``units/``. A broken part
  is resumed from the byte it reached (``If-Match`` pins the object's version); parts already
  written by a process that died are kept and skipped (``.parts`` lists them).
- **Checked before any decoder sees a byte**: the size against the manifest, then every record the
  version's index names in the file by length and CRC-32 (LMDB files after their page tree is
  checked, as ``packer verify`` does); a mismatch is fetched again, up to :data:`VERIFY_ATTEMPTS`
  times, then a DatasetError names the object and the record.
- **Versions**: the version directory is keyed by the manifest's sha256 and units by file name,
  size and ETag, so a refreshed dataset gets a new version directory that reuses every unchanged
  segment (a sidecar lists the records each unit was checked for) and never serves a byte of the
  old one; a ShardDataset keeps reading the version it opened (its pickled copies reopen that one).
- **One fetch per node**: every process of the node (ranks, DataLoader workers) takes the file
  lock of a unit (flock: released by the kernel when its holder dies) before fetching it, and finds
  it fetched once the lock is theirs. Nothing is kept in shared memory.
- **cache_limit**: units no reader holds (each reader holds a shared flock on the units it opened)
  are evicted, least recently opened first, before a download would take the cache (every dataset
  under ``cache_dir``) past the limit; a download reserves its whole size first, so concurrent
  fetches never overshoot. When the readers hold too much to make room, the open fails clearly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import threading
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..backends import BACKENDS, Backend, data_files, record_places
from ..backends.base import FileKey, Pinned
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
from ..store.base import ObjectInfo, PerProcess
from ..store.published import FILES, files_json, parse_files, read_files, version_key

#: Data files fetched at once in the background per process (each in parallel parts itself).
PREFETCH_UNITS = 4
#: Downloads of a unit (or of a version's index) whose bytes do not match the manifest, before the
#: DatasetError: a transfer damaged on the way is fetched again, a damaged object fails.
VERIFY_ATTEMPTS = 3
_UNITS, _PARTIAL, _VERSIONS, _LOCKS = "units", "partial", "versions", "locks"
_SIDECAR = ".rows.npy"  # per unit: (position, length, crc32) of the records it was checked for
_ROWS_DTYPE = np.dtype([("position", "<i8"), ("length", "<u8"), ("crc32", "<u4")])
#: A unit's backend, the index rows it holds, and their (position, length, crc32) sorted by position.
_Expected = tuple[Backend, np.ndarray, np.ndarray]
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


_LOCKING: set[int] = set()  # descriptors of the flocks this process holds in _locked blocks


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block: the kernel releases it if the holder dies. A
    child forked meanwhile closes its copy at once (see _forget_locks): the lock is its parent's."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _LOCKING.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _LOCKING.discard(fd)
        os.close(fd)


def _forget_locks() -> None:
    """In a forked child: close the inherited descriptors of the parent's flocks, which would
    otherwise keep them held after the parent's block ends (flock belongs to the open file)."""
    for fd in list(_LOCKING):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKING.clear()


os.register_at_fork(after_in_child=_forget_locks)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


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
        self._hold_units()
        # set by pin(): the version's manifest, index and data file names (not the Pinned: that refers
        # back to this object, and a cycle would keep the units held until the garbage collector runs)
        self._layout: Optional[tuple[Manifest, np.ndarray, list[str]]] = None

    def __getstate__(self) -> dict[str, Any]:
        state = {k: self.__dict__[k] for k in ("url", "cache_dir", "limit", "home", "version")}
        return state | {"settings": self.store.settings()}  # the store as this process resolved it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state.pop("settings")
        self.__dict__.update(state)
        self._store = None
        self._hold_units()

    def _hold_units(self) -> None:
        """Start holding no units: ``_held`` maps a unit's path to a descriptor with its shared flock
        (no process evicts it), all closed when this object goes (its readers went before it)."""
        self._held: dict[str, int] = {}
        self._lock = PerProcess(threading.Lock)  # a fork may copy it held by a thread of the parent
        weakref.finalize(self, _close_held, self._held)
        self._pending: PerProcess[dict[str, concurrent.futures.Future]] = PerProcess(dict)  # name -> its fetch

    @property
    def store(self) -> Store:
        """This process's client (a forked child makes its own)."""
        mine = self._store
        if mine is None or mine[0] != os.getpid():
            mine = self._store = (os.getpid(), open_store(self.url, settings=self._settings))
        return mine[1]

    def _key(self, name: str) -> str:
        """The object key of data file ``name`` (relative to the dataset's URL): where the files.json
        of its version puts it when the version was published (packer.tools.publish), else ``name``
        (a synced copy: no files.json)."""
        listed = self.home / _VERSIONS / self.version / FILES
        if not listed.is_file():
            return name
        return parse_files(listed.read_bytes(), where=str(listed))[name].key

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
        self._layout = (pinned.manifest, pinned.index, data_files(pinned.manifest))
        return pinned

    def prefetch(self, records: np.ndarray, *, wait: bool = False) -> None:
        """Fetch the data files that ``records`` lie in and this version does not have yet, up to
        :data:`PREFETCH_UNITS` at a time, in this process's background threads: the sampler's next
        blocks (``wait`` False), or a batch about to be read (``wait``: until they are in, raising
        the first failure; a failed fetch is forgotten once raised, so a later batch tries again)."""
        assert self._layout is not None, "pin() first"
        manifest, index, names = self._layout
        root = self.home / _VERSIONS / self.version
        pending = self._pending.get()
        futures = {}
        for k in np.unique(record_places(manifest, index, records)[0]).tolist():
            name = names[k]
            if name not in pending and not (root / name).exists():
                pending[name] = _prefetcher.get().submit(self._fetch_unit, root, name)
            if name in pending:
                futures[name] = pending[name]
        for name, future in futures.items() if wait else ():
            failure = future.exception()
            if failure is not None:
                pending.pop(name, None)
                raise failure

    def _fetch_version(self) -> str:
        """The current version's key, its manifest and index fetched and checked into the cache first.
        An index that does not match the manifest (a refresh was publishing between the two reads)
        is fetched again with the manifest."""
        for d in (_UNITS, _PARTIAL, _VERSIONS, _LOCKS):
            (self.home / d).mkdir(parents=True, exist_ok=True)
        (self.home / "url").write_text(self.url + "\n")
        problem = ""
        for _ in range(VERIFY_ATTEMPTS):
            try:
                text = self.store.get(MANIFEST)
            except ObjectNotFound:
                raise DatasetError(f"{self.url}: not a packer dataset (no {MANIFEST}; wrong URL?)") from None
            version = hashlib.sha256(text).hexdigest()[:32]
            root = self.home / _VERSIONS / version
            if (root / MANIFEST).is_file():
                return version
            with _locked(self.home / _LOCKS / f"version-{version}"):
                if (root / MANIFEST).is_file():
                    return version
                problem = self._fetch_metadata(text, root)
                if not problem:
                    return version
        raise DatasetError(f"{self.url}: {problem} after {VERIFY_ATTEMPTS} downloads")

    def _fetch_metadata(self, text: bytes, root: Path) -> str:
        """Manifest ``text``'s index and label arrays downloaded and checked into ``root`` (renamed
        into place whole); what did not match ("" when all did)."""
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
            listed = read_files(self.store, root.name)  # None: a synced copy, everything at the top level
            if listed is not None:  # published (packer.tools.publish): the version's folder and files.json
                (staging / FILES).write_bytes(files_json(listed))
            arrays = {}
            for name in names:
                try:
                    key = version_key(root.name, name) if listed is not None else name
                    (staging / name).write_bytes(self.store.get(key))
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
        for _ in range(3):
            try:
                fd = open_regular(root / name)
            except FileNotFoundError:
                self._fetch_unit(root, name)
                continue
            if self._hold(fd, root / name):
                os.utime(fd)  # last opened: eviction takes the least recently opened first
                return fd
            os.close(fd)  # evicted between the open and the lock: fetch it again
        raise _evicted(self.store.name(name))

    def _hold(self, fd: int, path: Path, *, linked: bool = True) -> bool:
        """Take the shared flock that keeps the unit open at ``fd`` (``path``) from eviction; False
        when it was evicted (unlinked) before the lock was taken."""
        hold = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(hold, fcntl.LOCK_SH)
        if os.fstat(hold).st_nlink < (2 if linked else 1):  # its names are gone: evicted
            os.close(hold)
            return False
        with self._lock.get():
            old = self._held.pop(str(path), None)
            self._held[str(path)] = hold
        if old is not None:
            os.close(old)
        return True

    def _fetch_unit(self, root: Path, name: str) -> None:
        """Data file ``name`` of the version at ``root`` in the cache, checked, linked into ``root``."""
        manifest = Manifest.load(root)
        fd = open_regular(root / INDEX)
        try:
            index = map_npy(fd, root / INDEX)
        finally:
            os.close(fd)
        k = data_files(manifest).index(name)
        backend = BACKENDS[manifest.backend]
        files, positions = record_places(manifest, index)
        mine = np.flatnonzero(files == k)
        rows = np.empty(len(mine), _ROWS_DTYPE)
        rows["position"], rows["length"], rows["crc32"] = positions[mine], index["length"][mine], index["crc32"][mine]
        order = np.argsort(rows["position"], kind="stable")
        mine, rows = mine[order], rows[order]
        key = self._key(name)
        with _locked(self.home / _LOCKS / f"unit-{name}"):
            if (root / name).exists():
                return
            try:
                info = self.store.head(key)
            except ObjectNotFound:
                raise DatasetError(f"{self.store.name(key)}: missing (the manifest names it)") from None
            listed = int(manifest.shards[k]["bytes"]) if backend.lists_files(manifest) else None
            if listed is not None and info.size != listed:
                raise DatasetError(
                    f"{self.store.name(key)}: {info.size} bytes, the manifest says {listed} (the dataset was "
                    f"replaced since this version was opened: open it again)"
                )
            unit = self.home / _UNITS / f"{name}.{info.size}.{_digest(info.etag)}"
            if not _checked_for(unit, rows):
                self._download_checked(unit, key, info, (backend, mine, rows))
            fd = os.open(unit, os.O_RDONLY | os.O_CLOEXEC)
            held = self._hold(fd, root / name, linked=False)  # from here on: never evicted before its first use
            os.close(fd)
            if not held:
                raise _evicted(self.store.name(key))
            try:
                os.link(unit, root / name)
            except FileExistsError:
                pass
            os.utime(unit)

    def _download_checked(self, unit: Path, name: str, info: ObjectInfo, expected: _Expected) -> None:
        """Object ``name`` downloaded into ``unit`` once its bytes match what ``expected`` says."""
        part = self.home / _PARTIAL / unit.name
        rows = expected[2]
        problem = ""
        for _ in range(VERIFY_ATTEMPTS):
            self._download(part, name, info)
            problem = _unit_problem(part, expected)
            if not problem:
                np.save(part.with_name(part.name + _SIDECAR), rows)
                os.replace(part.with_name(part.name + _SIDECAR), unit.with_name(unit.name + _SIDECAR))
                os.replace(part, unit)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part.with_name(part.name + ".parts"))
                return
            _remove(part, part.with_name(part.name + ".parts"))
        raise DatasetError(f"{self.store.name(name)}: {problem} after {VERIFY_ATTEMPTS} downloads")

    def _download(self, part: Path, name: str, info: ObjectInfo) -> None:
        """Object ``name`` (``info``) downloaded into ``part``, resuming the parts a previous attempt
        (of any process) finished: ``part``'s ``.parts`` file lists them, one number a line."""
        done_file = part.with_name(part.name + ".parts")
        done: frozenset[int] = frozenset()
        if part.exists() and part.stat().st_size == info.size and done_file.exists():
            done = frozenset(int(n) for n in done_file.read_text().split() if n.isdigit())
        else:
            _remove(part, done_file)
            self._make_room(info.size, part)
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        log = os.open(done_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, info.size)
            try:
                self.store.download(name, fd, info, skip=done, part_done=lambda n: os.write(log, b"%d\n" % n))
            except ObjectChanged:
                _remove(part, done_file)
                raise DatasetError(
                    f"{self.store.name(name)}: replaced in the store while it was read (the dataset was "
                    f"refreshed: open it again)"
                ) from None
            os.fsync(fd)
        finally:
            os.close(fd)
            os.close(log)

    def _make_room(self, need: int, part: Path) -> None:
        """Evict units no reader holds, least recently opened first, until ``need`` more bytes fit
        under the cache limit, and reserve them: the download's file ``part`` is made that size
        before the lock goes, so it counts for the next one (the cache never exceeds the limit)."""
        if self.limit is None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.cache_dir / ".evict.lock"):
            units = [p for p in self.cache_dir.glob(f"*/{_UNITS}/*") if not p.name.endswith(_SIDECAR)]
            partial = [p for p in self.cache_dir.glob(f"*/{_PARTIAL}/*") if not p.name.endswith(".parts")]
            sizes = {p: _size(p) for p in units + partial}
            used = sum(sizes.values())
            for unit in sorted(units, key=lambda p: _mtime(p)):
                if used + need <= self.limit:
                    break
                if _evict(unit):
                    used -= sizes[unit]
            if used + need > self.limit:
                raise DatasetError(
                    f"{self.url}: cache_limit {self.limit} bytes is too small: {used} bytes of the cache "
                    f"{self.cache_dir} are held by open readers or downloads, and {need} more are needed"
                )
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, need)
            finally:
                os.close(fd)


_prefetcher = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(PREFETCH_UNITS, thread_name_prefix="packer-prefetch")
)


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
    try:
        known = np.load(unit.with_name(unit.name + _SIDECAR), allow_pickle=False)
    except (OSError, ValueError):
        return False
    if not unit.exists() or known.dtype != _ROWS_DTYPE:
        return False
    if not len(rows):
        return True
    at = np.searchsorted(known["position"], rows["position"])
    if (at >= len(known)).any():
        return False
    return bool((known[at] == rows).all())


def _unit_problem(path: Path, expected: _Expected) -> str:
    """What in the downloaded data file ``path`` does not match its records' index rows ("" if nothing)."""
    backend, mine, rows = expected
    try:
        backend.check_walkable(path)
        walked = backend.walk_file(path, mine, rows["position"], rows["length"], None)
        for j, (i, data) in enumerate(walked):
            if data is None:
                return f"record {i} is missing"
            if len(data) != int(rows["length"][j]):
                return f"record {i} is {len(data)} bytes, the index says {int(rows['length'][j])}"
            if zlib.crc32(data) != int(rows["crc32"][j]):
                return f"record {i}: CRC-32 differs from the index's (damaged bytes)"
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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
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
        os.close(fd)


def _evicted(name: str) -> DatasetError:
    return DatasetError(f"{name}: evicted from the cache as soon as it was fetched; raise cache_limit")


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
