"""The room a cache directory takes as ``du`` counts it, and its peak while a block runs: what a
user checks a cache_limit with (tests/store and scripts/bench_remote.py)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from packer.read.remote.eviction import cache_locked


def on_disk(cache: Path) -> tuple[int, int]:
    """The bytes under ``cache`` as ``du`` counts them, taken without any lock of the cache: every
    file and folder, each inode once (a unit and its link in its version's folder are one); their
    sizes, and their allocated blocks (``du``'s default)."""
    seen: set[tuple[int, int]] = set()
    sizes = blocks = 0
    for folder, folders, files in os.walk(cache):
        for path in [folder, *(os.path.join(folder, name) for name in folders + files)]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # evicted meanwhile
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                sizes, blocks = sizes + st.st_size, blocks + st.st_blocks * 512
    return sizes, blocks


def _counted(cache: Path) -> tuple[int, int]:
    """:func:`on_disk` of ``cache`` under the cache's own lock, under which every reservation, eviction
    and rename into ``units/`` happens: a walk without it can meet a unit evicted (walked before its
    unlink) and the download that took its room (walked after its creation), and count both."""
    if not cache.is_dir():
        return on_disk(cache)
    with cache_locked(cache):
        return on_disk(cache)


@contextlib.contextmanager
def du_peak(cache: Path, *, every: float = 0.002) -> Iterator[list[int]]:
    """The most :func:`on_disk` saw of ``cache`` (sizes, blocks), sampled every ``every`` seconds
    in a thread while the block runs (filled in as it goes), each sample a consistent state of the
    cache (taken under its lock)."""
    highest = [0, 0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            highest[:] = map(max, highest, _counted(cache))
            time.sleep(every)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        yield highest
    finally:
        done.set()
        watcher.join()
