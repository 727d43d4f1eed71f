"""What every backend provides (:class:`Backend`), the reader interface they share (:class:`Reader`)
and the pinned version of a dataset readers read from (:class:`Pinned`, opened by packer.backends.pin).

A backend is the pair of a way to store records (LMDB files keyed by number, or memmap shards of
concatenated bytes) and everything that knows it: the writer, the reader, the sequential walk over one
data file, the index rows' bounds and the per-file checks. packer.backends chooses one by the
manifest's ``backend`` from one table; nothing else looks at the name.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, Optional, Protocol, TypeVar

import numpy as np

from ..errors import DatasetReplaced
from ..format import LAYOUTS, DatasetError, Layout, Manifest, fd_path

Buffer = memoryview  # zero-copy view of one record's bytes, valid while its reader lives
Raw = tuple[int, Optional[bytes | memoryview]]  # (record number, its bytes or None when missing)
#: told of the records of a data file that no index row names: (file name, records, bytes)
ExtraKeys = Callable[[str, int, int], None]
T = TypeVar("T")


class OnFirstUse(Sequence[T], Generic[T]):
    """The pinned data files of a dataset read from object storage (packer.read.remote): file ``k`` is
    opened (``open_one(k)``, which fetches it into the cache first) when a reader first asks for it,
    not all at once, so the first batch waits for its own data files only. Iterating it opens none."""

    def __init__(self, count: int, open_one: Callable[[int], T]) -> None:
        self._count, self._open_one = count, open_one
        self.opened: dict[int, T] = {}
        self._lock = (os.getpid(), threading.Lock())

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k: int) -> T:  # type: ignore[override]  # no slices: readers index one file
        got = self.opened.get(k)
        if got is None:
            if not 0 <= k < self._count:
                raise IndexError(k)
            if self._lock[0] != os.getpid():  # forked: the parent's lock may have been copied held
                self._lock = (os.getpid(), threading.Lock())
            with self._lock[1]:
                got = self.opened.get(k)
                if got is None:
                    got = self.opened[k] = self._open_one(k)
        return got

    def __iter__(self) -> Iterator[T]:
        return iter(list(self.opened.values()))

    def forget(self) -> dict[int, T]:
        """The files opened so far (file number -> what ``open_one`` gave), forgotten: the next use
        of each opens it again. The caller closes them, once no reader in this process uses them."""
        if self._lock[0] != os.getpid():
            self._lock = (os.getpid(), threading.Lock())
        with self._lock[1]:
            opened, self.opened = self.opened, {}
        return opened


class Mapped(Protocol):
    """A memmap shard's mapping (packer.backends.memmap.Mapping), as its reader uses it."""

    def __len__(self) -> int: ...
    def madvise(self, advice: int, start: int = 0, length: Optional[int] = None) -> None: ...


Shard = tuple[np.ndarray, Optional[Mapped]]  # a shard's bytes, and their mapping (None when empty)
FileKey = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns): one version of one file


def file_key(st: os.stat_result) -> FileKey:
    """A file's identity (:data:`FileKey`) from its stat."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Pinned:
    """Manifest, index, source paths, label arrays and data files of one version of the dataset at
    ``root`` (:func:`packer.backends.pin.pin` opens one; here, beside the readers that take it, so that
    the backends need not import pin). ``files`` names each file's identity; ``multi``/``targets``
    are the label arrays the dataset has (else None); ``data_fds`` hold the LMDB data files open, in
    segment order (:func:`packer.backends.data_files`); ``shards`` are the memmap shards' mappings, in
    order."""

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        arrays: tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]],
        files: dict[str, FileKey],
        data_fds: Sequence[int],
        shards: Sequence[Shard],
    ) -> None:
        self.root, self.manifest = root, manifest
        self.index, self.sources, self.multi, self.targets = arrays
        self.files, self.data_fds, self.shards = files, data_fds, shards
        self.data_names = LAYOUTS[manifest.backend].data_files(manifest) if data_fds else []
        if data_fds:
            self._close = weakref.finalize(self, close_fds, data_fds)

    def data_key(self, k: int) -> FileKey:
        """The identity of LMDB data file ``k``: what py-lmdb's "already open" guard keys on (its
        first two fields), shared by every version of the dataset that keeps that file."""
        self.data_fds[k]  # opened first where data files are opened on first use (packer.read.remote)
        return self.files[self.data_names[k]]

    def data_path(self, k: int) -> str:
        """A path that opens the pinned LMDB data file ``k`` itself, deleted or not (/proc/self/fd/N
        on Linux, /dev/fd/N on macOS); elsewhere its path, while the file there is still the pinned one."""
        at = fd_path(self.data_fds[k])
        if at is not None:
            return at
        path = os.path.join(self.root, self.data_names[k])
        try:
            if file_key(os.stat(path)) == self.data_key(k):
                return path
        except OSError:
            pass
        raise replaced(self.root)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:  # an OnFirstUse: those opened
        os.close(fd)


def replaced(root: str) -> DatasetReplaced:
    return DatasetReplaced(
        f"{root}: the dataset was replaced since it was opened (a build --update or --force ran); "
        f"create a new ShardDataset to read the new version"
    )


class Reader:
    """Fetches record bytes by index from one pinned version of a dataset."""

    def __init__(self, pinned: Pinned, index: Optional[np.ndarray] = None) -> None:
        self.pinned = pinned
        self.root = pinned.root
        self.manifest = pinned.manifest
        self.index = pinned.index if index is None else index

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

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the disk now for the records of ``ranges`` (first, end), each run of them stored
        together in as few requests as the kernel takes, and return without waiting
        (packer.backends.locality): a hint, so nothing is checked or raised here; the records' reads later
        check them. This base reader asks nothing."""

    def _bad(self, i: int, why: str) -> DatasetError:
        return DatasetError(f"{self.root}: record {i}: {why}", record=i)


