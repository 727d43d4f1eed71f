"""Sequential record walks: every record of a dataset once, in the order it was written, at the disk's
sequential speed. Used by the whole-dataset passes: ``packer verify``, ``--resume``'s digest replay and
``--update``'s copy of unchanged records.

The training readers (packer.read) are built for random batches from data bigger than RAM: LMDB is
opened without readahead, so a cold record is faulted in one 4 KiB page at a time, which is right for
a random sample and ruinous for a pass over every record. A walk opens its own LMDB environment with
the kernel's readahead and follows a cursor through the keys in the order ``append=True`` laid them
out, and reads memmap shards with plain buffered file reads (no mmap: a truncated file is an error,
not a SIGBUS). A thread runs a chunk of records ahead, reading each and computing its CRC-32 (which
touches every page with the GIL released, so the page faults happen there, not under the GIL), then
copying it out of the map (records outlive the walk's environment), while the caller works on the
chunk before (a digest, a write): the disk and both cores work at once. Figures:
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

from .format import DatasetError, lmdb_key, shard_name

Raw = tuple[int, Optional[bytes | memoryview]]  # (record number, its bytes or None when missing)
Record = tuple[int, Optional[bytes], int]  # the same, copied, and the bytes' CRC-32 (0 when missing)
READ_BLOCK = 8 << 20  # bytes per buffered read of a memmap shard
CHUNK_BYTES, CHUNK_RECORDS = 4 << 20, 1024  # records handed from the reading thread at a time


def walk(
    root: str | os.PathLike,
    backend: str,
    index: np.ndarray,
    *,
    shard_files: Optional[list[str]] = None,
    extra_keys: Optional[Callable[[int], None]] = None,
) -> Generator[Record, None, None]:
    """Every record of the dataset (or staging folder) at ``root`` in index order, ``(i, bytes,
    crc32)``; bytes ``None`` (and CRC 0) for a record whose bytes are missing. Memmap shards are
    ``shard_files`` (a manifest's list) or the standard names; for LMDB, ``extra_keys(n)`` is told of
    keys the index does not name. The caller checks the LMDB pages first where the file is not one
    packer wrote itself (packer.read)."""
    if backend == "lmdb":
        return _ahead(_lmdb(Path(root), len(index), extra_keys))
    return _ahead(_memmap(Path(root), index, shard_files))


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


def _lmdb(root: Path, count: int, extra_keys: Optional[Callable[[int], None]]) -> Generator[Raw, None, None]:
    """A cursor over keys 0..count-1 in key order, through an environment with readahead on."""
    from .read import close_lmdb

    close_lmdb(root)  # py-lmdb opens a file once per process: the training handle must go first
    try:
        env = lmdb.open(str(root), readonly=True, lock=False, readahead=True, subdir=True, max_readers=8)
    except lmdb.Error as e:
        raise DatasetError(f"{root}: cannot open LMDB environment ({e})") from None
    extra = 0
    try:
        with env.begin(buffers=True) as txn:
            i = 0
            for key, value in txn.cursor():
                k = _key_number(bytes(key))
                if k is None or k >= count or k < i:
                    extra += 1
                    continue
                while i < k:  # keys the index names but the file lacks
                    yield i, None
                    i += 1
                yield i, value
                i += 1
            while i < count:
                yield i, None
                i += 1
    except lmdb.Error as e:
        raise DatasetError(f"{root}: data.mdb is damaged ({e})") from None
    finally:
        env.close()
    if extra and extra_keys is not None:
        extra_keys(extra)


def _key_number(key: bytes) -> Optional[int]:
    """The record number of a packer key (``lmdb_key``), or None for any other key."""
    return int(key) if len(key) == len(lmdb_key(0)) and key.isdigit() else None


def _memmap(root: Path, index: np.ndarray, shards: Optional[list[str]]) -> Generator[Raw, None, None]:
    """Records read shard by shard with large buffered reads; a missing shard gives None records."""
    current, f = -1, None
    try:
        for i, (k, offset, length) in enumerate(
            zip(index["shard"].tolist(), index["offset"].tolist(), index["length"].tolist())
        ):
            if k != current:
                if f is not None:
                    f.close()
                name = shards[k] if shards is not None and k < len(shards) else shard_name(k)
                path = root / name
                f, current = (open(path, "rb", buffering=READ_BLOCK) if path.is_file() else None), k
                if f is not None:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if f is None:
                yield i, None
                continue
            if f.tell() != offset:
                f.seek(offset)
            yield i, f.read(length)
    finally:
        if f is not None:
            f.close()
