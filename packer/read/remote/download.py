"""A unit's download into ``partial/``: ranged parts, resumed from those a previous attempt finished."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from ...format import DatasetError
from ...store import ObjectChanged, Store
from ...store import base as store_base
from ...store.base import ObjectInfo
from . import settings
from .eviction import Files
from .paths import log_of, remove, sidecar_of
from .turns import Arrival


def download(
    store: Store,
    part: Path,
    key: str,
    info: ObjectInfo,
    span: Optional[tuple[int, int]],
    *,
    arrival: Callable[[int], Arrival],
    reserve: Callable[[Files], None],
    received: Optional[Callable[[int, bytes], None]] = None,
    seen: Optional[Callable[[ObjectInfo], object]] = None,
) -> None:
    """Bytes ``span`` (None: all) of object ``key`` (``info``) downloaded into ``part``, resuming the
    parts a previous attempt (of any process) finished: ``part``'s ``.parts`` file lists them, one
    number a line. ``arrival(size)`` is what the download reports its progress to (its turn,
    taken before), ``reserve(files)`` makes room in
    the cache for a new ``part`` and creates what it :func:`starts` with; ``received`` is given
    each piece written, ``seen`` the object's version where ``info`` has none."""
    start, end = span if span is not None else (0, info.size)
    header = _header(end - start)
    part_bytes = int(header.split()[1])
    done_file = log_of(part)
    done: frozenset[int] = frozenset()
    # a prefetch took its turn before it reserves room (a reservation holds the room empty)
    arrived = arrival(end - start)

    def progress(at: int, piece: bytes) -> None:
        arrived(at, piece)
        if received is not None:
            received(at, piece)

    try:
        if part.exists() and part.stat().st_size == end - start and done_file.exists():
            listed = done_file.read_bytes()
            if listed.startswith(header):
                done = frozenset(int(n) for n in listed[len(header) :].split() if n.isdigit())
        else:
            remove(part, done_file)
            reserve(starts(part, end - start))
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        log = os.open(done_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            if not done:
                os.ftruncate(log, 0)
                os.write(log, header)
            os.ftruncate(fd, end - start)
            try:
                store.download(
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
                remove(part, done_file, sidecar_of(part))
                raise replaced(store.name(key)) from None
            os.fsync(fd)
        finally:
            os.close(fd)
            os.close(log)
    finally:
        arrived.end()


def replaced(name: str) -> DatasetError:
    """The error of object ``name`` replaced in the store while a reader fetched from it."""
    return DatasetError(f"{name}: replaced in the store while it was read (the dataset was refreshed: open it again)")


def starts(part: Path, size: int) -> Files:
    """What a download of ``size`` bytes into ``part`` creates in ``partial/`` as it starts: the
    part at its full size (sparse until written: its room is reserved at once) and its log."""
    return {part: size, log_of(part): _header(size)}


def _header(size: int) -> bytes:
    """The first line of the log of a download of ``size`` bytes: the parts' numbers count parts
    of this size."""
    part_bytes = max(1, min(store_base.PART_BYTES, -(-size // settings.UNIT_STREAMS)))
    return b"part_bytes %d\n" % part_bytes
