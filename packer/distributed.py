"""``packer build --dask ADDRESS``: the same build, with preprocessing spread over a Dask cluster.

The sorted input list is cut into fixed slices of ``shard_size`` files (tasks). Each task runs on a
worker, preprocesses its files with :func:`packer.preprocess.process_chunk` exactly as a local build
does, and writes a *fragment* into ``<staging>/fragments/``: ``part-NNNNN.bin`` (records back to
back), ``part-NNNNN.npy`` (their index rows) and, last, ``part-NNNNN.json`` (counts and skipped
files). Every file is written under a unique temporary name and renamed, and the JSON goes last, so a
worker killed mid-task leaves nothing that counts; a retried or duplicated task just rewrites the same
bytes. Only the small JSON metadata travels back to the driver.

The driver then assembles the dataset in shard order: one sequential pass into LMDB, or, for memmap,
each non-empty fragment renamed into a ``shard-NNNNN.bin`` (so a memmap shard holds one task's records).
The digest is computed in that pass over (label, bytes) in record order, so it equals a local build's.
The journal, manifest and final rename are the local pipeline's own (:mod:`packer.pipeline`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import socket
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from . import __version__
from .codec import can_decode_region, codec_name
from .errors import PackerError
from .format import IDENTITY_FIELDS, INDEX_DTYPE, Digest, shard_name
from .labels import Labelling
from .pipeline import (
    PROGRESS,
    BuildError,
    BuildReport,
    _Journal,
    _open_staging,
    _Progress,
    _write_json_atomic,
    complete,
    dataset_path,
    default_backend,
    lock_outputs,
    prepare,
    resume_finished,
    staging_path,
)
from .preprocess import Options, Record, process_chunk
from .scan import Scan
from .write import LmdbWriter, fsync_path, write_atomic

FRAGMENTS = "fragments"
DEFAULT_TASK_SIZE = 1000
CONNECT_TIMEOUT = 10  # seconds; an unreachable scheduler should fail fast, not hang
WORKER_WAIT = 300  # seconds to wait for a first worker (a batch-queued cluster may still be starting)
RETRIES = 2  # re-runs of a task that raised (e.g. a transient NFS error); lost workers are separate


class ShardError(PackerError):
    """A task failed; the message names the shard and the file being processed."""


def fragment_stem(k: int) -> str:
    return f"part-{k:05d}"


# ----------------------------------------------------------------------------------------- worker side


def pack_shard(raw: str, fragments: str, k: int, rels: list[str], opts: Options) -> dict[str, Any]:
    """One task: preprocess ``rels`` (paths under ``raw``) into fragment ``k``; returns its metadata.

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
        meta = {"shard": k, "files": len(rels), "count": count, "bytes": size, "skipped": skipped}
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


