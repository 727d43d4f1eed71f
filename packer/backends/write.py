"""Durable file writes: fsync by path or open file, and whole-file replacement through a rename.
The record writers are the backends' (packer.backends)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


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
