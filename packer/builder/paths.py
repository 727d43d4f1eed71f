"""Where a build writes beside OUT, and who may: OUT behind a symlink, the build lock (one build, or
clean or compact, per OUT at a time), and which folders are packer's, so that ``--force`` and
``packer clean`` replace or delete nothing else.

When OUT is a symlink, the dataset behind it is built: staging, lock and the final swap all sit beside
the link's target (on its disk), and the link is kept. One build per OUT at a time: see
:func:`build_lock`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from ..errors import DatasetError, local_path, say
from ..format import MANIFEST, Manifest
from .options import BuildError, Resolved
from .split import TRAIN, split_path
from .staging import BUILD_STATE

__all__ = ["build_lock", "dataset_path", "empty_folder", "lock_outputs", "lock_path", "made_by_packer", "not_dataset"]


def lock_path(out: Path) -> Path:
    """Beside OUT, never inside it: OUT itself is swapped whole at the end of a build."""
    return out.parent / f".{out.name}.packer-lock"


def dataset_path(out: str | os.PathLike) -> Path:
    """OUT, or the dataset a symlink at OUT points to: a refresh replaces that one and keeps the link."""
    out = local_path(out)
    return Path(os.path.realpath(out)) if out.is_symlink() else out


_HELD: set[str] = set()  # lock files this process holds: POSIX locks do not exclude their own process
_HELD_GUARD = threading.Lock()


def _lock_holder(fd: int) -> str:
    """The pid the holder wrote into the lock file (it writes it just after locking: wait a moment)."""
    for _ in range(50):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.02)
    return "unknown"


def _acquire(path: Path, out: Path, wait: bool, quiet: bool) -> Optional[int]:
    """The locked file descriptor of ``path``; None (after a warning) where the filesystem has no locks."""
    announced = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:  # ELOOP: a symlink in its place (in a --split folder: OUT's), never followed
            why = "a symbolic link is in its place" if e.errno == errno.ELOOP else e.strerror or e
            raise BuildError(f"cannot write beside the output ({path}): {why}") from None
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    say(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second build of {out} meanwhile")
                    os.close(fd)
                    return None
                if not wait:
                    raise BuildError(f"{out} is being built by pid {_lock_holder(fd)}") from None
                if not announced:
                    say(f"waiting for pid {_lock_holder(fd)}, which is building {out}", quiet)
                announced = True
                fcntl.lockf(fd, fcntl.LOCK_EX)  # Ctrl-C and SIGTERM interrupt the wait
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a file its last holder removed
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def build_lock(out: Path, wait: bool = False, quiet: bool = False) -> Iterator[None]:
    """Hold OUT's build lock for the block: one build (or clean) per OUT at a time.

    A POSIX record lock (``lockf``) on :func:`lock_path`: the kernel drops it when the holder exits,
    however it exits (kill -9 included), and forked worker processes do not inherit it, so no stale
    lock survives a build. Another holder: BuildError "OUT is being built by pid N", or with ``wait``
    block until it is done. The holder removes the file on release while still holding it; a waiter
    that then gets the lock on the removed file notices (another inode at the path) and starts over.
    """
    path = lock_path(out)
    key = os.path.abspath(path)
    with _HELD_GUARD:
        if key in _HELD:
            raise BuildError(f"{out} is being built by pid {os.getpid()} (this process)")
        _HELD.add(key)
    fd = None
    try:
        fd = _acquire(path, out, wait, quiet)
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(key)


def lock_outputs(stack: contextlib.ExitStack, out: Path, options: Resolved, quiet: bool) -> None:
    """Take the build locks of OUT and, with --split, of each split dataset inside it, onto ``stack``."""
    split, backend = options.split, options.backend
    for target in [out, *(split_path(out, name, backend) for name in (TRAIN, *split))] if split else [out]:
        stack.enter_context(build_lock(target, options.wait, quiet))


def not_dataset(path: Path) -> str:
    """Why ``path`` is not a dataset, "" when it holds a manifest that packer reads as its own (any
    ``manifest.json`` is not: a browser extension's, a webpack build's)."""
    if not os.path.lexists(path / MANIFEST):
        return f"no {MANIFEST}"
    try:
        Manifest.load(path)
    except DatasetError as e:
        return str(e)
    return ""


def made_by_packer(path: Path, sibling: bool) -> bool:
    """A dataset (a manifest packer reads), a build's staging folder (``sibling`` only: its
    settings, or empty), or a --split folder holding nothing but those; never through a symlink."""
    if path.is_symlink() or not path.is_dir():
        return False
    marker = path / BUILD_STATE
    if not not_dataset(path) or (sibling and marker.is_file() and not marker.is_symlink()):
        return True
    entries = list(path.iterdir())
    if not entries:
        return sibling
    return all(
        made_by_packer(e, e.name.startswith(".") and e.name.endswith((".packer-tmp", ".packer-old")))
        or (e.name.startswith(".") and e.name.endswith(".packer-lock") and e.is_file())
        for e in entries
    )


def empty_folder(path: Path) -> bool:
    """An empty real folder: what --force may replace although no build made it (``mkdir OUT`` first)."""
    return not path.is_symlink() and path.is_dir() and not any(path.iterdir())


def check_target(target: Path, *, replaces: bool, keeps: bool) -> None:
    """Refuse a dataset path this build must not write: one that exists unless it ``replaces`` it
    (--force) or ``keeps`` it until it is rebuilt (--update, --resume), and anything there that is
    not packer's own (with --force: a dataset, a --split folder of them or an empty folder)."""
    if target.exists() and not (replaces or keeps):
        raise BuildError(f"{target} already exists (use --force to replace it, or --update to refresh it)")
    why = not_dataset(target) if target.exists() else ""
    if why and not (replaces and (made_by_packer(target, sibling=False) or empty_folder(target))):
        raise BuildError(
            f"{target} exists and is not a packer dataset ({why}); packer replaces only its own datasets "
            f"(--force: also a --split folder of them, or an empty folder): move it away or choose another OUT"
        )
