"""``packer build --dask ADDRESS``: the same build, with preprocessing spread over a Dask cluster.

:class:`DaskEngine` is the build's engine (see :mod:`packer.builder.pipeline`): scan, locks, --split, the
--update reuse plan, staging, record sink and manifest are the local build's own; only the decoding
differs. The files to decode (all of them, or with --update the added and changed ones) are cut into
fixed slices of ``shard_size`` files (tasks). Each task runs on a worker, preprocesses its files with
:func:`packer.builder.preprocess.process_chunk` exactly as a local build does, and writes a *fragment* into
``<staging>/fragments/``: ``part-NNNNN.bin`` (records back to back), ``part-NNNNN.npy`` (their index
rows) and, last, ``part-NNNNN.json`` (counts, skipped files, which files). Every file is written under
a unique temporary name and renamed, and the JSON goes last, so a worker killed mid-task leaves
nothing that counts; a retried or duplicated task just rewrites the same bytes. Only the small JSON
metadata travels back to the driver.

The driver then feeds every source's record to the record sink in scan order: from the fragments, or
from the dataset being replaced (--update: kept in its linked data files, see packer.builder.segments). LMDB
gets one sequential pass; for memmap without reused records each non-empty fragment is renamed into a
``shard-NNNNN.bin`` (a memmap shard holds one task's records), with reused records the fragments are
copied into ``shard_size``-record shards of the new segment. The digest is the index's (the local
build's complete()), so it equals a local build's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import uuid
from collections.abc import Generator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from .._version import DISTRIBUTION, __version__
from ..backends import BACKENDS
from ..backends.write import fsync_path, write_atomic
from ..codec import can_decode_region, codec_name
from ..errors import ShardError, say
from ..format import IDENTITY_DTYPE, INDEX_DTYPE, shard_name
from .options import DASK_TASK_SIZE, BuildError, BuildOptions, Resolved
from .pipeline import run_build
from .preprocess import PreprocessSpec, Record, Result, Skip, process_chunk
from .scan import Scan
from .segments import Fetch
from .staging import PROGRESS, BuildReport, Progress, RecordSink, Writer, fill, write_json_atomic
from .update import ReusePlan, ordered_results

FRAGMENTS = "fragments"
CONNECT_TIMEOUT = 10  # seconds; an unreachable scheduler should fail fast, not hang
WORKER_WAIT = 300  # seconds to wait for a first worker (a batch-queued cluster may still be starting)
RETRIES = 2  # re-runs of a task that raised (e.g. a transient NFS error); lost workers are separate


def fragment_stem(k: int) -> str:
    return f"part-{k:05d}"


def paths_digest(rels: list[str], identities: np.ndarray) -> str:
    """Which files a fragment holds, with the scan identities they had: --resume reuses it only for
    the same files (an --update whose reuse plan changed meanwhile cuts its tasks differently), none
    of them changed since (a file re-exported in place is decoded again)."""
    h = hashlib.sha256("\0".join(rels).encode("utf-8", "surrogateescape"))
    h.update(np.ascontiguousarray(identities, dtype=IDENTITY_DTYPE).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- worker side


def pack_shard(
    raw: str, fragments: str, k: int, rels: list[str], opts: PreprocessSpec, *, inputs: str
) -> dict[str, Any]:
    """One task: preprocess ``rels`` (paths under ``raw``) into fragment ``k``; returns its metadata,
    which records ``inputs``, the task's :func:`paths_digest`. The fragment's table (INDEX_DTYPE rows,
    only where each record lies in the fragment and its size and CRC) is not the dataset's index: the
    assembly reads its records back and the RecordSink fills their rows, as a local build's.

    Files go through ``process_chunk`` one at a time and straight to disk, so worker memory stays at
    one record whatever the task size, and an unexpected error names the exact file.
    """
    host = socket.gethostname()
    if not os.path.isdir(raw):
        raise ShardError(
            f"shard {k}: worker on {host} cannot see raw/ at {raw} (raw/ must be on storage every worker can reach)"
        )
    stem = Path(fragments) / fragment_stem(k)
    rows = np.zeros(len(rels), dtype=INDEX_DTYPE)
    skipped: list[tuple[int, str]] = []
    count = size = 0

    def write_records(f: BinaryIO) -> None:
        nonlocal count, size
        for i, rel in enumerate(rels):
            try:
                result = process_chunk([os.path.join(raw, rel)], opts)[0]
                if isinstance(result, Record):
                    f.write(result.data)
                    row = rows[count]
                    row["offset"], row["length"] = size, len(result.data)
                    row["height"], row["width"] = result.height, result.width
                    row["crc32"] = result.crc32
                    count += 1
                    size += len(result.data)
                else:
                    skipped.append((i, result.reason))
            except Exception as e:
                raise ShardError(
                    f"shard {k}: {os.path.join(raw, rel)}: {type(e).__name__}: {e} (on worker {host})"
                ) from e

    try:
        write_atomic(stem.with_suffix(".bin"), write_records)
        write_atomic(stem.with_suffix(".npy"), lambda f: np.save(f, rows[:count], allow_pickle=False))
        meta = {
            "shard": k,
            "files": len(rels),
            "paths": inputs,
            "count": count,
            "bytes": size,
            "skipped": skipped,
        }
        write_atomic(stem.with_suffix(".json"), lambda f: f.write(json.dumps(meta).encode("utf-8")))
        fsync_path(fragments)
    except OSError as e:
        raise ShardError(f"shard {k}: cannot write its fragment in {fragments} on worker {host}: {e}") from e
    return meta


def probe(raw: str, fragments: str, first: str, dask_worker: Any = None) -> dict[str, Any]:
    """Run once on every worker: can it read raw/, and write a file that the driver then sees?

    Also: a worker running tasks in several threads needs packer's C binding, whose libjpeg error
    handler reports damaged JPEG data per call; PyTurboJPEG reports it as a Python warning, which only
    a process-wide (and so thread-unsafe) filter turns into an error.
    """
    threads = (
        getattr(getattr(dask_worker, "state", None), "nthreads", None)  # distributed >= 2023
        or getattr(dask_worker, "nthreads", None)
        or 1
    )
    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "codec": codec_name(),
        "version": __version__,
        "threads": threads,
        "error": None,
        "probe": None,
    }
    if threads > 1 and not can_decode_region():
        facts["error"] = (
            f"runs {threads} threads, and packer's C extension is not built there: damaged "
            f"JPEGs could not be told apart reliably (start workers with --nthreads 1)"
        )
        return facts
    if not os.path.isfile(os.path.join(raw, first)):
        facts["error"] = f"cannot see raw/ ({os.path.join(raw, first)} is missing there)"
        return facts
    name = f"probe-{facts['host']}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        Path(fragments, name).write_bytes(b"")
    except OSError as e:
        facts["error"] = f"cannot write the staging folder {fragments} ({e.strerror or e})"
        return facts
    facts["probe"] = name
    return facts


# ----------------------------------------------------------------------------------------- driver side


def _slices(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _finished(fragments: Path, k: int, files: int, inputs: str) -> Optional[dict[str, Any]]:
    """Fragment ``k``'s metadata if it holds the ``files`` files whose :func:`paths_digest` is
    ``inputs`` and is complete (reusable by --resume), else None."""
    stem = fragments / fragment_stem(k)
    try:
        meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
        ok = (
            meta["files"] == files
            and meta.get("paths") == inputs
            and meta["count"] + len(meta["skipped"]) == files
            and stem.with_suffix(".bin").stat().st_size == meta["bytes"]
            and stem.with_suffix(".npy").is_file()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if ok else None


def _connect(address: str, workers: int, stack: ExitStack) -> Any:
    """A Client for ``address`` ("local" starts a LocalCluster of ``workers`` 1-thread processes)."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise BuildError(f"--dask needs Dask distributed: pip install '{DISTRIBUTION}[dask]'") from None
    if address == "local":
        cluster = stack.enter_context(
            LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",
                silence_logs=logging.ERROR,
            )
        )
        return stack.enter_context(Client(cluster))
    try:  # a malformed address is refused before a Client exists (a half-made one stalls the interpreter's exit)
        from distributed.comm import get_address_host_port, parse_address
        from distributed.comm.registry import get_backend

        get_backend(parse_address(address)[0])
        get_address_host_port(address)
    except ValueError as e:
        raise BuildError(f"cannot use Dask scheduler address {address!r}: {e}") from None
    try:
        client = Client(address, timeout=CONNECT_TIMEOUT)
    except (OSError, TimeoutError):
        raise BuildError(
            f"cannot reach the Dask scheduler at {address} within {CONNECT_TIMEOUT} s: is it "
            f"running, and is the address right (e.g. tcp://host:8786)?"
        ) from None
    return stack.enter_context(client)


