"""cache_limit: making room for a download under the limit, evicting the units no reader holds
(those of no known next use first, then the one needed furthest in the future), and the room
of downloads that died."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from ...format import DatasetError
from . import settings
from .checks import SIDECAR
from .locks import let_go, lock_now, locked
from .paths import LOCKS, PARTIAL, UNITS, VERSIONS, file_mtime, file_size, remove
from .settings import VERIFY_ATTEMPTS


class NoRoom(Exception):
    """A prefetch found no room without evicting what is needed sooner: the batch fetches it."""


def _eviction_order(entry: tuple[Path, Optional[int]]) -> tuple[int, int, int]:
    """Units of no known next use first, then furthest next use first; least recently opened first."""
    unit, rank = entry
    return (0, 0, file_mtime(unit)) if rank is None else (1, -rank, file_mtime(unit))


def too_small(limit: int, name: str, size: int) -> DatasetError:
    return DatasetError(f"cache_limit {limit} bytes is too small: {name} alone is {size} bytes")


def evict(unit: Path) -> bool:
    """Delete ``unit`` and its links in the version directories unless a reader holds it."""
    try:
        fd = os.open(unit, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        if not lock_now(fd):
            return False
        ino = os.fstat(fd).st_ino
        name = unit.name.rsplit(".", 2)[0]
        for link in unit.parent.parent.glob(f"{VERSIONS}/*/{name}"):
            with contextlib.suppress(FileNotFoundError):
                if link.stat().st_ino == ino:
                    link.unlink()
        remove(unit, unit.with_name(unit.name + SIDECAR))
        return True
    finally:
        let_go(fd)


def _drop_partial(part: Path) -> bool:
    """Delete the reserved download ``part`` unless a process is downloading it (holds its unit's
    lock): one that died or failed left it, and its room would otherwise stay taken for good."""
    name = part.name.rsplit(".", 2)[0]
    try:
        fd = os.open(part.parent.parent / LOCKS / f"unit-{name}", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not lock_now(fd):
            return False
        remove(part, part.with_name(part.name + ".parts"))
        return True
    finally:
        let_go(fd)


def evicted_too_often(name: str) -> DatasetError:
    return DatasetError(
        f"{name}: evicted from the cache by other readers as soon as it was fetched, {VERIFY_ATTEMPTS} times; "
        f"raise cache_limit"
    )


def make_room(
    cache_dir: Path,
    limit: int,
    need: int,
    part: Path,
    *,
    home: Path,
    demand: bool,
    next_use: Callable[[Path], Optional[int]],
    needed_before: Callable[[set[str]], int],
    let_go: Callable[[], None],
    url: str,
) -> None:
    """Evict units no reader holds (see packer.read.remote's docstring for the order) until ``need``
    more bytes fit under ``limit`` in ``cache_dir``, and reserve them: the download's file ``part``
    is made that size before the lock goes, so it counts for the next one (the cache never exceeds
    the limit).
    A batch's download (``demand``) waits for readers to let go; a prefetch evicts only units
    of no known next use (it would otherwise push out what the next batches need before it, and
    its reservation would keep their downloads from the room), leaves the room of the units
    needed before it (``needed_before`` the units ``there``, of dataset ``home``), and else
    raises NoRoom; ``next_use`` ranks a cached unit, ``let_go`` lets go of the units the caller
    holds."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + settings.ROOM_WAIT
    while True:
        with locked(cache_dir / ".evict.lock"):
            units = [p for p in cache_dir.glob(f"*/{UNITS}/*") if not p.name.endswith(SIDECAR)]
            partial = [p for p in cache_dir.glob(f"*/{PARTIAL}/*") if not p.name.endswith(".parts")]
            sizes = {p: file_size(p) for p in units + partial}
            used = sum(sizes.values())
            for stale in partial:  # a download whose process died or gave up: its room first
                if used + need > limit and sizes[stale] and _drop_partial(stale):
                    used -= sizes[stale]
            evicted = set()
            for unit, rank in sorted(((u, next_use(u)) for u in units), key=_eviction_order):
                if used + need <= limit or (rank is not None and not demand):
                    break
                if evict(unit):
                    used -= sizes[unit]
                    evicted.add(unit)
            there = {p.name.rsplit(".", 2)[0] for p in units + partial if p.parent.parent == home}
            there -= {p.name.rsplit(".", 2)[0] for p in evicted}
            if used + need + (0 if demand else needed_before(there)) <= limit:
                fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    os.ftruncate(fd, need)
                finally:
                    os.close(fd)
                return
        if not demand:
            raise NoRoom()
        let_go()  # this batch's other units too: two batches that each hold some never wait on each other
        if time.monotonic() > deadline:
            raise DatasetError(
                f"{url}: cache_limit {limit} bytes is too small: {used} bytes of the cache "
                f"{cache_dir} are held by open readers or downloads, and {need} more are needed"
            )
        time.sleep(0.05)
