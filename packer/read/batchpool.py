"""Output batches in reused shared memory, so that DataLoader workers stop paying fresh pages per batch.

A DataLoader worker hands each batch to the main process in shared memory, and torch allocates a
new segment for every batch: the kernel faults in and zeroes each of its pages, then frees them
after the step, a cost per sample of the order of resizing the crop (docs/PERFORMANCE.md, "What
changed"). Instead each process keeps a few segments (memfd) and
lends them out, with the receiving side's reference count deciding when one is free again:

- :func:`lend` returns a tensor in a free segment and marks it lent (byte 0 of a header page);
- the collated batch pickles (to the DataLoader's result queue) as the segment's file descriptor,
  sent the way torch sends its own (multiprocessing's DupFd); the receiver maps it and gets a
  plain ``torch.Tensor`` over that mapping;
- when the receiver's last reference to that memory dies - the batch and every view of it, e.g.
  right after DataLoader(pin_memory=True) copied it - a finalizer clears the lent byte and the
  worker may fill the segment again. A batch the user keeps alive keeps its segment: the worker
  then takes another, up to :data:`POOL_MAX`, and past that falls back to a fresh segment.

A batch that never leaves its process (num_workers=0, or a custom collate_fn that copies) frees
its segment when its last tensor dies. Memory held is the peak number of batches alive at once
(as with torch's own per-batch segments), kept for the process's life. Linux only (memfd); elsewhere
:func:`lend` returns None and callers allocate as before.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from multiprocessing.reduction import DupFd
from typing import Any, Optional, Protocol, SupportsIndex

import numpy as np
import torch

#: Bytes before the data: the "lent" flag lives in byte 0, and the data stays page-aligned.
HEADER = mmap.PAGESIZE
#: Segments per process; past this many lent at once, batches get fresh memory.
POOL_MAX = 8


class _Segment:
    """One memfd: header page + data. ``local``: a tensor of this process still uses it;
    ``sent``: its current lending was pickled to another process, which clears byte 0 when done."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("packer-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + nbytes)
        self.mm = mmap.mmap(self.fd, HEADER + nbytes)
        self.nbytes = nbytes
        self.address = np.frombuffer(self.mm, np.uint8, 1, HEADER).ctypes.data  # the data's address
        self.local = False
        self.sent = False

    def free(self) -> bool:
        return not self.local and self.mm[0] == 0

    def close(self) -> None:
        os.close(self.fd)  # the mapping goes when its last user does


_lock = threading.Lock()
_pool: list[_Segment] = []
_pool_pid = -1
_by_storage: dict[int, _Segment] = {}  # data pointer of a lent segment's storage -> segment


def _own_pool() -> list[_Segment]:
    """This process's segments (a forked child must not lend its parent's: they are in use there)."""
    global _pool, _pool_pid, _by_storage
    if _pool_pid != os.getpid():
        _pool, _pool_pid, _by_storage = [], os.getpid(), {}
    return _pool