def _check_workers(client: Any, raw: str, fragments: Path, first: str, codec: str) -> None:
    """Fail early, in one line, when a worker cannot see raw/ or the staging folder, or packs differently."""
    try:
        client.wait_for_workers(1, timeout=WORKER_WAIT)
    except Exception:
        raise BuildError(f"no Dask worker joined the scheduler within {WORKER_WAIT} s") from None
    try:
        facts = client.run(probe, raw, str(fragments), first)
    except Exception as e:  # typically packer missing on a worker: the function cannot be unpickled
        raise BuildError(
            f"a Dask worker could not run packer ({type(e).__name__}: {e}); "
            f"install {DISTRIBUTION}[dask] on every worker"
        ) from None
    for addr, f in sorted(facts.items()):
        where = f"Dask worker {addr} on {f['host']}"
        if f["error"]:
            raise BuildError(
                f"{where} {f['error']}; raw/ and the output's parent must be on storage "
                f"every worker can reach (see docs/DISTRIBUTED.md)"
            )
        probe_file = fragments / f["probe"]
        if not probe_file.exists():
            raise BuildError(
                f"{where} wrote {probe_file} but this machine cannot see it: the output's "
                f"parent is not on storage shared with the workers (see docs/DISTRIBUTED.md)"
            )
        probe_file.unlink()
        if (f["codec"], f["version"]) != (codec, __version__):
            raise BuildError(
                f"{where} runs packer {f['version']} with {f['codec']}, this machine packer "
                f"{__version__} with {codec}: install the same versions everywhere "
                f"(JPEG bytes, and so the digest, depend on them)"
            )


