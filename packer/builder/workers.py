"""The worker pool: preprocess files in parallel, results back in input order, memory flat.

A bounded window of in-flight tasks keeps every core busy while the writer consumes results as they
arrive, so neither the queue of work nor the finished results pile up on a million-file build.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any, Optional

from ..errors import BuildError
from .preprocess import PreprocessSpec, Result, Skip, process_chunk

Context = ForkServerContext | SpawnContext  # the start methods packer's build workers use


def _worker_signals() -> None:
    """Ctrl-C is the parent's to handle (it terminates the pool); SIGTERM, which the CLI turns into an
    interrupt in the parent, just ends a worker (a forked one would inherit that handler)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _worker_context() -> Context:
    """forkserver, whether or not this process runs threads (a terminal's progress bar does), so that
    cron and interactive builds behave alike: its workers are forked from a small server process, not
    from this one, so they do not share (and then un-share, as this process keeps writing) the pages
    of the scan list, which grows with every file (docs/PERFORMANCE.md, "Build speed", a million files). The
    server preloads the decoders, so workers do not each import numpy and Pillow; spawn where
    forkserver is missing."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["packer.builder.preprocess"])
        return ctx
    return mp.get_context("spawn")


_CRASHED = "the decoder crashed its worker process (killed by a signal or out of memory)"
#: A pool "keeps dying" when this many files in a row, each run alone in a fresh worker, killed it
#: before any worker of the build had answered at all: not a bad file but a broken decoding
#: environment (its libraries, its memory), so the build fails instead of skipping every file.
CRASH_LIMIT = 8
_IN_PROCESS = "pass workers=0 (--workers 0) to decode in this process"
_GUARD = (
    'a script that calls packer.build() must do so under `if __name__ == "__main__":`, as worker '
    f"processes import the main module again; or {_IN_PROCESS}"
)


#: What a worker does with a chunk of items (paths for a build: process_chunk with its spec; samples
#: for packer.pack): one Result per item, never raising for an item's fault. Picklable (a module
#: function, or a functools.partial of one): it is sent to each worker.
Job = Callable[[list[Any]], list[Any]]


def _serve(conn: Connection, job: Job) -> None:
    """A worker's loop: a hello (it started), then a chunk of items in, their results out, until told
    to stop (None or EOF)."""
    _worker_signals()
    with contextlib.suppress(EOFError, OSError):  # the parent went away: nothing left to do
        conn.send(None)
        while (batch := conn.recv()) is not None:
            conn.send(job(batch))


class _Worker:
    """One process with its own pipe: nothing is shared, so a worker that dies cannot block the others
    (a multiprocessing.Pool worker killed while holding the task queue's lock hangs the whole pool), and
    the chunk it took down with it is known exactly."""

    def __init__(self, ctx: Context, job: Job) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, job), daemon=True)
        try:
            self.proc.start()
        except OSError as e:
            raise BuildError(f"cannot start a decoding worker process ({e.strerror or e}); {_IN_PROCESS}") from None
        finally:
            child.close()
        # (chunk number, paths) handed over and not yet answered, oldest first; two at a time, so the
        # next chunk is already waiting in the pipe while the parent writes the last results
        self.tasks: deque[tuple[int, list[Any]]] = deque()
        self.started = False  # its hello came: it runs _serve, so a later death is a file's doing

    def receive(self) -> Optional[list[Result]]:
        """The answer to the oldest chunk; None where that was the hello. EOFError: the process died
        (a file's doing, or a signal's: the OOM killer); BuildError where it exited before it even
        started serving, which no file did (an exception while the worker started)."""
        try:
            answer = self.conn.recv()
        except (EOFError, OSError):
            if not self.started:
                self.proc.join(timeout=5)
                if self.proc.exitcode is not None and self.proc.exitcode > 0:
                    raise BuildError(
                        f"a decoding worker process exited while starting (status {self.proc.exitcode}), "
                        f"before any file; {_GUARD}"
                    ) from None
            raise EOFError from None
        if not self.started:
            self.started = True
            return None
        return answer

    def give(self, k: int, batch: list[Any]) -> None:
        """Hand over a chunk; if the process is already gone, the sentinel reports it as a death."""
        self.tasks.append((k, batch))
        with contextlib.suppress(OSError):
            self.conn.send(batch)

    def stop(self, now: bool) -> None:
        if not now:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join()
        self.conn.close()


def _isolated(item: Any, job: Job, ctx: Context) -> Optional[Any]:
    """``item`` alone in a fresh process: did this item kill the worker (None), or was it a bystander?"""
    worker = _Worker(ctx, job)
    try:
        worker.give(0, [item])
        while (answer := worker.receive()) is None:
            pass
        return answer[0]
    except EOFError:
        return None
    finally:
        worker.stop(now=False)


def results(
    root: str, rels: Sequence[str], opts: PreprocessSpec, workers: int, chunk: int
) -> Generator[Result, None, None]:
    """Preprocess the files ``rels`` (relative to ``root``) in order with a bounded window of in-flight
    chunks (flat memory: a chunk's full paths are made when it is handed over, not a million at once),
    through :func:`ordered`."""

    def paths(k: int) -> list[str]:
        return [os.path.join(root, rel) for rel in rels[k * chunk : (k + 1) * chunk]]

    count = -(-len(rels) // chunk)
    if workers <= 1 or not count:
        for k in range(count):
            yield from process_chunk(paths(k), opts)
        return
    job = functools.partial(process_chunk, opts=opts)
    yield from ordered((paths(k) for k in range(count)), job, min(workers, count), name=str)


def ordered(
    chunks: Iterator[list[Any]], job: Job, workers: int, *, name: Callable[[Any], str], depth: int = 2
) -> Generator[Any, None, None]:
    """``job`` over each of ``chunks`` (taken from the iterator only as workers free up) in
    ``workers`` processes, the results yielded in order, a bounded window of chunks in flight.
    ``depth``: chunks handed to a worker at once. Two keep it busy while its last answer is read,
    where chunks are small (paths); 1 where they are big (a sample's pixels): a worker blocked
    sending a big answer no longer reads, and a second big chunk sent to it would block this
    process in turn, each waiting on the other's pipe.

    A worker that dies (a decoder crash, the kernel's OOM killer) is replaced, and the items of the
    chunk it held run one by one in fresh processes: the item that kills its process is skipped with
    a reason, every other item is done. A pool that cannot work at all is a BuildError instead of a
    build that skips everything: a worker that exits with an error before it starts serving (a script
    without the ``__main__`` guard), or CRASH_LIMIT items in a row that each kill a fresh worker
    before any worker has answered (``name``: how the error names the last one).
    """
    ctx = _worker_context()
    pool = [_Worker(ctx, job) for _ in range(max(1, workers))]
    done: dict[int, list[Any]] = {}
    handed, emitted, exhausted = 0, 0, False  # chunks given to workers; chunks yielded in order
    answered, crashes = False, 0  # any answer from a worker yet; items in a row that killed theirs

    def alone(item: Any) -> Any:
        nonlocal answered, crashes
        result = _isolated(item, job, ctx)
        if result is not None:
            answered, crashes = True, 0
            return result
        crashes += 1
        if not answered and crashes >= CRASH_LIMIT:
            raise BuildError(
                f"the decoding worker processes keep dying: each of the first {crashes} files run alone "
                f"killed its process, and none has decoded any file (broken decoder libraries, or too "
                f"little memory: try fewer --workers); last: {name(item)}"
            )
        return Skip(_CRASHED)

    window = 8 * workers  # finished-but-not-yet-yielded chunks stay few: memory stays flat
    try:
        while not (exhausted and emitted == handed):
            if emitted in done:
                yield from done.pop(emitted)
                emitted += 1
                continue
            for w in pool:
                while len(w.tasks) < depth and not exhausted and handed < emitted + window:
                    batch = next(chunks, None)
                    if batch is None:
                        exhausted = True
                        break
                    w.give(handed, batch)
                    handed += 1
            busy = [w for w in pool if w.tasks]
            if not busy:
                continue  # every chunk is in: the loop's test ends it
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
            for n, w in enumerate(pool):
                if not w.tasks or not (w.conn in ready or w.proc.sentinel in ready):
                    continue
                try:
                    if (answer := w.receive()) is None:
                        continue  # its hello: the chunk's answer comes next
                    done[w.tasks[0][0]] = answer
                    w.tasks.popleft()
                    answered, crashes = True, 0
                except EOFError:  # it died holding these chunks
                    w.stop(now=True)
                    pool[n] = _Worker(ctx, job)
                    for k, batch in w.tasks:
                        done[k] = [alone(item) for item in batch]
        for w in pool:
            w.stop(now=False)
    finally:
        for w in pool:
            w.stop(now=True)
