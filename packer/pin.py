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
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from .backends import BACKENDS, data_files
from .format import (
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

if TYPE_CHECKING:
    from .backends.memmap import Shard

FileKey = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns): one version of one file


class DatasetReplaced(DatasetError):
    """The dataset at a reader's path is no longer the version the reader opened."""


class _Moved(Exception):
    """The directory was renamed or deleted while it was being opened (a refresh): open it again."""


def _key(st: os.stat_result) -> FileKey:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Pinned:
    """Manifest, index, source paths, label arrays and data files of one version of the dataset at
    ``root``. ``files`` names each file's identity; ``multi``/``targets`` are the label arrays the
    dataset has (else None); ``data_fds`` hold the LMDB data files open, in segment order
    (:func:`packer.backends.data_files`); ``shards`` are the memmap shards' mappings, in order."""

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        arrays: tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]],
        files: dict[str, FileKey],
        data_fds: Sequence[int],
        shards: Sequence[Shard],
    ) -> None:
        self.root, self.manifest = root, manifest
        self.index, self.sources, self.multi, self.targets = arrays
        self.files, self.data_fds, self.shards = files, data_fds, shards
        self.data_names = data_files(manifest) if data_fds else []
        if data_fds:
            self._close = weakref.finalize(self, _close_all, data_fds)

    def data_key(self, k: int) -> FileKey:
        """The identity of LMDB data file ``k``: what py-lmdb's "already open" guard keys on (its
        first two fields), shared by every version of the dataset that keeps that file."""
        self.data_fds[k]  # opened first where data files are opened on first use (packer.remote)
        return self.files[self.data_names[k]]

    def data_path(self, k: int) -> str:
        """A path that opens the pinned LMDB data file ``k`` itself, deleted or not (/proc/self/fd/N
        on Linux, /dev/fd/N on macOS); elsewhere its path, while the file there is still the pinned one."""
        fd = self.data_fds[k]
        for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
            if os.path.exists(path):
                return path
        path = os.path.join(self.root, self.data_names[k])
        try:
            if _key(os.stat(path)) == self.data_key(k):
                return path
        except OSError:
            pass
        raise replaced(self.root)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:  # an OnFirstUse: those opened
        os.close(fd)


def pin(
    root: str, expect: Optional[dict[str, FileKey]] = None, *, fetch: Optional[Callable[[str], int]] = None
) -> Pinned:
    """Open the dataset at ``root`` (see the module docstring); with ``expect``, only the version
    whose files have those identities, else :class:`DatasetReplaced`. ``fetch(name)``: each data
    file is opened by it when a reader first needs it (a dataset cached from object storage,
    packer.remote: the cache directory holds one version, and each data file is checked against
    its index when fetched, so ``expect`` covers the manifest and index only)."""
    for _ in range(3):
        try:
            return _pin_once(root, expect, fetch)
        except _Moved:
            continue
    raise DatasetError(f"{root}: the dataset kept being replaced while it was opened; try again")


def replaced(root: str) -> DatasetReplaced:
    return DatasetReplaced(
        f"{root}: the dataset was replaced since it was opened (a build --update or --force ran); "
        f"create a new ShardDataset to read the new version"
    )


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
            if here is None or (here.st_dev, here.st_ino) != tuple(_key(os.fstat(dir_fd))[:2]):
                raise _Moved() from None  # removed or swapped under us: the version at root is another
            if expect is not None:
                raise replaced(root) from None
            if name == MANIFEST:
                raise DatasetError(f"{root}: not a packer dataset (no {MANIFEST}; incomplete or wrong path)") from None
            raise DatasetError(f"{os.path.join(root, name)}: missing") from None
        files[name] = _key(os.fstat(fd))
        if expect is not None and expect.get(name) != files[name]:
            os.close(fd)
            raise replaced(root)
        return fd

    def fetch_file(name: str) -> int:
        assert fetch is not None
        fd = fetch(name)
        files[name] = _key(os.fstat(fd))
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
        _close_all(data_fds)
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