class Writer(Protocol):
    """A backend's record writer: appends records in order, says where each landed (data file number,
    position), and makes them durable at each checkpoint (a small JSON-able state a resumed build
    reopens the writer with: anything written after it is discarded)."""

    def append(self, data: bytes) -> tuple[int, int]: ...
    def checkpoint(self) -> dict[str, Any]: ...
    def close(self) -> list[dict[str, Any]]: ...


class Backend(Layout):
    """One backend's layout and code. ``keyed``: positions are key numbers, one per record, and the
    bytes no row names are counted by the walk (LMDB); otherwise byte offsets into the data file, the
    unnamed bytes are what the rows do not cover (memmap). ``concatenated``: data files are shards of
    ``shard_size`` records back to back (memmap), so the shard size shapes them and a file of records
    written elsewhere (a Dask fragment) is a shard as it is. ``suffix``: the output name that makes it
    the default (``out.lmdb``). ``cold_advice``: what ``packer bench`` suggests for a dataset of this
    backend bigger than the page cache. ``write_errors``: what its writer raises besides OSError."""

    suffix = ""
    cold_advice: tuple[str, ...] = ()
    write_errors: tuple[type[Exception], ...] = ()
    keyed = False
    concatenated = False
    reader: type[Reader] = Reader

    def open_writer(
        self, path: str | os.PathLike, state: Optional[dict[str, Any]], shard_size: int, first: int = 0, size: int = 0
    ) -> Writer:
        """A writer of the data files of the dataset staged at ``path``, numbered from ``first`` (a
        refresh's new segment: after the old data files, see packer.builder.segments); ``size``: the bytes it
        is expected to write, when known."""
        raise NotImplementedError

    def written_from(self, root: Path, first: int) -> list[Path]:
        """The data files numbered ``first`` or later in ``root`` (left by an interrupted write)."""
        raise NotImplementedError

    def pin_files(
        self, root: str, manifest: Manifest, open_file: Callable[[str], int], *, lazy: bool = False
    ) -> tuple[Sequence[int], Sequence[Shard]]:
        """Hold the data files of the version being pinned (packer.backends.pin): descriptors, or mappings;
        ``lazy``: each on first use (:class:`OnFirstUse`)."""
        raise NotImplementedError

    def walk_file(
        self, path: Path, rows: np.ndarray, positions: np.ndarray, lengths: np.ndarray, extra: Optional[ExtraKeys]
    ) -> Generator[Raw, None, None]:
        """The ``rows`` of data file ``path`` (sorted by their ``positions``) in the order they lie in
        it, at the disk's sequential speed; None for a record the file lacks. ``extra`` is told of
        the records no row names, where the backend can tell."""
        raise NotImplementedError

    def check_walkable(self, path: Path) -> None:
        """Refuse a data file packer may not have written itself before a walk reads it through."""

    def check_files(self, root: Path, manifest: Manifest) -> list[str]:
        """``packer verify``'s whole-file checks before the walk: problems to report (a file no reader
        may touch raises DatasetError)."""
        return []

    def close(self, root: Optional[str | os.PathLike] = None) -> None:
        """Let go of this process's handles on the dataset at ``root`` (all when None), e.g. before a
        rename replaces it."""

    def let_go_files(self, pinned: Pinned) -> None:
        """Close this process's handles on the data files ``pinned`` opened on first use
        (:class:`OnFirstUse`: a dataset read from object storage), each opened again (fetched) when
        next read: under a cache limit they go after each batch, so that eviction frees their disk
        space (packer.read.remote). The caller knows that no reader in this process reads them now."""
        if isinstance(pinned.data_fds, OnFirstUse):
            close_fds(list(pinned.data_fds.forget().values()))