def _describe_failure(k: int, rels: list[str], raw: str, e: BaseException) -> str:
    from distributed import KilledWorker

    if isinstance(e, KilledWorker):
        return (
            f"shard {k} ({os.path.join(raw, rels[0])} .. {rels[-1]}): every worker that ran it died "
            f"(out of memory, or a crash in a decoder?); build those files locally to find the culprit"
        )
    return str(e) if isinstance(e, ShardError) else f"shard {k}: {type(e).__name__}: {e}"


def _run_tasks(
    client: Any,
    raw: str,
    fragments: Path,
    tasks: list[list[str]],
    inputs: list[str],
    todo: list[int],
    opts: PreprocessSpec,
    on_error: Optional[str],
    progress: Progress,
    retries: int,
) -> dict[int, dict[str, Any]]:
    """Run the missing fragments ``todo`` (task k packs the files ``tasks[k]``, whose paths_digest is
    ``inputs[k]``) with a bounded window of
    in-flight tasks (the scheduler holds few paths). Returns each new fragment's metadata by number."""
    from distributed import as_completed

    token = uuid.uuid4().hex[:8]
    queue, running = list(reversed(todo)), as_completed()
    shard_of: dict[Any, int] = {}
    metas: dict[int, dict[str, Any]] = {}
    done_shards = len(tasks) - len(todo)

    def refill() -> None:
        window = max(4, 2 * sum(client.nthreads().values()))  # follows workers joining or leaving
        while queue and len(shard_of) < window:
            k = queue.pop()
            future = client.submit(
                pack_shard,
                raw,
                str(fragments),
                k,
                tasks[k],
                opts,
                inputs=inputs[k],
                retries=retries,
                key=f"packer-shard-{k:05d}-{token}",
                pure=False,
            )
            shard_of[future] = k
            running.add(future)

    refill()
    try:
        for future in running:
            k = shard_of.pop(future)
            try:
                meta = future.result()
            except Exception as e:
                raise BuildError(_describe_failure(k, tasks[k], raw, e)) from None
            if on_error == "fail" and meta["skipped"]:
                (fragments / fragment_stem(k)).with_suffix(".json").unlink()  # --resume redoes this shard
                i, reason = meta["skipped"][0]
                raise BuildError(f"{os.path.join(raw, tasks[k][i])}: {reason} (--on-error fail)")
            metas[k] = meta
            done_shards += 1
            progress.update(meta["files"], note=f"shards {done_shards}/{len(tasks)}")
            refill()
    finally:
        if shard_of:
            client.cancel(list(shard_of))
    return metas


