"""The memmap backend: plain files of records concatenated back to back (``shard-NNNNN.bin``), written
sequentially, mapped whole by the readers, read with large buffered reads by the walk."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from ..format import DatasetError, Manifest, MemmapLayout, open_regular, shard_name
from . import locality
from .base import Backend, Buffer, ExtraKeys, OnFirstUse, Raw, Reader, Shard
from .write import open_written, sync_file

READ_BLOCK = 8 << 20  # bytes per buffered read of a shard in a walk


class MemmapReader(Reader):
    """Records from the memmap shards. Each shard is mapped with the kernel's readahead off
    (MADV_RANDOM), and each record fetched is asked for whole (MADV_WILLNEED on its exact byte range)
    before it is read: a batch's reads are then in flight together, and nothing beyond them is read.
    With readahead on, one page fault read the disk's read_ahead_kb around it: fine for a dataset that
    fits in RAM, which keeps the over-read, but several times slower once the dataset is bigger than
    the page cache (docs/PERFORMANCE.md, "Cold reads").

    A shard truncated in place after it was mapped would fault (SIGBUS) on the lost pages, so before
    a batch is read each shard it touches is looked up once (one stat): the pinned file, still at its
    path and now shorter than the batch needs, is refused. A pinned file no longer at its path (a
    refresh deleted it) has no name left to be truncated through."""

    def get(self, i: int) -> Buffer:
        return self.get_many([i])[0]

    def get_many(self, indices: Sequence[int]) -> list[Buffer]:
        rows = self.index[np.asarray(indices, dtype=np.int64)]
        ends = rows["offset"] + rows["length"]
        for k in np.unique(rows["shard"]).tolist():
            name, mapped = str(self.manifest.shards[k]["file"]), len(self.pinned.shards[k][0])
            pinned = self.pinned.files.get(name)  # None: mapped in ranges of the cache (packer.read.remote)
            try:
                st = os.stat(os.path.join(self.root, name))
                if pinned is not None and (st.st_dev, st.st_ino) == pinned[:2]:
                    mapped = min(mapped, st.st_size)
            except OSError:
                pass
            short = (rows["shard"] == k) & (ends > mapped)
            if short.any():
                first = int(np.flatnonzero(short)[0])
                raise self._bad(
                    indices[first], f"{name}: shard is truncated ({mapped} bytes, needs {int(ends[first])})"
                )
        return [self._slice(row) for row in rows]

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """One MADV_WILLNEED per shard's run of the records (they are stored in index order)."""
        rows = self.index[locality.records(ranges, len(self.index))]
        for k in np.unique(rows["shard"]).tolist():
            mapping = self.pinned.shards[k][1]
            if mapping is None:
                continue
            name = str(self.manifest.shards[k]["file"])
            mine = rows[rows["shard"] == k]
            runs = [
                (a, min(b, len(mapping))) for a, b in locality.runs(mine["offset"], mine["length"]) if a < len(mapping)
            ]
            for start, length in locality.pieces(runs, locality.advice_bytes(self.pinned.files[name][0])):
                mapping.madvise(mmap.MADV_WILLNEED, start, length)

    def _slice(self, row: np.void) -> Buffer:
        start, length = int(row["offset"]), int(row["length"])
        array, mapping = self.pinned.shards[int(row["shard"])]
        if mapping is not None and length and 0 <= start < len(mapping):
            mapping.madvise(mmap.MADV_WILLNEED, start, min(length, len(mapping) - start))
        return array[start : start + length].data


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
        for extra in _shards_from(self.root, first + len(self.shards)):
            extra.unlink()  # written after the last checkpoint
        self._file: Optional[BinaryIO] = None
        if self.shards:
            last = self.shards[-1]
            self._file = os.fdopen(open_written(self.root / last["file"], new=False), "r+b")
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
            sync_file(self._file)
            self._file.close()
        name = shard_name(self.first + len(self.shards))
        self._file = f = os.fdopen(open_written(self.root / name, new=True), "wb", buffering=8 << 20)
        self.shards.append({"file": name, "count": 0, "bytes": 0})
        return f

    def checkpoint(self) -> dict[str, Any]:
        if self._file is not None:
            sync_file(self._file)
        return {"shards": [dict(s) for s in self.shards]}

    def close(self) -> list[dict[str, Any]]:
        self.checkpoint()
        if self._file is not None:
            self._file.close()
        return [dict(s) for s in self.shards]


