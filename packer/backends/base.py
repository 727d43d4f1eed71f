"""What every backend provides (:class:`Backend`) and the reader interface they share (:class:`Reader`).

A backend is the pair of a way to store records (LMDB files keyed by number, or memmap shards of
concatenated bytes) and everything that knows it: the writer, the reader, the sequential walk over one
data file, the index rows' bounds and the per-file checks. packer.backends chooses one by the
manifest's ``backend`` from one table; nothing else looks at the name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Optional, Protocol, TypeVar

import numpy as np

from ..format import DatasetError, Manifest

if TYPE_CHECKING:
    from ..pin import Pinned
    from .memmap import Shard

Buffer = memoryview  # zero-copy view of one record's bytes, valid while its reader lives
Raw = tuple[int, Optional[bytes | memoryview]]  # (record number, its bytes or None when missing)
#: told of the records of a data file that no index row names: (file name, records, bytes)
ExtraKeys = Callable[[str, int, int], None]
T = TypeVar("T")


class OnFirstUse(Sequence[T], Generic[T]):
    """The pinned data files of a dataset read from object storage (packer.remote): file ``k`` is
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
        (packer.locality): a hint, so nothing is checked or raised here; the records' reads later
        check them. This base reader asks nothing."""

    def _bad(self, i: int, why: str) -> DatasetError:
        return DatasetError(f"{self.root}: record {i}: {why}", record=i)


def listed_sizes(root: Path, index: np.ndarray, manifest: Manifest) -> np.ndarray:
    """Each row's data file size as the manifest lists it (rows naming a file beyond the list refused)."""
    if index["shard"].max() >= len(manifest.shards):
        raise DatasetError(f"{root}: index names data files beyond the {len(manifest.shards)} listed")
    return np.array([int(s["bytes"]) for s in manifest.shards], dtype=np.uint64)[index["shard"]]


class Writer(Protocol):
    """A backend's record writer: appends records in order, says where each landed (data file number,
    position), and makes them durable at each checkpoint (a small JSON-able state a resumed build
    reopens the writer with: anything written after it is discarded)."""

    def append(self, data: bytes) -> tuple[int, int]: ...
    def checkpoint(self) -> dict[str, Any]: ...
    def close(self) -> list[dict[str, Any]]: ...


class Backend:
    """One backend's layout and code. ``keyed``: positions are key numbers, one per record, and the
    bytes no row names are counted by the walk (LMDB); otherwise byte offsets into the data file, the
    unnamed bytes are what the rows do not cover (memmap). ``concatenated``: data files are shards of
    ``shard_size`` records back to back (memmap), so the shard size shapes them and a file of records
    written elsewhere (a Dask fragment) is a shard as it is. ``suffix``: the output name that makes it
    the default (``out.lmdb``). ``cold_advice``: what ``packer bench`` suggests for a dataset of this
    backend bigger than the page cache. ``write_errors``: what its writer raises besides OSError."""

    name = ""
    suffix = ""
    cold_advice: tuple[str, ...] = ()
    write_errors: tuple[type[Exception], ...] = ()
    keyed = False
    concatenated = False
    reader: type[Reader] = Reader

    def data_files(self, manifest: Manifest) -> list[str]:
        """The dataset's data files, numbered as index rows' ``shard`` numbers them."""
        return [str(s["file"]) for s in manifest.shards]

    def record_places(
        self, manifest: Manifest, index: np.ndarray, rows: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows``' (all when None) data file number and position in it."""
        at = index if rows is None else index[rows]
        return at["shard"].astype(np.int64), at["offset"].astype(np.int64)

    def lists_files(self, manifest: Manifest) -> bool:
        """Whether ``manifest.shards`` lists the data files with their counts and sizes."""
        return True

    def check_places(self, root: Path, index: np.ndarray, manifest: Manifest) -> None:
        """Refuse rows that point outside what their data files can hold (DatasetError)."""
        raise NotImplementedError

    def check_manifest(self, manifest: Manifest) -> bool:
        """Whether the manifest's data file list is possible for this backend."""
        return True

    def open_writer(
        self, path: str | os.PathLike, state: Optional[dict[str, Any]], shard_size: int, first: int = 0, size: int = 0
    ) -> Writer:
        """A writer of the data files of the dataset staged at ``path``, numbered from ``first`` (a
        refresh's new segment: after the old data files, see packer.segments); ``size``: the bytes it
        is expected to write, when known."""
        raise NotImplementedError

    def written_from(self, root: Path, first: int) -> list[Path]:
        """The data files numbered ``first`` or later in ``root`` (left by an interrupted write)."""
        raise NotImplementedError

    def pin_files(
        self, root: str, manifest: Manifest, open_file: Callable[[str], int], *, lazy: bool = False
    ) -> tuple[Sequence[int], Sequence[Shard]]:
        """Hold the data files of the version being pinned (packer.pin): descriptors, or mappings;
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
