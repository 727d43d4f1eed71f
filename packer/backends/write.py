"""Durable file writes: fsync by path or open file, and whole-file replacement through a rename.
The record writers are the backends' (packer.backends)."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import BuildError


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path (directories make renames and new files durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(f: BinaryIO) -> None:
    """Flush and fsync an open file."""
    f.flush()
    os.fsync(f.fileno())


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a name unique to this attempt, fsync, rename: a reader sees the old file or the whole
    new one, and concurrent attempts (a retried Dask task) never mix bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            sync_file(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_written(path: str | os.PathLike, *, new: bool) -> int:
    """A read-write descriptor of the data file ``path`` a build writes: created by this call when
    ``new`` (never a file already there), else reopened (a --resume). Never through a symlink, and
    refused (BuildError) unless it is a regular file no other name links: a refresh hard-links the
    old version's data files into its staging folder, and packer never writes into a file that a
    complete dataset holds."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if new else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise BuildError(f"{path}: already exists; packer writes a new data file under a new name") from None
    except FileNotFoundError:
        raise BuildError(f"cannot --resume: {path} is missing; build again without --resume") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise BuildError(f"{path}: is a symbolic link; refusing to write through it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} links (a dataset's)"
        raise BuildError(f"{path}: is {why}; refusing to write into it")
    return fd
