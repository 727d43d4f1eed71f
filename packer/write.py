"""Record writers, one per backend, with durable checkpoints that a resumed build can trust.

Both append records in order and report where each landed. ``checkpoint()`` makes everything
appended so far durable and returns a small JSON-able state; ``reopen`` with that state discards
anything written after it (a crash between a commit and the checkpoint) and continues.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

import lmdb

from .format import lmdb_key, lmdb_segment_name, shard_name


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path (directories make renames and new files durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a name unique to this attempt, fsync, rename: a reader sees the old file or the whole
    new one, and concurrent attempts (a retried Dask task) never mix bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            _sync(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
        self.env = lmdb.open(
            self.path,
            map_size=map_size,
            subdir=False,
            lock=False,
            sync=False,
            metasync=False,
            meminit=False,
            max_dbs=0,
            readahead=False,
        )
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
        return [{"file": self.name, "count": self.count, "bytes": os.path.getsize(self.path)}]


class MemmapWriter:
    """Plain files of concatenated records, ``shard_size`` records each, written sequentially."""

    def __init__(
        self, path: str | os.PathLike, state: dict[str, Any] | None = None, shard_size: int = 10_000, first: int = 0
    ) -> None:
        # ``first``: the number of this writer's first shard; a refresh's new segment numbers its
        # shards after the old ones (linked into the staging folder, never written to again)
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_size, self.first = shard_size, first
        self.shards: list[dict[str, Any]] = [dict(s) for s in state["shards"]] if state else []
        for extra in self.root.glob("shard-*.bin"):
            number = extra.name[len("shard-") : -len(".bin")]
            if number.isdigit() and int(number) >= first + len(self.shards):
                extra.unlink()  # written after the last checkpoint
        self._file: Optional[BinaryIO] = None
        if self.shards:
            last = self.shards[-1]
            self._file = open(self.root / last["file"], "r+b")
            self._file.truncate(last["bytes"])
            self._file.seek(last["bytes"])

    def append(self, data: bytes) -> tuple[int, int]:
        f = self._file
        if f is None or self.shards[-1]["count"] >= self.shard_size:
            f = self._next_shard()
        shard = self.shards[-1]
        offset = shard["bytes"]
        f.write(data)
        shard["bytes"] += len(data)
        shard["count"] += 1
        return self.first + len(self.shards) - 1, offset

    def _next_shard(self) -> BinaryIO:
        if self._file is not None:
            _sync(self._file)
            self._file.close()
        name = shard_name(self.first + len(self.shards))
        self._file = f = open(self.root / name, "wb", buffering=8 << 20)
        self.shards.append({"file": name, "count": 0, "bytes": 0})
        return f

    def checkpoint(self) -> dict[str, Any]:
        if self._file is not None:
            _sync(self._file)
        return {"shards": [dict(s) for s in self.shards]}

    def close(self) -> list[dict[str, Any]]:
        self.checkpoint()
        if self._file is not None:
            self._file.close()
        return [dict(s) for s in self.shards]


def open_writer(
    backend: str, path: str | os.PathLike, state: dict[str, Any] | None, shard_size: int, first: int = 0
) -> LmdbWriter | MemmapWriter:
    """A writer of the data files of the dataset being staged at ``path``, numbered from ``first``
    (a refresh's new segment: after the old data files, see packer.segments)."""
    if backend == "lmdb":
        return LmdbWriter(path, state, segment=first)
    return MemmapWriter(path, state, shard_size=shard_size, first=first)