def _fragment_results(fragments: Path, metas: list[dict[str, Any]]) -> Generator[Result, None, None]:
    """The decoded files' results, fragment after fragment, in task order (records read from the
    fragments' data files, skips from their metadata)."""
    for k, meta in enumerate(metas):
        stem = fragments / fragment_stem(k)
        bad = dict(meta["skipped"])
        rows = np.load(stem.with_suffix(".npy"), allow_pickle=False) if meta["count"] else np.zeros(0, INDEX_DTYPE)
        with ExitStack() as stack:
            if meta["count"]:
                f = stack.enter_context(open(stem.with_suffix(".bin"), "rb"))
                m = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            records = zip(*(rows[name].tolist() for name in ("offset", "length", "height", "width", "crc32")))
            for i in range(meta["files"]):
                if i in bad:
                    yield Skip(bad[i])
                    continue
                offset, length, height, width, crc = next(records)
                yield Record(m[offset : offset + length], height, width, crc)


class _AdoptedShards:
    """The memmap writer of a --dask build without reused records: each non-empty fragment's data file
    becomes a shard whole (a rename, no copy); ``append`` only says where each record already is."""

    def __init__(self, staging: Path, fragments: Path, metas: list[dict[str, Any]]) -> None:
        self.staging, self.fragments = staging, fragments
        self.pending = [(k, int(m["count"]), int(m["bytes"])) for k, m in enumerate(metas) if m["count"]]
        self.pending.reverse()
        self.shards: list[dict[str, Any]] = []
        self.left = self.offset = 0

    def append(self, data: bytes) -> tuple[int, int]:
        if self.left == 0:  # the first record of the next fragment: adopt its file
            k, count, size = self.pending.pop()
            name = shard_name(len(self.shards))
            os.replace((self.fragments / fragment_stem(k)).with_suffix(".bin"), self.staging / name)
            self.shards.append({"file": name, "count": count, "bytes": size})
            self.left, self.offset = count, 0
        self.left -= 1
        self.offset += len(data)
        return len(self.shards) - 1, self.offset - len(data)

    def checkpoint(self) -> dict[str, Any]:
        return {}

    def close(self) -> list[dict[str, Any]]:
        fsync_path(self.staging)
        return self.shards