def _walk(path: Path, rows: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> Generator[Raw, None, None]:
    """One shard's ``rows`` (sorted by their ``offsets``) read with large buffered reads; None records
    when the shard is missing."""
    try:
        fd = open_regular(path)  # the dataset's own file, not what a symlink there leads to
    except FileNotFoundError:
        yield from ((i, None) for i in rows.tolist())
        return
    with open(fd, "rb", buffering=READ_BLOCK) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for i, offset, length in zip(rows.tolist(), offsets.tolist(), lengths.tolist()):
            if f.tell() != offset:
                f.seek(offset)
            yield i, f.read(length)


def _map_shard(root: str, info: dict, open_file) -> Shard:
    """A memmap shard, mapped whole with the kernel's readahead off (see MemmapReader), its
    descriptor closed: the mapping alone keeps the file readable. A truncated shard is mapped as far
    as it goes: the reader refuses the records past its end (and ``packer verify`` names them)."""
    name = str(info["file"])
    fd = open_file(name)
    try:
        nbytes = min(int(info["bytes"]), os.fstat(fd).st_size)
        if nbytes == 0:
            return np.zeros(0, np.uint8), None
        try:
            mapping = Mapping(fd, nbytes)
        except OSError as e:
            why = (
                "out of address space (ulimit -v) or mappings (too many shards mapped: vm.max_map_count)"
                if e.errno == errno.ENOMEM
                else e.strerror
            )
            raise DatasetError(f"{root}: shard {name} cannot be mapped ({why})") from None
    finally:
        os.close(fd)
    mapping.madvise(mmap.MADV_RANDOM)
    return np.asarray(mapping), mapping


class Memmap(MemmapLayout, Backend):
    """memmap: shards of ``shard_size`` records, record ``i`` at byte ``offset`` of shard ``shard``."""

    concatenated = True
    reader = MemmapReader

    def open_writer(
        self, path: str | os.PathLike, state: Optional[dict[str, Any]], shard_size: int, first: int = 0, size: int = 0
    ) -> MemmapWriter:
        return MemmapWriter(path, state, shard_size=shard_size, first=first)

    def written_from(self, root: Path, first: int) -> list[Path]:
        return _shards_from(root, first)

    def pin_files(
        self, root: str, manifest: Manifest, open_file: Callable[[str], int], *, lazy: bool = False
    ) -> tuple[Sequence[int], Sequence[Shard]]:
        if lazy:
            return [], OnFirstUse(len(manifest.shards), lambda k: _map_shard(root, manifest.shards[k], open_file))
        return [], [_map_shard(root, info, open_file) for info in manifest.shards]

    def walk_file(
        self, path: Path, rows: np.ndarray, positions: np.ndarray, lengths: np.ndarray, extra: Optional[ExtraKeys]
    ) -> Generator[Raw, None, None]:
        return _walk(path, rows, positions, lengths)

    def check_files(self, root: Path, manifest: Manifest) -> list[str]:
        """Each shard file holds the bytes the manifest lists (a missing shard's records read as missing)."""
        problems = []
        for s in manifest.shards:
            path = root / str(s["file"])
            size = path.stat().st_size if path.is_file() else None
            if size != int(s["bytes"]):
                what = "missing" if size is None else f"{size} bytes"
                problems.append(f"{s['file']}: shard is {what}, the manifest says {s['bytes']} (truncated or replaced)")
        return problems


def _shards_from(root: Path, first: int) -> list[Path]:
    """The shard files in ``root`` numbered ``first`` or later."""
    numbers = ((p, p.name[len("shard-") : -len(".bin")]) for p in root.glob("shard-*.bin"))
    return [p for p, n in numbers if n.isdigit() and int(n) >= first]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Mapping:
    """A read-only shared mapping of a file that, unlike ``mmap.mmap`` (before Python 3.13's
    ``trackfd=False``), keeps no duplicate of the file's descriptor: 1,200 shards hold 1,200
    mappings and no descriptor, whatever ``ulimit -n`` is. Arrays made from it (``np.asarray``) keep
    it alive; it is unmapped when the last of them goes."""

    def __init__(self, fd: int, size: int) -> None:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.addr, self.size = addr, size
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __len__(self) -> int:
        return self.size

    def madvise(self, advice: int, start: int = 0, length: Optional[int] = None) -> None:
        """As ``mmap.mmap.madvise``; advice only, so a refusal is ignored."""
        page = start - start % mmap.PAGESIZE
        _libc.madvise(self.addr + page, (self.size - start if length is None else length) + start - page, advice)

    def __del__(self) -> None:
        if hasattr(self, "addr"):  # not when __init__'s mmap failed: there is nothing to unmap
            _libc.munmap(self.addr, self.size)