def lend(shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A C-contiguous tensor of ``shape``/``dtype`` in a free segment, or None (no memfd here, or
    :data:`POOL_MAX` segments lent at once)."""
    if not hasattr(os, "memfd_create"):
        return None
    nbytes = int(np.prod(shape)) * dtype.itemsize
    with _lock:
        pool = _own_pool()
        seg = next((s for s in pool if s.nbytes == nbytes and s.free()), None)
        if seg is None:
            idle = next((s for s in pool if s.free()), None)  # a free one of another size: replace it
            if idle is not None:
                pool.remove(idle)
                idle.close()
            elif len(pool) >= POOL_MAX:
                return None
            seg = _Segment(nbytes)
            pool.append(seg)
        seg.mm[0], seg.local, seg.sent = 1, True, False
    array = np.frombuffer(seg.mm, np.uint8, nbytes, HEADER)
    weakref.finalize(array, _local_done, seg, os.getpid()).atexit = False
    storage = torch.from_numpy(array).untyped_storage()  # keeps ``array`` alive while used
    _by_storage[seg.address] = seg
    # torch's stub wants a stride too; set_(storage, offset, size) (contiguous strides) is valid torch
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]


def _local_done(seg: _Segment, pid: int) -> None:
    """This process no longer uses the lending; unless it was sent away, the segment is free."""
    if os.getpid() != pid:  # a forked child dropping an inherited reference: not its to free
        return
    with _lock:
        _by_storage.pop(seg.address, None)
        seg.local = False
        if not seg.sent:
            seg.mm[0] = 0


class PooledBatch(torch.Tensor):
    """A batch tensor in a pool segment: pickles as the segment's file descriptor (see module doc)."""

    # torch's documented way to opt a subclass out of __torch_function__; its stub types the slot as a
    # method, so assigning the C function is flagged
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _packer_segment: _Segment  # set by pooled()

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        seg = self._packer_segment
        plain = self.as_subclass(torch.Tensor)
        if seg.sent:  # pickled twice: only one receiver can own the release, so copy for the others
            return plain.clone().__reduce_ex__(protocol)
        seg.sent = True
        return (
            _receive,
            (
                DupFd(seg.fd),
                seg.nbytes,
                str(self.dtype).removeprefix("torch."),
                tuple(plain.shape),
                tuple(plain.stride()),
                plain.storage_offset(),
            ),
        )


def pooled(batch: torch.Tensor) -> torch.Tensor:
    """``batch`` as a :class:`PooledBatch` when it is in a lent segment and this is a DataLoader
    worker (whose batches are pickled to the main process, never saved), else unchanged."""
    from torch.utils.data import get_worker_info

    seg = _by_storage.get(batch.untyped_storage().data_ptr())
    if seg is None or os.getpid() != _pool_pid or get_worker_info() is None:
        return batch
    out = batch.as_subclass(PooledBatch)
    out._packer_segment = seg
    return out


class _Detachable(Protocol):
    """What ``DupFd(fd)`` unpickles to in the receiver (typeshed types DupFd as a bare function)."""

    def detach(self) -> int: ...


def _receive(
    fd: _Detachable, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> torch.Tensor:
    """Unpickling side: map the segment; when the last tensor over the mapping dies, free it."""
    handle = fd.detach()
    try:
        mm = mmap.mmap(handle, HEADER + nbytes)
    finally:
        os.close(handle)
    array = np.frombuffer(mm, np.uint8, nbytes, HEADER)
    weakref.finalize(array, _release, mm, os.getpid()).atexit = False
    storage = torch.from_numpy(array).untyped_storage()
    return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, shape, stride)


def _release(mm: mmap.mmap, pid: int) -> None:
    """The receiver's last tensor over the segment died: the sender may lend it again. (The mapping
    itself goes with the finalizer's reference to ``mm``; it cannot be closed while the dying
    array still holds its buffer.)"""
    if os.getpid() == pid:
        mm[0] = 0


#: A tensor (or a list of per-sample tensors) of fewer bytes than this crosses from a DataLoader
#: worker by value, inside the pickled batch, rather than in a shared-memory segment of its own:
#: torch's way costs a segment made, its descriptor passed and mapped by the receiver, for a few
#: hundred bytes of labels or boxes (docs/PERFORMANCE.md, "Fields").
INLINE_MAX = 1 << 16


class InlineBatch(torch.Tensor):
    """A small batch tensor made in a DataLoader worker: pickles as its bytes (see :data:`INLINE_MAX`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # as PooledBatch

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        plain = self.as_subclass(torch.Tensor)
        return _tensor, (bytearray(plain.numpy().tobytes()), plain.numpy().dtype.str, tuple(plain.shape))


class InlineList(list):
    """Per-sample tensors of one dtype and trailing shape, made in a DataLoader worker (boxes, box
    labels): pickle as their bytes joined and their lengths, unpickled into a plain list of views of
    one tensor (as the worker made them)."""

    def __reduce__(self) -> tuple[Any, ...]:
        arrays = [t.numpy() for t in self]
        joined = np.concatenate(arrays)
        return _split, (bytearray(joined.tobytes()), joined.dtype.str, joined.shape[1:], [len(a) for a in arrays])


def inline(value: Any) -> Any:
    """``value`` (a collated batch's tensor, or list of per-sample tensors) marked to pickle by value
    when this is a DataLoader worker and it is small (:data:`INLINE_MAX`); else unchanged."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return value
    if isinstance(value, torch.Tensor):
        if type(value) is torch.Tensor and _plain([value]) and value.nbytes < INLINE_MAX:
            return value.as_subclass(InlineBatch)
        return value
    if (
        isinstance(value, list)
        and value
        and all(type(t) is torch.Tensor for t in value)
        and _plain(value)
        and all(t.dim() > 0 and t.dtype == value[0].dtype and t.shape[1:] == value[0].shape[1:] for t in value)
        and sum(t.nbytes for t in value) < INLINE_MAX
    ):
        return InlineList(value)
    return value


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Whether each of ``tensors`` is a CPU tensor without grad of a dtype numpy has."""
    return all(t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_DTYPES for t in tensors)


_NUMPY_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32)
    + (torch.float64, torch.complex64, torch.complex128)
)


def _tensor(data: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Unpickling side of :class:`InlineBatch`: a plain tensor over ``data`` (its bytes, writable)."""
    array = np.frombuffer(data, np.dtype(dtype)) if data else np.zeros(0, np.dtype(dtype))
    return torch.from_numpy(array.reshape(shape))


def _split(data: bytearray, dtype: str, tail: tuple[int, ...], lengths: list[int]) -> list[torch.Tensor]:
    """Unpickling side of :class:`InlineList`: a plain list of views of one tensor."""
    return list(_tensor(data, dtype, (sum(lengths), *tail)).split(lengths))
