"""``packer build``: scan -> preprocess (worker processes) -> write, into a staging folder renamed at the end.

The staging folder ``.<OUT name>.packer-tmp`` beside OUT holds the writer's data plus a journal (index
rows, source paths, report lines) and ``progress.json``, rewritten atomically at every checkpoint after
the data is durable. A dataset at OUT is therefore complete or absent, and ``--resume`` continues from
the last checkpoint with the same result as an uninterrupted build.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import lmdb
import numpy as np

from . import __version__
from .codec import codec_name
from .format import (
    BACKENDS, FORMATS, INDEX, INDEX_DTYPE, MANIFEST, REPORT, SOURCES, Digest, Manifest, lmdb_key,
    shard_name,
)
from .preprocess import Options, Record, Result, Skip, process_chunk
from .scan import Scan, ScanError, scan
from .write import fsync_path, open_writer

BUILD_STATE = "build.json"
PROGRESS = "progress.json"
INDEX_PART = "index.part"
SOURCES_PART = "sources.part"
# A checkpoint (fsync of data and journal, then progress.json) happens every CHECKPOINT_RECORDS
# records or every ``checkpoint_seconds`` (build keyword), whichever comes first: the count bounds the
# work lost in a fast build, the clock makes even a small or slow build resumable after a few seconds.
CHECKPOINT_RECORDS = 2000
CHECKPOINT_SECONDS = 2.0


class BuildError(Exception):
    """An expected failure (bad arguments, existing OUT, unusable raw/); the CLI prints it in one line."""


@dataclass
class BuildReport:
    out: str
    count: int
    scanned: int
    skipped: int
    ignored: int
    bytes: int
    digest: str
    seconds: float
    resumed_from: int = 0

    def summary(self) -> str:
        rate = self.count / self.seconds if self.seconds > 0 else 0.0
        return (f"packer: {self.out}: packed {self.count} of {self.scanned} scanned "
                f"({self.skipped} skipped, {self.ignored} ignored; see {REPORT}), "
                f"{self.bytes / 1e6:.1f} MB, {self.seconds:.1f} s, {rate:.1f} images/s")


def staging_path(out: Path) -> Path:
    return out.parent / f".{out.name}.packer-tmp"


def default_backend(out: str | os.PathLike) -> str:
    return "lmdb" if str(out).rstrip("/").endswith(".lmdb") else "memmap"


class _Journal:
    """Append-only index rows, source paths and report lines, truncated back to a checkpoint on resume."""

    def __init__(self, root: Path, state: dict[str, int] | None) -> None:
        self.root = root
        names = {"index": INDEX_PART, "sources": SOURCES_PART, "report": REPORT}
        self.files = {}
        for key, name in names.items():
            f = open(root / name, "r+b" if state else "w+b")
            f.truncate(state[key] if state else 0)
            f.seek(0, os.SEEK_END)
            self.files[key] = f

    def add_record(self, row: np.ndarray, rel: bytes) -> None:
        self.files["index"].write(row.tobytes())
        self.files["sources"].write(rel)

    def add_report(self, rel: str, status: str, reason: str) -> None:
        line = json.dumps({"path": rel, "status": status, "reason": reason}, ensure_ascii=False)
        self.files["report"].write(line.encode("utf-8", "surrogateescape") + b"\n")

    def sources_size(self) -> int:
        return self.files["sources"].tell()

    def checkpoint(self) -> dict[str, int]:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        return {key: f.tell() for key, f in self.files.items()}

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it terminates us


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


def _results(paths: list[str], opts: Options, workers: int, chunk: int) -> Iterator[Result]:
    """Preprocess ``paths`` in order with a bounded window of in-flight chunks (flat memory)."""
    if workers <= 1:
        for i in range(0, len(paths), chunk):
            yield from process_chunk(paths[i:i + chunk], opts)
        return
    pool = _worker_context().Pool(workers, initializer=_ignore_sigint)
    try:
        pending: deque = deque()
        for i in range(0, len(paths), chunk):
            pending.append(pool.apply_async(process_chunk, (paths[i:i + chunk], opts)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


class _Progress:
    """tqdm on a terminal; otherwise a quiet line every 10 s (logs and CI stay readable)."""

    def __init__(self, total: int, initial: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total, initial, quiet
        self.start = self.last = time.monotonic()
        self.start_done = initial
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="img", dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int = 1, note: str = "") -> None:
        """``note`` (e.g. shards done, for a Dask build) is shown beside the file count."""
        self.done += n
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if not self.quiet and now - self.last >= 10:
            self.last = now
            rate = (self.done - self.start_done) / (now - self.start)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"packer: {self.done}/{self.total} files{', ' + note if note else ''}, {rate:.1f} images/s, "
                  f"ETA {eta:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _replay_digest(staging: Path, backend: str, index: np.ndarray) -> Digest:
    """Recompute the running digest over already-written records when resuming."""
    digest = Digest()
    if len(index) == 0:
        return digest
    if backend == "lmdb":
        import lmdb

        env = lmdb.open(str(staging), readonly=True, lock=False, subdir=True)
        with env.begin(buffers=True) as txn:
            for i, row in enumerate(index):
                digest.update(int(row["label"]), txn.get(lmdb_key(i)))
        env.close()
        return digest
    shards = {}
    for i, row in enumerate(index):
        k = int(row["shard"])
        if k not in shards:
            shards = {k: np.fromfile(staging / shard_name(k), dtype=np.uint8)}
        start = int(row["offset"])
        digest.update(int(row["label"]), memoryview(shards[k][start:start + int(row["length"])]))
    return digest


def build(raw_dir: str | os.PathLike, out: str | os.PathLike, *, backend: Optional[str] = None,
          format: str = "jpeg", short_edge: int = 320, quality: int = 90,
          workers: Optional[int] = None, shard_size: int = 10_000, labels: Optional[str] = None,
          force: bool = False, resume: bool = False, on_error: str = "skip",
          max_pixels: int = 256_000_000, min_size: int = 16, max_aspect: float = 10.0,
          quiet: bool = False, checkpoint_seconds: float = CHECKPOINT_SECONDS) -> BuildReport:
    """Pack ``raw_dir`` into ``out``; see ``packer build --help`` for the options."""
    t0 = time.monotonic()
    out, opts, found, settings = prepare(
        raw_dir, out, backend=backend, format=format, short_edge=short_edge, quality=quality,
        shard_size=shard_size, labels=labels, force=force, on_error=on_error, max_pixels=max_pixels,
        min_size=min_size, max_aspect=max_aspect)
    backend = settings["backend"]
    workers = workers or os.cpu_count() or 1
    staging = staging_path(out)
    state = _open_staging(staging, settings, resume)
    try:
        report = _run(Path(raw_dir), out, staging, found, opts, backend, shard_size, workers, state,
                      settings, on_error, quiet, checkpoint_seconds)
    except (lmdb.Error, OSError) as e:  # LMDB reports a full disk as a bare "Input/output error"
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        raise BuildError(f"cannot write {staging}: {e} (disk full? the work so far is kept there: "
                         f"free some space, then run the same build with --resume)") from e
    report.seconds = time.monotonic() - t0
    return report


def prepare(raw_dir: str | os.PathLike, out: str | os.PathLike, *, backend: Optional[str], format: str,
            short_edge: int, quality: int, shard_size: int, labels: Optional[str], force: bool,
            on_error: str, max_pixels: int, min_size: int, max_aspect: float,
            ) -> tuple[Path, Options, Scan, dict[str, Any]]:
    """Validate the options and scan raw/; shared with the Dask build so both refuse the same inputs.

    Returns OUT, the preprocessing options, the scan, and the settings that ``--resume`` must match.
    """
    out = Path(out)
    backend = backend or default_backend(out)
    if backend not in BACKENDS:
        raise BuildError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if format not in FORMATS:
        raise BuildError(f"--format must be one of {', '.join(FORMATS)}, not {format!r}")
    if not (1 <= quality <= 100) or short_edge < 1 or shard_size < 1 or min_size < 1 or max_aspect < 1:
        raise BuildError("--quality must be 1..100; --short-edge, --shard-size, --min-size, --max-aspect >= 1")
    if on_error not in ("skip", "fail"):
        raise BuildError(f"--on-error must be skip or fail, not {on_error!r}")
    if out.exists() and not force:
        raise BuildError(f"{out} already exists (use --force to replace it)")
    opts = Options(format=format, short_edge=short_edge, quality=quality, max_pixels=max_pixels,
                   min_size=min_size, max_aspect=max_aspect)
    try:
        found = scan(raw_dir, labels)
    except ScanError as e:
        raise BuildError(str(e)) from None
    if not found.sources:
        raise BuildError(f"{raw_dir}: no images found (expected class folders with images inside)")
    settings = {"options": asdict(opts), "backend": backend, "shard_size": shard_size,
                "inputs": found.fingerprint(), "codec": codec_name()}
    return out, opts, found, settings


def _open_staging(staging: Path, settings: dict[str, Any], resume: bool) -> Optional[dict[str, Any]]:
    """The checkpoint to continue from, or None after (re)creating an empty staging folder."""
    if resume and (staging / PROGRESS).is_file():
        try:
            previous = json.loads((staging / BUILD_STATE).read_text(encoding="utf-8"))
            progress = json.loads((staging / PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BuildError(f"cannot --resume: the journal in {staging} is damaged ({e}); "
                             f"build again without --resume") from None
        if previous != settings:
            raise BuildError(f"cannot --resume: raw/ or the options changed since the interrupted build "
                             f"({staging}); build again without --resume")
        return progress
    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
        _write_json_atomic(staging / BUILD_STATE, settings)
    except OSError as e:
        raise BuildError(f"cannot write beside the output ({staging}): {e.strerror}") from None
    return None


def _run(raw: Path, out: Path, staging: Path, found: Scan, opts: Options, backend: str,
         shard_size: int, workers: int, state: Optional[dict[str, Any]], settings: dict[str, Any],
         on_error: str, quiet: bool, checkpoint_seconds: float) -> BuildReport:
    done = int(state["sources_done"]) if state else 0
    journal = _Journal(staging, state["journal"] if state else None)
    if state is None:
        for rel, reason in found.ignored:
            journal.add_report(rel, "ignored", reason)
        for rel, reason in found.missing:
            journal.add_report(rel, "skipped", reason)
    written = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    digest = _replay_digest(staging, backend, written)  # first: py-lmdb opens a path once per process
    writer = open_writer(backend, staging, state["writer"] if state else None, shard_size)
    count, skipped = len(written), int(state["skipped"]) if state else len(found.missing)
    class_counts = np.bincount(written["label"], minlength=len(found.classes)).astype(np.int64)
    del written

    last_checkpoint = time.monotonic()

    def checkpoint() -> None:
        nonlocal last_checkpoint
        progress = {"sources_done": done, "skipped": skipped, "writer": writer.checkpoint(),
                    "journal": journal.checkpoint()}
        _write_json_atomic(staging / PROGRESS, progress)
        last_checkpoint = time.monotonic()

    todo = found.sources[done:]
    progress = _Progress(len(found.sources), done, quiet)
    row = np.zeros((), dtype=INDEX_DTYPE)
    results = _results([str(raw / s.rel) for s in todo], opts, workers, chunk=8)
    try:
        for source, result in zip(todo, results):
            if isinstance(result, Record):
                shard, offset = writer.append(result.data)
                rel = source.rel.encode("utf-8", "surrogateescape")
                row["shard"], row["offset"], row["length"] = shard, offset, len(result.data)
                row["label"], row["height"], row["width"] = source.label, result.height, result.width
                row["crc32"] = zlib.crc32(result.data)
                row["src_offset"], row["src_length"] = journal.sources_size(), len(rel)
                journal.add_record(row, rel)
                digest.update(source.label, result.data)
                class_counts[source.label] += 1
                count += 1
            else:
                assert isinstance(result, Skip)
                if on_error == "fail":
                    checkpoint()
                    raise BuildError(f"{raw / source.rel}: {result.reason} (--on-error fail)")
                journal.add_report(source.rel, "skipped", result.reason)
                skipped += 1
            done += 1
            progress.update()
            if done % CHECKPOINT_RECORDS == 0 or time.monotonic() - last_checkpoint >= checkpoint_seconds:
                checkpoint()
        checkpoint()
    except BaseException:
        results.close()  # stop the worker pool now, not whenever the traceback is freed
        progress.close()
        journal.close()
        writer.close()
        raise
    progress.close()
    shards = writer.close()
    journal.close()
    total = writer.total_bytes() if backend == "lmdb" else sum(int(s["bytes"]) for s in shards)
    return complete(staging, out, found, settings, class_counts=class_counts, skipped=skipped,
                    total=total, digest=digest, shards=shards,
                    resumed_from=int(state["sources_done"]) if state else 0)


def complete(staging: Path, out: Path, found: Scan, settings: dict[str, Any], *, class_counts: np.ndarray,
             skipped: int, total: int, digest: Digest, shards: list[dict[str, Any]],
             resumed_from: int) -> BuildReport:
    """Manifest from the settings and totals, then :func:`_finalize`; shared with the Dask build."""
    opts = settings["options"]
    manifest = Manifest(
        backend=settings["backend"], format=opts["format"], short_edge=opts["short_edge"],
        quality=opts["quality"], classes=found.classes, count=int(class_counts.sum()),
        class_counts=[int(c) for c in class_counts], bytes=total, digest=digest.hexdigest(),
        shards=shards, scanned=found.scanned, skipped=skipped, ignored=len(found.ignored),
        options=opts | {"shard_size": settings["shard_size"]}, codec=settings["codec"],
        packer_version=__version__,
    )
    _finalize(staging, out, manifest)
    return BuildReport(out=str(out), count=manifest.count, scanned=manifest.scanned, skipped=skipped,
                       ignored=manifest.ignored, bytes=total, digest=manifest.digest, seconds=0.0,
                       resumed_from=resumed_from)


def _finalize(staging: Path, out: Path, manifest: Manifest) -> None:
    """Journal -> .npy, manifest last, everything fsynced, then one rename makes OUT appear whole."""
    index = np.lib.format.open_memmap(staging / INDEX, mode="w+", dtype=INDEX_DTYPE, shape=(manifest.count,))
    index[:] = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    index.flush()
    del index
    np.save(staging / SOURCES, np.fromfile(staging / SOURCES_PART, dtype=np.uint8), allow_pickle=False)
    for name in (BUILD_STATE, PROGRESS, INDEX_PART, SOURCES_PART):
        (staging / name).unlink()
    (staging / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    for p in staging.iterdir():
        fsync_path(p)
    fsync_path(staging)
    if out.exists():  # --force: the old dataset stays whole until the new one is ready
        trash = out.parent / f".{out.name}.packer-old"
        if trash.exists():
            shutil.rmtree(trash)
        out.rename(trash)
        staging.rename(out)
        shutil.rmtree(trash)
    else:
        staging.rename(out)
    fsync_path(out.parent)
