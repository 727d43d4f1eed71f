"""The worker pool: preprocess files in parallel, results back in input order, memory flat.

A bounded window of in-flight tasks keeps every core busy while the writer consumes results as they
arrive, so neither the queue of work nor the finished results pile up on a million-file build.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from collections import deque
from typing import Iterator

from .preprocess import Options, Result, process_chunk


def _worker_signals() -> None:
    """Ctrl-C is the parent's to handle (it terminates the pool); SIGTERM, which the CLI turns into an
    interrupt in the parent, just ends a worker (a forked one would inherit that handler)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _worker_context() -> mp.context.BaseContext:
    """fork when this process runs no other thread (starts in ms); else forkserver, which stays safe.

    The forkserver preloads the decoders, so its workers do not each import numpy and Pillow.
    """
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return mp.get_context("fork")
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["packer.preprocess"])
        return ctx
    return mp.get_context("spawn")


def results(paths: list[str], opts: Options, workers: int, chunk: int) -> Iterator[Result]:
    """Preprocess ``paths`` in order with a bounded window of in-flight chunks (flat memory)."""
    if workers <= 1:
        for i in range(0, len(paths), chunk):
            yield from process_chunk(paths[i:i + chunk], opts)
        return
    pool = _worker_context().Pool(workers, initializer=_worker_signals)
    try:
        pending: deque = deque()
        for i in range(0, len(paths), chunk):
            pending.append(pool.apply_async(process_chunk, (paths[i:i + chunk], opts)))
            if len(pending) >= 8 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
