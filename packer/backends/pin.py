"""One version of a dataset, pinned for as long as a reader uses it.

A refresh (``build --update`` or ``--force``) swaps a new directory in for OUT and deletes the old
one. A reader that opened files by path later (a DataLoader worker, a shard opened lazily) would
mix versions: the old index with the new records, silently mislabelled samples. So a reader opens
everything it will ever read at once, through one handle on the directory (one version, even while
a swap is under way): the manifest and the index are read, ``index.npy``, ``sources.npy`` and every
memmap shard are mapped, and each LMDB data file (``data.mdb``, and a segmented dataset's
``data-NNNNN.mdb``) is held open by a descriptor. Mappings and
descriptors keep deleted files readable and are inherited by forked DataLoader workers, which so
read the old version to the end. The shards' descriptors are closed once mapped: a dataset of any
number of shards holds no descriptor of them (``ulimit -n``), only mappings.

A process that gets a reader by pickling (the spawn and forkserver start methods) cannot inherit
any of that. It opens the files by path again and compares each one's identity (device, inode,
size, mtime) with the version its parent pinned: a dataset replaced since is refused with
:class:`DatasetReplaced`, never read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from ..format import (
    INDEX,
    MANIFEST,
    SOURCES,
    DatasetError,
    Manifest,
    check_index,
    load_label_arrays,
    map_npy,
    open_regular,
)
from . import BACKENDS
from .base import FileKey, Pinned, close_fds, file_key, replaced


class _Moved(Exception):
    """The directory was renamed or deleted while it was being opened (a refresh): open it again."""


def pin(
    root: str, expect: Optional[dict[str, FileKey]] = None, *, fetch: Optional[Callable[[str], int]] = None
) -> Pinned:
    """Open the dataset at ``root`` (see the module docstring); with ``expect``, only the version
    whose files have those identities, else :class:`DatasetReplaced`. ``fetch(name)``: each data
    file is opened by it when a reader first needs it (a dataset cached from object storage,
    packer.read.remote: the cache directory holds one version, and each data file is checked against
    its index when fetched, so ``expect`` covers the manifest and index only)."""
    for _ in range(3):
        try:
            return _pin_once(root, expect, fetch)
        except _Moved:
            continue
    raise DatasetError(f"{root}: the dataset kept being replaced while it was opened; try again")


def _pin_once(root: str, expect: Optional[dict[str, FileKey]], fetch: Optional[Callable[[str], int]]) -> Pinned:
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        if expect is not None:
            raise replaced(root) from None
        raise DatasetError(f"{root}: not a packer dataset ({e.strerror}; incomplete or wrong path)") from None
    files: dict[str, FileKey] = {}

    def open_file(name: str) -> int:
        try:
            fd = open_regular(name, dir_fd=dir_fd, label=os.path.join(root, name))
        except FileNotFoundError:
            try:
                here = os.stat(root)
            except OSError:
                here = None
            if here is None or (here.st_dev, here.st_ino) != tuple(file_key(os.fstat(dir_fd))[:2]):
                raise _Moved() from None  # removed or swapped under us: the version at root is another
            if expect is not None:
                raise replaced(root) from None
            if name == MANIFEST:
                raise DatasetError(f"{root}: not a packer dataset (no {MANIFEST}; incomplete or wrong path)") from None
            raise DatasetError(f"{os.path.join(root, name)}: missing") from None
        files[name] = file_key(os.fstat(fd))
        if expect is not None and expect.get(name) != files[name]:
            os.close(fd)
            raise replaced(root)
        return fd

    def fetch_file(name: str) -> int:
        assert fetch is not None
        fd = fetch(name)
        files[name] = file_key(os.fstat(fd))
        return fd

    data_fds: Sequence[int] = []
    try:
        fd = open_file(MANIFEST)
        try:
            manifest = Manifest.read(fd, os.path.join(root, MANIFEST))
        finally:
            os.close(fd)
        index, sources = (_map_npy_file(root, name, open_file) for name in (INDEX, SOURCES))
        check_index(Path(root), index, sources, manifest)
        multi, targets = load_label_arrays(root, manifest, open_file)
        if fetch is not None:
            data_fds, shards = BACKENDS[manifest.backend].pin_files(root, manifest, fetch_file, lazy=True)
        else:
            data_fds, shards = BACKENDS[manifest.backend].pin_files(root, manifest, open_file)
    except BaseException:
        close_fds(data_fds)
        raise
    finally:
        os.close(dir_fd)
    return Pinned(root, manifest, (index, sources, multi, targets), files, data_fds, shards)


def _map_npy_file(root: str, name: str, open_file: Callable[[str], int]) -> np.ndarray:
    """The pinned ``.npy`` file ``name``, mapped (its descriptor is closed: the mapping keeps it)."""
    fd = open_file(name)
    try:
        return map_npy(fd, os.path.join(root, name))
    finally:
        os.close(fd)
