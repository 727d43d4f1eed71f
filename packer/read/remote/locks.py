"""The node's file locks (flock: the kernel releases them if their holder dies) and the shared
flocks that hold units against eviction, closed in a forked child (it holds only what it opens)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

LOCKING: set[int] = set()  # descriptors of flocks this process holds in locked blocks, or is taking


@contextlib.contextmanager
def locked(path: Path, *, waiting: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block: the kernel releases it if the holder dies. A
    child forked meanwhile closes its copy at once (see _after_fork): the lock is its parent's.
    ``waiting()`` is called before waiting for another holder (a batch lets go of its units, which
    that holder's download may need the room of)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    LOCKING.add(fd)
    try:
        if waiting is None or not lock_now(fd):
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        let_go(fd)


def let_go(fd: int) -> None:
    """Release the flock at ``fd`` and close it. Unlocked first: a child forked after the descriptor
    left LOCKING but before it was closed keeps a copy of the open file, which would hold the lock
    for as long as that child lives (a persistent DataLoader worker: every other process waits)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    LOCKING.discard(fd)
    os.close(fd)


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
    for held in list(HOLDERS):
        close_held(held)


os.register_at_fork(after_in_child=_after_fork)


def lock_now(fd: int) -> bool:
    """Take the exclusive flock at ``fd`` if no process holds the file's lock (False: one does). Let
    go of with let_go: a child forked meanwhile closes its copy (_after_fork), and the lock is
    released before the close, so no copy keeps it (the training process, which evicts for its
    prefetches, forks DataLoader workers)."""
    LOCKING.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def close_held(held: dict[str, int]) -> None:
    for fd in held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    held.clear()
