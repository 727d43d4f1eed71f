"""The worker pool: preprocess files in parallel, results back in input order, memory flat.

A bounded window of in-flight tasks keeps every core busy while the writer consumes results as they
arrive, so neither the queue of work nor the finished results pile up on a million-file build.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.pool
import signal
import threading
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.pool import AsyncResult
from typing import Iterator, Optional

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


def _pids(pool: mp.pool.Pool) -> set[int]:
    """The pool's worker pids (Pool's private list: it replaces a dead worker, so a new pid = a death)."""
    return {proc.pid for proc in pool._pool}


def _child(path: str, opts: Options, conn: Connection) -> None:
    _worker_signals()
    conn.send(process_chunk([path], opts)[0])


def _isolated(path: str, opts: Options, ctx: mp.context.BaseContext) -> Result:
    """``path`` alone in a fresh process: after a worker died, find out whether this file killed it."""
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(path, opts, writer), daemon=True)
    proc.start()
    writer.close()
    try:
        if reader in wait([reader, proc.sentinel]):
            try:
                return reader.recv()
            except EOFError:
                pass
        return Skip("the decoder crashed its worker process (killed by a signal or out of memory)")
    finally:
        reader.close()
        proc.join()


def results(paths: list[str], opts: Options, workers: int, chunk: int) -> Iterator[Result]:
    """Preprocess ``paths`` in order with a bounded window of in-flight chunks (flat memory).

    A worker that dies (a decoder crash, the kernel's OOM killer) takes its chunk with it, and
    multiprocessing.Pool would wait for that result forever. So a death (a worker pid replaced)
    retires the pool: results already back are kept, the files of every unfinished chunk run one by
    one in fresh processes (the one that kills its process is skipped with a reason), and a new pool
    takes the rest.
    """
    if workers <= 1:
        for i in range(0, len(paths), chunk):
            yield from process_chunk(paths[i:i + chunk], opts)
        return
    ctx = _worker_context()

    def start() -> tuple[mp.pool.Pool, set[int]]:
        new = ctx.Pool(workers, initializer=_worker_signals)
        return new, _pids(new)

    pool, pids = start()
    pending: deque[tuple[list[str], Optional[AsyncResult]]] = deque()  # None: run its files isolated

    def next_results() -> list[Result]:
        nonlocal pool, pids
        batch, result = pending[0]
        while result is not None and not result.ready():
            result.wait(0.2)
            if not result.ready() and _pids(pool) != pids:
                pool.terminate()
                pool.join()
                unfinished = [(b, r if r is not None and r.ready() else None) for b, r in pending]
                pending.clear()
                pending.extend(unfinished)
                pool, pids = start()
                batch, result = pending[0]
        pending.popleft()
        return result.get() if result is not None else [_isolated(path, opts, ctx) for path in batch]

    try:
        for i in range(0, len(paths), chunk):
            batch = paths[i:i + chunk]
            pending.append((batch, pool.apply_async(process_chunk, (batch, opts))))
            if len(pending) >= 8 * workers:
                yield from next_results()
        while pending:
            yield from next_results()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