def _finished(fragments: Path, k: int, files: int) -> Optional[dict[str, Any]]:
    """Fragment ``k``'s metadata if it is complete and consistent (reusable by --resume), else None."""
    stem = fragments / fragment_stem(k)
    try:
        meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
        ok = (
            meta["files"] == files
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
        raise BuildError("--dask needs Dask distributed: pip install 'packer[dask]'") from None
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
    try:  # a malformed address is refused before a Client exists (a half-made one stalls exit 20 s)
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
            f"a Dask worker could not run packer ({type(e).__name__}: {e}); install packer[dask] on every worker"
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
    found: Scan,
    slices: list[tuple[int, int]],
    todo: list[int],
    opts: Options,
    on_error: str,
    progress: _Progress,
    retries: int,
) -> dict[int, dict[str, Any]]:
    """Run the missing fragments with a bounded window of in-flight tasks (the scheduler holds few paths).

    Returns each new fragment's metadata by shard number.
    """
    from distributed import as_completed

    token = uuid.uuid4().hex[:8]
    rels = {k: [s.rel for s in found.sources[slices[k][0] : slices[k][1]]] for k in todo}
    queue, running = list(reversed(todo)), as_completed()
    shard_of: dict[Any, int] = {}
    metas: dict[int, dict[str, Any]] = {}
    done_shards = len(slices) - len(todo)

    def refill() -> None:
        window = max(4, 2 * sum(client.nthreads().values()))  # follows workers joining or leaving
        while queue and len(shard_of) < window:
            k = queue.pop()
            future = client.submit(
                pack_shard,
                raw,
                str(fragments),
                k,
                rels[k],
                opts,
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
                raise BuildError(_describe_failure(k, rels[k], raw, e)) from None
            if on_error == "fail" and meta["skipped"]:
                (fragments / fragment_stem(k)).with_suffix(".json").unlink()  # --resume redoes this shard
                i, reason = meta["skipped"][0]
                raise BuildError(f"{os.path.join(raw, rels[k][i])}: {reason} (--on-error fail)")
            metas[k] = meta
            done_shards += 1
            progress.update(meta["files"], note=f"shards {done_shards}/{len(slices)}")
            refill()
    finally:
        if shard_of:
            client.cancel(list(shard_of))
    return metas


def _assemble(
    out: Path,
    staging: Path,
    fragments: Path,
    found: Scan,
    settings: dict[str, Any],
    slices: list[tuple[int, int]],
    metas: dict[int, dict[str, Any]],
    quiet: bool,
) -> BuildReport:
    """Fragments -> dataset in shard order: journal rows, digest, LMDB pass or shard renames; finalize."""
    backend = settings["backend"]
    for stale in [*staging.glob("shard-*.bin"), staging / "data.mdb", staging / "lock.mdb"]:
        stale.unlink(missing_ok=True)  # left by an interrupted assembly; rebuilt below
    expected_bytes = sum(int(m["bytes"]) for m in metas.values())
    if not quiet:
        print(f"packer: assembling {len(slices)} shards ({expected_bytes / 1e6:.1f} MB)", file=sys.stderr, flush=True)
    journal = _Journal(staging, None)
    journal.add_scan_report(found)
    writer = (
        LmdbWriter(staging, map_size=max(1 << 30, int(expected_bytes * 1.25) + (64 << 20)))
        if backend == "lmdb"
        else None
    )
    digest = Digest()
    shards: list[dict[str, Any]] = []
    labels = np.array([s.label for s in found.sources], dtype=np.int64)
    skipped = len(found.missing)
    try:
        for k, (start, stop) in enumerate(slices):
            stem, meta = fragments / fragment_stem(k), metas[k]
            rows = np.load(stem.with_suffix(".npy"), allow_pickle=False)
            bad = dict(meta["skipped"])
            for i in sorted(bad):
                journal.add_report(found.sources[start + i].rel, "skipped", bad[i])
            skipped += len(bad)
            members = [start + i for i in range(stop - start) if i not in bad]
            rows["label"] = labels[members]
            for name in IDENTITY_FIELDS:  # what a later local `build --update` compares
                rows[name] = found.identities()[name][members]
            if backend == "memmap" and meta["count"]:
                rows["shard"] = len(shards)
            _add_fragment(
                stem.with_suffix(".bin"), rows, [found.sources[j].rel for j in members], journal, digest, writer
            )
            if backend == "memmap" and meta["count"]:
                name = shard_name(len(shards))
                os.replace(stem.with_suffix(".bin"), staging / name)
                shards.append({"file": name, "count": int(meta["count"]), "bytes": int(meta["bytes"])})
    finally:
        journal.close()
        if writer is not None:
            writer.close()
    shutil.rmtree(fragments)
    total = writer.total_bytes() if writer is not None else sum(int(s["bytes"]) for s in shards)
    return complete(
        staging, out, found, settings, skipped=skipped, total=total, digest=digest, shards=shards, resumed_from=0
    )


def _add_fragment(
    data_file: Path, rows: np.ndarray, rels: list[str], journal: _Journal, digest: Digest, writer: Optional[LmdbWriter]
) -> None:
    """Journal one fragment's rows (source offsets filled in here), hash its records, copy them to LMDB."""
    if len(rows) == 0:
        return
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for row, rel in zip(rows, rels):
            data = m[int(row["offset"]) : int(row["offset"]) + int(row["length"])]
            digest.update(int(row["label"]), data)
            if writer is not None:
                writer.append(data)
                row["offset"] = 0
            encoded = rel.encode("utf-8", "surrogateescape")
            row["src_offset"], row["src_length"] = journal.sources_size(), len(encoded)
            journal.add_record(row, encoded)


def build_dask(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    address: str = "local",
    workers: Optional[int] = None,
    shard_size: int = DEFAULT_TASK_SIZE,
    backend: Optional[str] = None,
    format: str = "jpeg",
    short_edge: int = 320,
    quality: int = 90,
    labels: Optional[str] = None,
    force: bool = False,
    resume: bool = False,
    on_error: Optional[str] = None,
    max_pixels: int = 256_000_000,
    min_size: int = 16,
    max_aspect: float = 10.0,
    quiet: bool = False,
    retries: int = RETRIES,
    wait: bool = False,
    labelling: Optional[Labelling] = None,
) -> BuildReport:
    """Like :func:`packer.pipeline.build`, with tasks of ``shard_size`` files run on a Dask cluster.

    ``address`` is ``"local"`` (a LocalCluster of ``workers`` processes on this machine) or a scheduler
    address such as ``tcp://host:8786``. For memmap, each task's records become one shard, so a shard
    holds up to ``shard_size`` records. raw/ and OUT's parent must be visible to every worker.
    """
    t0 = time.monotonic()
    if address != "local" and workers is not None:
        raise BuildError("--workers sets the size of --dask local only; an existing cluster has its own workers")
    backend = backend or default_backend(out)  # from the name given: a symlink's target may differ
    given, out = Path(out), dataset_path(out)
    with ExitStack() as locks:
        lock_outputs(locks, out, backend, None, wait, quiet)
        report = _build_dask_locked(
            raw_dir,
            out,
            address=address,
            workers=workers,
            shard_size=shard_size,
            backend=backend,
            format=format,
            short_edge=short_edge,
            quality=quality,
            labels=labels,
            force=force,
            resume=resume,
            on_error=on_error,
            max_pixels=max_pixels,
            min_size=min_size,
            max_aspect=max_aspect,
            quiet=quiet,
            retries=retries,
            labelling=labelling,
        )
    report.out = str(given)
    report.seconds = time.monotonic() - t0
    return report


def _build_dask_locked(
    raw_dir: str | os.PathLike,
    out: Path,
    *,
    address: str,
    workers: Optional[int],
    shard_size: int,
    backend: str,
    format: str,
    short_edge: int,
    quality: int,
    labels: Optional[str],
    force: bool,
    resume: bool,
    on_error: Optional[str],
    max_pixels: int,
    min_size: int,
    max_aspect: float,
    quiet: bool,
    retries: int,
    labelling: Optional[Labelling],
) -> BuildReport:
    """:func:`build_dask` once it holds OUT's build lock (``out``: the dataset behind a symlink)."""
    out, opts, found, settings = prepare(
        raw_dir,
        out,
        backend=backend,
        format=format,
        short_edge=short_edge,
        quality=quality,
        shard_size=shard_size,
        labels=labels,
        force=force,
        on_error=on_error,
        max_pixels=max_pixels,
        min_size=min_size,
        max_aspect=max_aspect,
        resume=resume,
        labelling=labelling,
        quiet=quiet,
    )
    on_error = on_error or "skip"
    settings["engine"] = "dask"  # staging layouts differ: a local --resume must not pick this one up
    if resume and not force and (report := resume_finished(out, found, settings, quiet)) is not None:
        return report
    raw = os.path.abspath(raw_dir)  # workers have their own working directory
    staging = staging_path(Path(os.path.abspath(out)))
    fragments = staging / FRAGMENTS
    state = _open_staging(staging, settings, resume)
    if state is None:
        _write_json_atomic(staging / PROGRESS, {"engine": "dask"})  # marks the folder resumable
    fragments.mkdir(exist_ok=True)
    for tmp in fragments.glob(".*.tmp-*"):
        tmp.unlink()  # from attempts killed mid-write
    slices = _slices(len(found.sources), shard_size)
    finished = {k: _finished(fragments, k, stop - start) for k, (start, stop) in enumerate(slices)}
    if on_error == "fail":  # a fragment with skipped files is redone: the files may have been fixed
        finished = {k: m if m is None or not m["skipped"] else None for k, m in finished.items()}
    todo = [k for k, meta in finished.items() if meta is None]
    reused = sum(meta["files"] for meta in finished.values() if meta is not None)
    metas = {k: m for k, m in finished.items() if m is not None}
    progress = _Progress(len(found.sources), reused, quiet)
    try:
        with ExitStack() as stack:
            if todo:
                client = _connect(address, workers or os.cpu_count() or 1, stack)
                _check_workers(client, raw, fragments, found.sources[slices[todo[0]][0]].rel, settings["codec"])
                metas |= _run_tasks(client, raw, fragments, found, slices, todo, opts, on_error, progress, retries)
    finally:
        progress.close()
    report = _assemble(out, staging, fragments, found, settings, slices, metas, quiet)
    report.resumed_from, report.processed = reused, len(found.sources) - reused
    return report