@dataclass
class DaskEngine:
    """Decode on a Dask cluster (see the module docstring); connects once, on the first dataset that
    has files to decode, and stays connected for the other datasets of a --split build."""

    raw: str
    address: str
    quiet: bool
    retries: int
    stack: ExitStack
    marker: dict[str, str] = field(default_factory=lambda: {"engine": "dask"})
    shard_size: int = DASK_TASK_SIZE
    client: Any = None

    def pack(
        self, staging: Path, found: Scan, options: Resolved, state: Optional[dict[str, Any]], reuse: Optional[ReusePlan]
    ) -> tuple[RecordSink, int]:
        staging = Path(os.path.abspath(staging))  # workers have their own working directory
        fragments = staging / FRAGMENTS
        if state is None:
            write_json_atomic(staging / PROGRESS, {"engine": "dask"})  # marks the folder resumable
        fragments.mkdir(exist_ok=True)
        for tmp in fragments.glob(".*.tmp-*"):
            tmp.unlink()  # from attempts killed mid-write
        old_of = reuse.old_of if reuse is not None else np.full(len(found.sources), -1, dtype=np.int64)
        rels = found.sources.paths.select(old_of < 0)  # only the files to decode
        identities, size = found.identities()[old_of < 0], options.shard_size
        tasks = [list(rels[start : start + size]) for start in range(0, len(rels), size)]
        inputs = [paths_digest(files, identities[k * size : k * size + len(files)]) for k, files in enumerate(tasks)]
        finished = {k: _finished(fragments, k, len(files), inputs[k]) for k, files in enumerate(tasks)}
        if options.on_error == "fail":  # a fragment with skipped files is redone: the files may have been fixed
            finished = {k: m if m is None or not m["skipped"] else None for k, m in finished.items()}
        todo = [k for k, meta in finished.items() if meta is None]
        resumed = sum(meta["files"] for meta in finished.values() if meta is not None)
        metas = {k: m for k, m in finished.items() if m is not None}
        progress = Progress(len(rels), resumed, self.quiet)
        try:
            if todo:
                client = self._connect(fragments, tasks[todo[0]][0], max(1, options.processes))
                metas |= _run_tasks(
                    client,
                    self.raw,
                    fragments,
                    tasks,
                    inputs,
                    todo,
                    options.preprocess,
                    options.on_error,
                    progress,
                    self.retries,
                )
        finally:
            progress.close()
        return self._assemble(staging, fragments, found, options, [metas[k] for k in range(len(tasks))], reuse), resumed

    def _connect(self, fragments: Path, first: str, workers: int) -> Any:
        if self.client is None:
            self.client = _connect(self.address, workers, self.stack)
        _check_workers(self.client, self.raw, fragments, first, codec_name())
        return self.client

    def _assemble(
        self,
        staging: Path,
        fragments: Path,
        found: Scan,
        options: Resolved,
        metas: list[dict[str, Any]],
        reuse: Optional[ReusePlan],
    ) -> RecordSink:
        """Fragments (and, with --update, the old dataset's records) into the sink in scan order."""
        backend, shard_size = options.backend, options.shard_size
        base = reuse.base if reuse is not None else None
        first = len(base.files) if base is not None else 0  # the old data files a refresh linked come first
        for stale in BACKENDS[backend].written_from(staging, first):
            stale.unlink(missing_ok=True)  # left by an interrupted assembly; rebuilt below
        fresh_bytes = sum(int(m["bytes"]) for m in metas)
        say(f"assembling {len(metas)} shards ({fresh_bytes / 1e6:.1f} MB)", self.quiet)
        expected = fresh_bytes + (int(reuse.manifest.bytes) if reuse is not None else 0)

        def writer(state: Optional[dict[str, Any]]) -> Writer:
            if reuse is None and BACKENDS[backend].concatenated:  # each fragment is a shard: renamed into place
                return _AdoptedShards(staging, fragments, metas)
            return BACKENDS[backend].open_writer(
                staging, None, shard_size, first, expected
            )  # reused records interleave

        sink = RecordSink(staging, found, None, writer, base)
        old_of = reuse.old_of if reuse is not None else np.full(len(found.sources), -1, dtype=np.int64)
        results = ordered_results(
            Path(self.raw), found.sources, old_of, reuse, options.preprocess, 1, _fragment_results(fragments, metas)
        )
        try:
            fill(sink, found, 0, results, options, Path(self.raw), Progress(len(found.sources), 0, quiet=True))
        except BaseException:
            results.close()
            sink.close()
            raise
        results.close()
        shutil.rmtree(fragments)
        return sink


def build_dask(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    options: Optional[BuildOptions] = None,
    *,
    address: str = "local",
    quiet: bool = False,
    retries: int = RETRIES,
    fetch: Optional[Fetch] = None,
    **changes: Any,
) -> BuildReport:
    """Like :func:`packer.builder.pipeline.build`, with tasks of ``shard_size`` files run on a Dask cluster.

    ``address`` is ``"local"`` (a LocalCluster of ``workers`` processes on this machine) or a scheduler
    address such as ``tcp://host:8786``. For memmap, each task's records become one shard, so a shard
    holds up to ``shard_size`` records (with --update, whose reused records are copied: ``shard_size``
    records a shard). raw/ and OUT's parent must be visible to every worker. ``fetch``: as for
    :func:`~packer.builder.pipeline.run_build` (OUT the local copy of a dataset in object storage).
    """
    options = (options or BuildOptions()).but(**changes)
    if address != "local" and options.workers is not None:
        raise BuildError("--workers sets the size of --dask local only; an existing cluster has its own workers")
    with ExitStack() as stack:
        raw = os.path.abspath(raw_dir)  # workers have their own working directory
        engine = DaskEngine(raw, address, quiet, retries, stack)
        return run_build(raw_dir, out, options, quiet, engine, fetch=fetch)
