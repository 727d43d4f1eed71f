"""The worker pool: preprocess files in parallel, results back in input order, memory flat.

A bounded window of in-flight tasks keeps every core busy while the writer consumes results as they
arrive, so neither the queue of work nor the finished results pile up on a million-file build.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator

from .preprocess import Options, Result, Skip, process_chunk


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


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the pool now: on Ctrl-C or an error nobody waits for the chunks still being decoded."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def _isolated(path: str, opts: Options, ctx: mp.context.BaseContext) -> Result:
    """``path`` alone in a fresh process: after a worker died, find out whether this file killed it."""
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_signals) as one:
        try:
            return one.submit(process_chunk, [path], opts).result()[0]
        except BrokenProcessPool:
            return Skip("the decoder crashed its worker process (killed by a signal or out of memory)")


def results(paths: list[str], opts: Options, workers: int, chunk: int) -> Iterator[Result]:
    """Preprocess ``paths`` in order with a bounded window of in-flight chunks (flat memory).

    A worker that dies (a decoder crash, the kernel's OOM killer) breaks the pool: a new pool takes
    the chunks still pending, and the files of the lost chunk run one by one in fresh processes, so
    the file that kills its process is skipped with a reason and every other file is packed.
    """
    if workers <= 1:
        for i in range(0, len(paths), chunk):
            yield from process_chunk(paths[i:i + chunk], opts)
        return
    ctx = _worker_context()

    def start() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_signals)

    pool = start()
    pending: deque[tuple[list[str], Future]] = deque()

    def next_results() -> list[Result]:
        nonlocal pool
        batch, future = pending.popleft()
        try:
            return future.result()
        except BrokenProcessPool:
            _stop(pool)
            pool = start()
            retry = [b for b, _ in pending]
            pending.clear()
            pending.extend((b, pool.submit(process_chunk, b, opts)) for b in retry)
            return [_isolated(path, opts, ctx) for path in batch]

    try:
        for i in range(0, len(paths), chunk):
            batch = paths[i:i + chunk]
            pending.append((batch, pool.submit(process_chunk, batch, opts)))
            if len(pending) >= 8 * workers:
                yield from next_results()
        while pending:
            yield from next_results()
        pool.shutdown(wait=True)
    finally:
        _stop(pool)
