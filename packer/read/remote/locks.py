"""The node's file locks (flock: the kernel releases them if their holder dies), the shared flocks
that hold units against eviction (closed in a forked child: it holds only what it opens), and the
check of the lock discipline (packer.read.remote's docstring), on where ``PACKER_LOCK_CHECK=1``.

Node locks, in their order (a thread takes one only while it holds none of the same or a later
kind): a version's lock (``locks/version-*``), a unit's lock (``locks/unit-*``), a hold (a shared
flock on a unit's or manifest's own file, taken blocking only against an eviction's brief
exclusive try), the cache's lock (``.evict.lock``). A lock only tried (:func:`lock_now`) is never
waited for, so it is in no order. Holds are kept for a batch and waited under: no process ever
waits for a hold, only tries it (eviction), so they are not among the locks a wait is checked
against (:func:`waiting`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from ...errors import CacheWaitTimeout, LockDisciplineError
from . import settings

LOCKING: set[int] = set()  # descriptors of flocks this process holds in locked blocks, or is taking

#: The kinds of node locks in the order they are taken, by their file's name.
ORDER = ("version", "unit", "hold", "cache")
CACHE_LOCK = ".evict.lock"

_taken = threading.local()  # .kinds: the node locks this thread holds (PACKER_LOCK_CHECK=1)


def checking() -> bool:
    """Whether this process checks the lock discipline (``PACKER_LOCK_CHECK=1``: the test suite
    sets it, and its DataLoader workers and spawned ranks inherit it)."""
    return os.environ.get("PACKER_LOCK_CHECK") == "1"


def _held_kinds() -> list[str]:
    if not hasattr(_taken, "kinds"):
        _taken.kinds = []
    return _taken.kinds


def waiting(what: str) -> None:
    """Every wait of the cache for another thread or process (a turn, a download's future, room
    in the cache, a lock) calls this first: with the check on, a thread holding a node lock
    (a version's, a unit's, the cache's) that is about to wait is a LockDisciplineError."""
    if checking():
        held = _held_kinds()
        if held:
            raise LockDisciplineError(f"waits for {what} while holding node lock(s): {', '.join(held)}")


def kind_of(path: Path) -> str:
    """The kind of node lock ``path`` is (see :data:`ORDER`)."""
    if path.name == CACHE_LOCK:
        return "cache"
    return "version" if path.name.startswith("version-") else "unit"


def _in_order(kind: str) -> None:
    """With the check on, taking a ``kind`` lock while holding one of it or a later kind is a
    LockDisciplineError (two threads taking two locks in opposite orders wait on each other)."""
    if checking():
        later = [k for k in _held_kinds() if ORDER.index(k) >= ORDER.index(kind)]
        if later:
            raise LockDisciplineError(f"takes a {kind} lock while holding {', '.join(later)} (order: {ORDER})")


def take(fd: int, *, exclusive: bool, kind: str, what: str, named: str) -> None:
    """Take the flock at ``fd`` (a ``kind`` lock), waiting for its holder until the deadline
    (:func:`settings.wait_s`) at most, then a CacheWaitTimeout in one line naming ``named`` (the
    unit's object, or the cache), ``what`` is waited for and the holder's pid (/proc/locks). A
    holder that dies releases it (the kernel), so a dead one is never waited for."""
    _in_order(kind)
    flag = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if not _try(fd, flag):  # a wait for a lock later in the order than any this thread holds (_in_order)
        limit = settings.wait_s()
        deadline, pause = time.monotonic() + limit, 0.001
        while not _try(fd, flag):
            if time.monotonic() > deadline:
                raise CacheWaitTimeout(
                    f"{named}: waited {limit:g} s for {what}, held by pid {holder_pid(fd)} "
                    f"(a stuck reader? {settings.WAIT_ENV} sets the deadline)"
                )
            time.sleep(pause)
            pause = min(0.05, pause * 2)
    _held_kinds().append(kind)


def _try(fd: int, flag: int) -> bool:
    try:
        fcntl.flock(fd, flag | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def holder_pid(fd: int) -> str:
    """The pid of a process holding a flock on the file at ``fd`` (from /proc/locks), or "unknown"."""
    ino = os.fstat(fd).st_ino
    with contextlib.suppress(OSError), open("/proc/locks") as table:
        for line in table:
            fields = line.split()
            if "->" in fields:  # a waiter's line, not a holder's
                continue
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(ino):
                return fields[4]
    return "unknown"


@contextlib.contextmanager
def locked(
    path: Path, *, named: str = "", waiting: Optional[Callable[[], None]] = None, wait: bool = True
) -> Iterator[bool]:
    """An exclusive flock on ``path`` for the block (:func:`take`: in order, with a deadline): the
    kernel releases it if the holder dies. A child forked meanwhile closes its copy at once (see
    _after_fork): the lock is its parent's. ``waiting()`` is called before waiting for another
    holder (a batch lets go of its units). ``named``: what the lock is for, in a timeout's line.
    ``wait`` False: only tried (in no order); the block is told whether it has the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    LOCKING.add(fd)
    kind, taken = kind_of(path), False
    try:
        if not wait:
            taken = lock_now(fd)
            if taken:
                _held_kinds().append(kind)
            yield taken
            return
        if waiting is not None and not lock_now(fd):
            waiting()
        take(fd, exclusive=True, kind=kind, what=f"the lock {path.name}", named=named or str(path))
        taken = True
        yield True
    finally:
        let_go(fd, kind=kind if taken else None)


def let_go(fd: int, *, kind: Optional[str] = None) -> None:
    """Release the flock at ``fd`` (a ``kind`` lock, None: a lock only tried or a hold) and close
    it. Unlocked first: a child forked after the descriptor left LOCKING but before it was closed
    keeps a copy of the open file, which would hold the lock for as long as that child lives (a
    persistent DataLoader worker: every other process waits)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    LOCKING.discard(fd)
    os.close(fd)
    kinds = _held_kinds()
    if kind is not None and kind in kinds:
        kinds.reverse()
        kinds.remove(kind)
        kinds.reverse()


def hold(fd: int, *, named: str) -> None:
    """Take the shared flock that holds the unit or version at ``fd`` against eviction (kept past
    this call: not recorded as a node lock this thread holds; see the module's docstring). A unit's
    caller puts ``fd`` in LOCKING first (a child forked meanwhile closes its copy); a version's
    hold is kept by forked children (they read it)."""
    take(fd, exclusive=False, kind="hold", what="an eviction's try", named=named)
    _held_kinds().remove("hold")


def open_held(path: str | Path, *, named: str) -> int:
    """``path`` opened read-only and held (:func:`hold`), its descriptor in LOCKING until it is kept
    or closed (a child forked meanwhile closes its copy); let go of if the hold fails.
    FileNotFoundError where ``path`` is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    LOCKING.add(fd)
    try:
        hold(fd, named=named)
    except BaseException:
        let_go(fd)
        raise
    return fd


class Held(dict[str, int]):
    """A Remote's held units: unit path -> descriptor with its shared flock (kept in a WeakSet:
    equal and hashed by identity)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]


HOLDERS: weakref.WeakSet[Held] = weakref.WeakSet()  # every Remote's, to let go of in a forked child


def _after_fork() -> None:
    """In a forked child: close the inherited descriptors of the parent's flocks, which would
    otherwise keep them held after the parent's block ends or it lets go of its units (a flock
    belongs to the open file): the child holds only what it opens itself."""
    for fd in list(LOCKING):
        with contextlib.suppress(OSError):
            os.close(fd)
    LOCKING.clear()
    _held_kinds().clear()
    for held in list(HOLDERS):
        close_held(held)


os.register_at_fork(after_in_child=_after_fork)


def lock_now(fd: int) -> bool:
    """Take the exclusive flock at ``fd`` if no process holds the file's lock (False: one does). Let
    go of with let_go: a child forked meanwhile closes its copy (_after_fork), and the lock is
    released before the close, so no copy keeps it (the training process, which evicts for its
    prefetches, forks DataLoader workers)."""
    LOCKING.add(fd)
    return _try(fd, fcntl.LOCK_EX)


def close_held(held: dict[str, int]) -> None:
    for fd in held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    held.clear()
