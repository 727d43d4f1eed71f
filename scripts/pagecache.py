"""Page-cache helpers for the benchmarks: evict a dataset's pages (posix_fadvise DONTNEED, what
`vmtouch -e` does: no root needed, other files untouched) and measure how much of it is cached
(mincore, what fincore does). No torch import, so that timing scripts can use it in light processes."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)


def files(dataset: Path) -> list[Path]:
    return sorted(p for p in dataset.rglob("*") if p.is_file())


def evict(dataset: Path) -> None:
    """Drop the dataset's clean pages from the page cache (dirty ones are synced first)."""
    for f in files(dataset):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(dataset: Path) -> float:
    """Share of the dataset's pages in the page cache (mincore over a read-only mapping of each file)."""
    resident = total = 0
    for f in files(dataset):
        size = f.stat().st_size
        if size == 0:
            continue
        # a private mapping (never written): ctypes needs a writable buffer to take its address
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            buf = (ctypes.c_char * size).from_buffer(mm)
            status = _libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            del buf  # the mapping cannot close while a ctypes view holds it
            if status != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += sum(v & 1 for v in vec)
            total += pages
    return resident / max(total, 1)


if __name__ == "__main__":  # python scripts/pagecache.py PATH...: evict each dataset, print what stays cached
    import sys

    for arg in sys.argv[1:]:
        evict(Path(arg))
        print(f"{arg}: {cached_fraction(Path(arg)):.1%} cached")
