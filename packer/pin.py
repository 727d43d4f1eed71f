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

import ctypes
import errno
import mmap
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np

from .format import (
    INDEX,
    MANIFEST,
    SOURCES,
    DatasetError,
    Manifest,
    check_index,
    data_files,
    load_label_arrays,
    map_npy,
    open_regular,
)

FileKey = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns): one version of one file
Shard = tuple[np.ndarray, Optional["Mapping"]]


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
    (:func:`packer.format.data_files`); ``shards`` are the memmap shards' mappings, in order."""

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        arrays: tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]],
        files: dict[str, FileKey],
        data_fds: list[int],
        shards: list[Shard],
    ) -> None:
        self.root, self.manifest = root, manifest
        self.index, self.sources, self.multi, self.targets = arrays
        self.files, self.data_fds, self.shards = files, data_fds, shards
        self.data_names = data_files(manifest) if data_fds else []
        if data_fds:
            self._close = weakref.finalize(self, _close_all, list(data_fds))

    def data_key(self, k: int) -> FileKey:
        """The identity of LMDB data file ``k``: what py-lmdb's "already open" guard keys on (its
        first two fields), shared by every version of the dataset that keeps that file."""
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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def pin(root: str, expect: Optional[dict[str, FileKey]] = None) -> Pinned:
    """Open the dataset at ``root`` (see the module docstring); with ``expect``, only the version
    whose files have those identities, else :class:`DatasetReplaced`."""
    for _ in range(3):
        try:
            return _pin_once(root, expect)
        except _Moved:
            continue
    raise DatasetError(f"{root}: the dataset kept being replaced while it was opened; try again")


def replaced(root: str) -> DatasetReplaced:
    return DatasetReplaced(
        f"{root}: the dataset was replaced since it was opened (a build --update or --force ran); "
        f"create a new ShardDataset to read the new version"
    )


def _pin_once(root: str, expect: Optional[dict[str, FileKey]]) -> Pinned:
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

    data_fds: list[int] = []
    try:
        fd = open_file(MANIFEST)
        try:
            manifest = Manifest.read(fd, os.path.join(root, MANIFEST))
        finally:
            os.close(fd)
        index, sources = (_map_npy_file(root, name, open_file) for name in (INDEX, SOURCES))
        check_index(Path(root), index, sources, manifest)
        multi, targets = load_label_arrays(root, manifest, open_file)
        shards: list[Shard] = []
        if manifest.backend == "lmdb":
            for name in data_files(manifest):
                data_fds.append(open_file(name))
        else:
            shards = [_map_shard(root, info, open_file) for info in manifest.shards]
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


def _map_shard(root: str, info: dict, open_file) -> Shard:
    """A memmap shard, mapped whole with the kernel's readahead off (see MemmapReader), its
    descriptor closed: the mapping alone keeps the file readable. A truncated shard is mapped as far
    as it goes: the reader refuses the records past its end (and ``packer verify`` names them)."""
    name = str(info["file"])
    fd = open_file(name)
    try:
        nbytes = min(int(info["bytes"]), os.fstat(fd).st_size)
        if nbytes == 0:
            return np.zeros(0, np.uint8), None
        try:
            mapping = Mapping(fd, nbytes)
        except OSError as e:
            why = "too many shards mapped (vm.max_map_count)" if e.errno == errno.ENOMEM else e.strerror
            raise DatasetError(f"{root}: shard {name} cannot be mapped ({why})") from None
    finally:
        os.close(fd)
    mapping.madvise(mmap.MADV_RANDOM)
    return np.asarray(mapping), mapping


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Mapping:
    """A read-only shared mapping of a file that, unlike ``mmap.mmap`` (before Python 3.13's
    ``trackfd=False``), keeps no duplicate of the file's descriptor: 1,200 shards hold 1,200
    mappings and no descriptor, whatever ``ulimit -n`` is. Arrays made from it (``np.asarray``) keep
    it alive; it is unmapped when the last of them goes."""

    def __init__(self, fd: int, size: int) -> None:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.addr, self.size = addr, size
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __len__(self) -> int:
        return self.size

    def madvise(self, advice: int, start: int = 0, length: Optional[int] = None) -> None:
        """As ``mmap.mmap.madvise``; advice only, so a refusal is ignored."""
        page = start - start % mmap.PAGESIZE
        _libc.madvise(self.addr + page, (self.size - start if length is None else length) + start - page, advice)

    def __del__(self) -> None:
        _libc.munmap(self.addr, self.size)
