"""Sequential record walks: every record of a dataset once, in the order it was written, at the disk's
sequential speed. Used by the whole-dataset passes: ``packer verify``, ``packer compact`` and a
``--update`` that rewrites every record.

The training readers (packer.read) are built for random batches from data bigger than RAM: LMDB is
opened without readahead, so a cold record is faulted in one 4 KiB page at a time, which is right for
a random sample and ruinous for a pass over every record. A walk goes through the data files one after
another, and each in the order its records lie in it (a refreshed dataset's rows point into several
files, see docs/FORMAT.md "Segments"): for LMDB its own environment per file, with the kernel's
readahead, and a cursor through the keys in the order ``append=True`` laid them out; memmap shards
with plain buffered file reads (no mmap: a truncated file is an error, not a SIGBUS). A thread runs a
chunk of records ahead, reading each and computing its CRC-32 (which touches every page with the GIL
released, so the page faults happen there, not under the GIL), then copying it out of the map (records
outlive the walk's environment), while the caller works on the chunk before (a digest, a write): the
disk and both cores work at once. Figures:
docs/PERFORMANCE.md ("Whole-dataset passes at scale").
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import lmdb
import numpy as np

from .format import DatasetError, Manifest, data_files, lmdb_key, record_places

Raw = tuple[int, Optional[bytes | memoryview]]  # (record number, its bytes or None when missing)
Record = tuple[int, Optional[bytes], int]  # the same, copied, and the bytes' CRC-32 (0 when missing)
READ_BLOCK = 8 << 20  # bytes per buffered read of a memmap shard
CHUNK_BYTES, CHUNK_RECORDS = 4 << 20, 1024  # records handed from the reading thread at a time


def walk(
    root: str | os.PathLike,
    manifest: Manifest,
    index: np.ndarray,
    extra_keys: Optional[Callable[[str, int, int], None]] = None,
) -> Generator[Record, None, None]:
    """Every record of the dataset at ``root`` (laid out as ``manifest`` says), ``(i, bytes, crc32)``,
    in the order they lie on disk: data file by data file, each by position (byte offset or LMDB key
    number, :func:`packer.format.record_places`); for a dataset written in one go, index order. Bytes
    ``None`` (and CRC 0) for a record whose bytes are missing. For LMDB, ``extra_keys(file, n, nbytes)``
    is told of the keys of a file that no row names. The caller checks the LMDB pages first where the
    file is not one packer wrote itself (packer.read)."""
    places = record_places(manifest, index)
    return _ahead(_by_file(Path(root), manifest.backend, index, data_files(manifest), places, extra_keys))


def _by_file(
    root: Path,
    backend: str,
    index: np.ndarray,
    files: list[str],
    places: tuple[np.ndarray, np.ndarray],
    extra_keys: Optional[Callable[[str, int, int], None]],
) -> Generator[Raw, None, None]:
    """The rows of each data file in turn, in the order of their positions in it."""
    number, position = places
    order = np.lexsort((position, number))  # stable: index order where positions tie
    bounds = np.searchsorted(number[order], np.arange(len(files) + 1))
    for k, name in enumerate(files):
        rows = order[bounds[k] : bounds[k + 1]]
        if backend == "lmdb":
            yield from _lmdb(root / name, rows, position[rows], extra_keys)
        else:
            yield from _memmap(root / name, rows, position[rows], index["length"][rows])
    beyond = order[bounds[-1] :]  # rows naming a file that is not listed
    for i in beyond.tolist():
        yield i, None


def _ahead(records: Generator[Raw, None, None]) -> Generator[Record, None, None]:
    """``records`` with their CRC-32s, read in a thread (always the same one: an LMDB transaction
    belongs to its thread) a chunk ahead of the caller, who works on the chunk before. Chunks of
    ~CHUNK_BYTES (at most CHUNK_RECORDS): a hand-over per record would cost more than a small record."""

    def fetch() -> list[Record]:
        chunk: list[Record] = []
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
            pending: Future[list[Record]] = pool.submit(fetch)
            while chunk := pending.result():
                pending = pool.submit(fetch)
                yield from chunk
        finally:  # a caller that stops early: close the walk (its LMDB environment) in its own thread
            pending.exception()
            pool.submit(records.close).result()


def _lmdb(
    path: Path, rows: np.ndarray, keys: np.ndarray, extra_keys: Optional[Callable[[str, int, int], None]]
) -> Generator[Raw, None, None]:
    """A cursor over the keys of one LMDB data file in key order, through an environment with readahead
    on; ``rows`` (sorted by their ``keys``) get their values, or None where the file lacks the key."""
    from .read import close_lmdb

    if not path.is_file():
        yield from ((i, None) for i in rows.tolist())
        return
    st = os.stat(path)
    close_lmdb(path.parent, file=(st.st_dev, st.st_ino))  # py-lmdb opens a file once per process
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=True, subdir=False, max_readers=8)
    except lmdb.Error as e:
        raise DatasetError(f"{path}: cannot open LMDB environment ({e})") from None
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


def _memmap(path: Path, rows: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> Generator[Raw, None, None]:
    """One shard's ``rows`` (sorted by their ``offsets``) read with large buffered reads; None records
    when the shard is missing."""
    if not path.is_file():
        yield from ((i, None) for i in rows.tolist())
        return
    with open(path, "rb", buffering=READ_BLOCK) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for i, offset, length in zip(rows.tolist(), offsets.tolist(), lengths.tolist()):
            if f.tell() != offset:
                f.seek(offset)
            yield i, f.read(length)


class InOrder:
    """Records of a dataset by row number, for a caller that asks for them in about index order (a
    rewrite into one segment: ``packer compact``, a refresh that cannot link the old data files): one
    sequential walk per data file, each at the disk's speed, restarted when a row behind it is asked
    for (then the old and new scans did not list files in the same order). A data file's walk is
    closed when its last row was read."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, index: np.ndarray) -> None:
        self.root, self.backend = Path(root), manifest.backend
        self.files, self.index = data_files(manifest), index
        self.number, self.position = record_places(manifest, index)
        order = np.lexsort((self.position, self.number))
        bounds = np.searchsorted(self.number[order], np.arange(len(self.files) + 1))
        self._rows = [order[bounds[k] : bounds[k + 1]] for k in range(len(self.files))]
        self._walks: dict[int, tuple[Generator[Record, None, None], list[int]]] = {}

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
            raw = (
                _lmdb(path, rows, self.position[rows], None)
                if self.backend == "lmdb"
                else _memmap(path, rows, self.position[rows], self.index["length"][rows])
            )
            held = self._walks[k] = (_ahead(raw), [-1, len(rows)])  # [last row read, rows left]
        records, state = held
        for i, data, crc in records:
            state[0], state[1] = i, state[1] - 1
            if state[1] == 0:
                self._close(k)
            if i == j:
                return data, crc
        return None, 0

    def _close(self, k: int) -> None:
        held = self._walks.pop(k, None)
        if held is not None:
            held[0].close()

    def close(self) -> None:
        for k in list(self._walks):
            self._close(k)
