"""Sequential record walks: every record of a dataset once, in the order it was written, at the disk's
sequential speed. Used by the whole-dataset passes: ``packer verify``, ``packer compact`` and a
``--update`` that rewrites every record.

The training readers (packer.backends) are built for random batches from data bigger than RAM: LMDB is
opened without readahead, so a cold record is faulted in one 4 KiB page at a time, which is right for
a random sample and ruinous for a pass over every record. A walk goes through the data files one after
another, and each in the order its records lie in it (a refreshed dataset's rows point into several
files, see docs/FORMAT.md "Segments"), through its backend's ``walk_file``: for LMDB its own
environment per file, with the kernel's readahead, and a cursor through the keys in the order
``append=True`` laid them out; memmap shards with plain buffered file reads (no mmap: a truncated
file is an error, not a SIGBUS). A thread runs a
chunk of records ahead, reading each and computing its CRC-32 (which touches every page with the GIL
released, so the page faults happen there, not under the GIL), then copying it out of the map (records
outlive the walk's environment), while the caller works on the chunk before (a digest, a write): the
disk and both cores work at once. Figures:
docs/PERFORMANCE.md ("Whole-dataset passes at scale").
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from ..format import Manifest
from . import BACKENDS, data_files, record_places
from .base import ExtraKeys, Raw

Fetched = tuple[int, Optional[bytes], int]  # a Raw copied, with the bytes' CRC-32 (0 when missing)
CHUNK_BYTES, CHUNK_RECORDS = 4 << 20, 1024  # records handed from the reading thread at a time


class ByFile(NamedTuple):
    """The rows of a dataset grouped by data file: each row's file ``number`` and ``position`` in it
    (:func:`packer.backends.record_places`), the row numbers in ``order`` of both (stable: index
    order where positions tie), and where each file's rows start in that order (``bounds``: one
    more than there are data files; the rows after the last bound name a file that is not listed)."""

    number: np.ndarray
    position: np.ndarray
    order: np.ndarray
    bounds: np.ndarray

    def rows(self, k: int) -> np.ndarray:
        """Data file ``k``'s rows, by position."""
        return self.order[self.bounds[k] : self.bounds[k + 1]]


def by_file(manifest: Manifest, index: np.ndarray) -> ByFile:
    """``index``'s rows grouped by the data file they point into, each file's by position."""
    number, position = record_places(manifest, index)
    order = np.lexsort((position, number))
    return ByFile(number, position, order, np.searchsorted(number[order], np.arange(len(data_files(manifest)) + 1)))


def walk(
    root: str | os.PathLike,
    manifest: Manifest,
    index: np.ndarray,
    extra_keys: Optional[ExtraKeys] = None,
) -> Generator[Fetched, None, None]:
    """Every record of the dataset at ``root`` (laid out as ``manifest`` says), ``(i, bytes, crc32)``,
    in the order they lie on disk: data file by data file, each by position (byte offset or LMDB key
    number, :func:`packer.backends.record_places`); for a dataset written in one go, index order. Bytes
    ``None`` (and CRC 0) for a record whose bytes are missing. For LMDB, ``extra_keys(file, n, nbytes)``
    is told of the keys of a file that no row names. The caller checks a data file first where it
    is not one packer wrote itself (``Backend.check_walkable``)."""
    return _ahead(_by_file(Path(root), manifest, index, extra_keys))


def _by_file(
    root: Path,
    manifest: Manifest,
    index: np.ndarray,
    extra_keys: Optional[ExtraKeys],
) -> Generator[Raw, None, None]:
    """The rows of each data file in turn, in the order of their positions in it."""
    backend, files, places = BACKENDS[manifest.backend], data_files(manifest), by_file(manifest, index)
    for k, name in enumerate(files):
        rows = places.rows(k)
        yield from backend.walk_file(root / name, rows, places.position[rows], index["length"][rows], extra_keys)
    beyond = places.order[places.bounds[-1] :]  # rows naming a file that is not listed
    for i in beyond.tolist():
        yield i, None


def _ahead(records: Generator[Raw, None, None]) -> Generator[Fetched, None, None]:
    """``records`` with their CRC-32s, read in a thread (always the same one: an LMDB transaction
    belongs to its thread) a chunk ahead of the caller, who works on the chunk before. Chunks of
    ~CHUNK_BYTES (at most CHUNK_RECORDS): a hand-over per record would cost more than a small record."""

    def fetch() -> list[Fetched]:
        chunk: list[Fetched] = []
        size = 0
        for i, data in records:
            if data is None:
                chunk.append((i, None, 0))
            else:
                crc = zlib.crc32(data)  # first: faults the pages in without the GIL
                chunk.append((i, data if isinstance(data, bytes) else bytes(data), crc))
                size += len(data)
            if size >= CHUNK_BYTES or len(chunk) >= CHUNK_RECORDS:
                break
        return chunk

    with ThreadPoolExecutor(1, thread_name_prefix="packer-walk") as pool:
        try:
            pending: Future[list[Fetched]] = pool.submit(fetch)
            while chunk := pending.result():
                pending = pool.submit(fetch)
                yield from chunk
        finally:  # a caller that stops early: close the walk (its LMDB environment) in its own thread
            pending.exception()
            pool.submit(records.close).result()


class InOrder:
    """Records of a dataset by row number, for a caller that asks for them in about index order (a
    rewrite into one segment: ``packer compact``, a refresh that cannot link the old data files): one
    sequential walk per data file, each at the disk's speed, restarted when a row behind it is asked
    for (then the old and new scans did not list files in the same order). A data file's walk is
    closed when its last row was read."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> None:
        self.root, self.backend = Path(root), BACKENDS[manifest.backend]
        self.files, self.index = data_files(manifest), index
        places = by_file(manifest, index)
        self.number, self.position = places.number, places.position
        self._rows = [places.rows(k) for k in range(len(self.files))]
        self._walks: dict[int, tuple[Generator[Fetched, None, None], list[int]]] = {}

    def get(self, j: int) -> tuple[Optional[bytes], int]:
        """Row ``j``'s bytes and their CRC-32 (None and 0 when missing from its data file)."""
        k = int(self.number[j])
        if k >= len(self.files):
            return None, 0
        held = self._walks.get(k)
        if held is None or (held[1][0] >= 0 and self.position[j] <= self.position[held[1][0]]):
            self._close(k)
            rows = self._rows[k]
            path = self.root / self.files[k]
            raw = self.backend.walk_file(path, rows, self.position[rows], self.index["length"][rows], None)
            held = self._walks[k] = (_ahead(raw), [-1, len(rows)])  # [last row read, rows left]
        records, state = held
        for i, data, crc in records:
            state[0], state[1] = i, state[1] - 1
            if state[1] == 0:
                self._close(k)
            if i == j:
                return data, crc
        return None, 0

    def intact(self, j: int) -> Optional[bytes]:
        """Row ``j``'s bytes when they are there with the length and CRC-32 its index row says, else
        None (missing or damaged since they were written)."""
        data, crc = self.get(j)
        row = self.index[j]
        return data if data is not None and len(data) == int(row["length"]) and crc == int(row["crc32"]) else None

    def _close(self, k: int) -> None:
        held = self._walks.pop(k, None)
        if held is not None:
            held[0].close()

    def close(self) -> None:
        for k in list(self._walks):
            self._close(k)
