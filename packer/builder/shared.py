"""Samples' big arrays handed to ``packer.pack``'s worker processes through shared memory, not
through their pipes.

A pickled H x W x 3 array crosses a pipe at its full size: pickled, written in 64 KiB pieces while the
worker reads them, unpickled; on few cores that serial work in the writing process was most of a pack
from arrays (docs/PERFORMANCE.md, "Fields", its write side). Here the writing process copies a
chunk's arrays once into one shared-memory block and sends their places (:class:`Shared`); the
worker maps the block and reads the pixels where they lie. Once every sample of its chunk has its
result (no worker reads it any more), the block is kept for a later chunk rather than unlinked: a
fresh block's pages are faulted in and zeroed by the kernel as they are first written, which cost
more than the copy itself (docs/PERFORMANCE.md, "Fields"). The blocks are unlinked when the pack
stops; one that a killed process leaves behind is unlinked by multiprocessing's resource tracker.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import contextlib
import mmap
import os
from collections import deque
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

#: arrays smaller than this travel in the pipe as before (a box list, a caption's embedding)
MIN_SHARED = 1 << 16
_ALIGN = 64
#: blocks are made in whole MiB, so that a chunk of slightly bigger images still fits a kept one
_GRAIN = 1 << 20


@dataclass(frozen=True)
class Shared:
    """Where a sample's array lies in its chunk's block: what the pipe carries instead of its bytes."""

    block: str
    offset: int
    shape: tuple[int, ...]
    dtype: str


class Blocks:
    """The writing process's side: one block per chunk of samples, freed in order as the samples'
    results are taken (:meth:`taken`)."""

    def __init__(self) -> None:
        #: per chunk handed over, oldest first: its samples not yet taken, and its block (None: no big array)
        self._chunks: deque[list[Any]] = deque()
        #: blocks no chunk uses any more, kept for the next ones (at most as many as were in use at once)
        self._free: list[shared_memory.SharedMemory] = []

    def share(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``samples`` with each big array replaced by its :class:`Shared` place in a new block."""
        big = [
            (i, key, value)
            for i, sample in enumerate(samples)
            for key, value in sample.items()
            if isinstance(value, np.ndarray) and value.nbytes >= MIN_SHARED and _plain(value.dtype)
        ]
        if not big:
            self._chunks.append([len(samples), None])
            return samples
        offsets, size = [], 0
        for _, _, value in big:
            offsets.append(size)
            size += -(-value.nbytes // _ALIGN) * _ALIGN
        block = self._block(size)
        self._chunks.append([len(samples), block])
        out = [dict(s) for s in samples]
        for (i, key, value), offset in zip(big, offsets):
            np.ndarray(value.shape, value.dtype, buffer=block.buf, offset=offset)[...] = value
            out[i][key] = Shared(block.name, offset, tuple(value.shape), value.dtype.str)
        return out

    def _block(self, size: int) -> shared_memory.SharedMemory:
        """A block of at least ``size`` bytes: the smallest free one that holds them, else a new one
        (in place of a free one too small, so that the blocks kept stay as few as were in use)."""
        fits = [b for b in self._free if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: b.size)
            self._free.remove(block)
            return block
        if self._free:
            _free(self._free.pop())
        return shared_memory.SharedMemory(create=True, size=-(-size // _GRAIN) * _GRAIN)

    def taken(self) -> None:
        """One more sample's result taken, in order: after its chunk's last, the chunk's block is
        free for a later chunk (every worker is done with it: its results are in)."""
        chunk = self._chunks[0]
        chunk[0] -= 1
        if chunk[0] <= 0:
            self._chunks.popleft()
            if chunk[1] is not None:
                self._free.append(chunk[1])

    def close(self) -> None:
        """Free every block, held or kept (the pack is over, or stopped)."""
        while self._chunks:
            _free(self._chunks.popleft()[1])
        while self._free:
            _free(self._free.pop())


def _plain(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is told whole by its ``str`` (what :class:`Shared` carries): not objects, nor
    a structured or sub-array dtype, whose ``str`` is only its size (``|V8``: its fields would be lost
    on the way, and the worker's verdict on the sample would differ from this process's)."""
    return not dtype.hasobject and dtype.fields is None and dtype.subdtype is None


def _free(block: Optional[shared_memory.SharedMemory]) -> None:
    if block is not None:
        block.close()
        with contextlib.suppress(FileNotFoundError):
            block.unlink()


def attach(sample: dict[str, Any], blocks: dict[str, mmap.mmap]) -> dict[str, Any]:
    """The worker's side: ``sample`` with each :class:`Shared` place read as a read-only array view
    of its block (mapped once into ``blocks``; :func:`detach` them once no view is left)."""
    if not any(isinstance(v, Shared) for v in sample.values()):
        return sample
    out = dict(sample)
    for key, value in sample.items():
        if isinstance(value, Shared):
            if value.block not in blocks:
                blocks[value.block] = _map(value.block)
            out[key] = np.ndarray(value.shape, np.dtype(value.dtype), buffer=blocks[value.block], offset=value.offset)
    return out


def detach(blocks: dict[str, mmap.mmap]) -> None:
    """Unmap the blocks :func:`attach` mapped."""
    for block in blocks.values():
        with contextlib.suppress(BufferError):  # a view still referenced: unmapped once it is freed
            block.close()
    blocks.clear()


def _map(name: str) -> mmap.mmap:
    """The block ``name`` mapped read-only, by its POSIX name: not through SharedMemory, which (before
    Python 3.13's ``track=False``) registers it with the resource tracker the writing process
    shares, and so would unregister or unlink the writing process's block."""
    fd = _posixshmem.shm_open(name if name.startswith("/") else "/" + name, os.O_RDONLY, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
