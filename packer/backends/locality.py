"""Reading a block of records whole: byte runs for the kernel's readahead.

ShardSampler's ``order="block"`` knows, a window ahead, which blocks of records stored together an
epoch reads next (:attr:`packer.read.sampler.Draw.ahead`). Asked of the disk record by record, a block
is many small reads (and in random order within the window); asked as the byte runs its records
cover, it is a few large sequential ones with a deep queue, issued while the current window's
records are decoded. The readers (packer.backends) turn a block's records into file extents and give
:func:`runs` of them to ``madvise``/``posix_fadvise(WILLNEED)``, which start the reads and return,
in :func:`pieces` no longer than the kernel reads for one such call (Linux cuts a WILLNEED at the
disk's readahead or largest request size, whichever is larger; the rest would be read page by page
on use). Measured in docs/PERFORMANCE.md, "Block order".
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

#: Records closer than this in a file are read as one run, the bytes between them included (LMDB's
#: leaf pages lie between a block's overflow pages; reading them too costs less than another request).
GAP = 256 << 10


def records(ranges: Sequence[tuple[int, int]], count: int) -> np.ndarray:
    """The record indices of ``ranges`` (first, end), clipped to ``count`` records."""
    parts = [np.arange(max(0, lo), min(hi, count)) for lo, hi in ranges]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def runs(offsets: np.ndarray, lengths: np.ndarray, gap: int = GAP) -> list[tuple[int, int]]:
    """Byte ranges (start, end) covering the extents (``offsets``, ``lengths``) of one file, in
    file order, extents less than ``gap`` apart merged into one."""
    if not len(offsets):
        return []
    order = np.argsort(offsets, kind="stable")
    starts = np.asarray(offsets, np.int64)[order]
    ends = np.maximum.accumulate(starts + np.asarray(lengths, np.int64)[order])
    cut = np.flatnonzero(starts[1:] > ends[:-1] + gap) + 1
    firsts, lasts = np.r_[0, cut], np.r_[cut - 1, len(starts) - 1]
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))


def pieces(runs: list[tuple[int, int]], size: int) -> Iterator[tuple[int, int]]:
    """(start, length) pieces of at most ``size`` bytes covering ``runs``."""
    for start, end in runs:
        for at in range(start, end, size):
            yield at, min(size, end - at)


@functools.cache
def advice_bytes(device: int) -> int:
    """The most one WILLNEED reads of a file on ``device`` (an st_dev): Linux's cut,
    max(read_ahead_kb, max_sectors_kb) of the disk's queue; 128 KiB (the kernel's default
    readahead) where sysfs does not say (not Linux, not a block device)."""
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    queue = node / "queue" if (node / "queue").is_dir() else node.resolve().parent / "queue"
    sizes = []
    for name in ("read_ahead_kb", "max_sectors_kb"):
        try:
            sizes.append(int((queue / name).read_text()))
        except (OSError, ValueError):
            pass
    return max(sizes, default=128) << 10
