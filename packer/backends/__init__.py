"""The storage backends, chosen by name from one table (:data:`BACKENDS`): each one's writer, reader,
sequential walk over a data file, index bounds and file checks side by side (packer.backends.lmdb,
packer.backends.memmap; what each provides: packer.backends.base). Other modules look a backend up
here; none branches on its name."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ..format import Manifest
from .base import Backend, Buffer, Reader, Writer
from .lmdb import Lmdb
from .memmap import Memmap

__all__ = [
    "BACKENDS",
    "WRITE_ERRORS",
    "Backend",
    "Buffer",
    "Reader",
    "Writer",
    "close_all",
    "data_files",
    "record_places",
]

#: Every backend by the name manifests and ``--backend`` use (packer.format.LAYOUTS: their layouts).
BACKENDS: dict[str, Backend] = {b.name: b for b in (Lmdb(), Memmap())}
#: What the backends' writers raise on a full disk (a build turns it into one clear error).
WRITE_ERRORS: tuple[type[Exception], ...] = (OSError, *(e for b in BACKENDS.values() for e in b.write_errors))


def data_files(manifest: Manifest) -> list[str]:
    """The dataset's data files, numbered as index rows' ``shard`` numbers them: memmap shards, or
    LMDB segments (version 3; before it data.mdb alone)."""
    return BACKENDS[manifest.backend].data_files(manifest)


def record_places(
    manifest: Manifest, index: np.ndarray, rows: Optional[np.ndarray] = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows``' (all when None) data file number and position in it: (shard, byte offset) for
    memmap, (segment, key number) for LMDB, where versions 1 and 2 key record ``i`` as ``i`` in data.mdb."""
    return BACKENDS[manifest.backend].record_places(manifest, index, rows)


def close_all(root: Optional[str | os.PathLike] = None) -> None:
    """Let go of this process's handles on the dataset at ``root`` (every one when None), whatever its
    backend: before a rename replaces it, or before opening it without packer."""
    for backend in BACKENDS.values():
        backend.close(root)
