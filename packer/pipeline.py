"""``packer build``: scan -> preprocess (worker processes) -> write, into a staging folder renamed at the end.

The staging folder ``.<OUT name>.packer-tmp`` beside OUT holds the writer's data plus a journal (index
rows, source paths, report lines) and ``progress.json``, rewritten atomically at every checkpoint after
the data is durable. A dataset at OUT is therefore complete or absent, and ``--resume`` continues from
the last checkpoint with the same result as an uninterrupted build.

When OUT is a symlink, the dataset behind it is built: staging, lock and the final swap all sit beside
the link's target (on its disk), and the link is kept. One build per OUT at a time: see
:func:`build_lock`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import lmdb
import numpy as np

from . import __version__
from .codec import codec_name
from .errors import PackerError
from .format import (
    BACKENDS,
    FORMATS,
    IDENTITY_FIELDS,
    INDEX,
    INDEX_DTYPE,
    LABELS,
    MANIFEST,
    REPORT,
    SOURCES,
    TARGETS,
    Digest,
    Manifest,
    index_digest,
)
from .labels import LabelError, Labelling, arrays_digest, class_counts
from .preprocess import Options, Record, Skip
from .read import close_lmdb
from .scan import Scan, ScanError, confusable, identify, scan
from .split import TRAIN, check_splits, split_path, split_scan
from .update import Cache, inputs_digest, ordered_results, previous_dataset, reuse_plan
from .walk import walk
from .write import fsync_path, open_writer, write_atomic

BUILD_STATE = "build.json"
PROGRESS = "progress.json"
INDEX_PART = "index.part"
SOURCES_PART = "sources.part"
# A checkpoint (fsync of data and journal, then progress.json) happens every CHECKPOINT_RECORDS
# records or every ``checkpoint_seconds`` (build keyword), whichever comes first: the count bounds the
# work lost in a fast build, the clock makes even a small or slow build resumable after a few seconds.
CHECKPOINT_RECORDS = 2000
CHECKPOINT_SECONDS = 2.0


class BuildError(PackerError):
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
    processed: int = 0  # sources decoded by this run (skipped ones included)
    reused: int = 0  # records copied from the previous dataset by --update
    up_to_date: bool = False  # --update found nothing to do and left OUT untouched
    splits: dict[str, BuildReport] = field(default_factory=dict)  # --split: one report per dataset

    def summary(self) -> str:
        if self.splits:
            return "\n".join(r.summary() for r in self.splits.values())
        if self.up_to_date:
            return f"packer: {self.out} is up to date ({self.count} records, {self.digest}); nothing to do"
        rate = self.processed / self.seconds if self.seconds > 0 else 0.0
        return (
            f"packer: {self.out}: packed {self.count} of {self.scanned} scanned "
            f"({self.skipped} skipped, {self.ignored} ignored; see {REPORT}), "
            f"{self.processed} processed, {self.reused} reused, {self.bytes / 1e6:.1f} MB, "
            f"{self.seconds:.1f} s, {rate:.1f} images/s"
        )

    @classmethod
    def combine(cls, out: str, splits: dict[str, BuildReport]) -> BuildReport:
        """The totals over the split datasets of one build (digest empty: there is one per split)."""
        total = {
            name: sum(getattr(r, name) for r in splits.values())
            for name in (
                "count",
                "scanned",
                "skipped",
                "ignored",
                "bytes",
                "seconds",
                "resumed_from",
                "processed",
                "reused",
            )
        }
        return cls(out=out, digest="", up_to_date=all(r.up_to_date for r in splits.values()), splits=splits, **total)


def staging_path(out: Path) -> Path:
    return out.parent / f".{out.name}.packer-tmp"


def old_path(out: Path) -> Path:
    """Where the replaced dataset waits for deletion where the filesystem cannot swap two paths."""
    return out.parent / f".{out.name}.packer-old"


def lock_path(out: Path) -> Path:
    """Beside OUT, never inside it: OUT itself is swapped whole at the end of a build."""
    return out.parent / f".{out.name}.packer-lock"


def dataset_path(out: str | os.PathLike) -> Path:
    """OUT, or the dataset a symlink at OUT points to: a refresh replaces that one and keeps the link."""
    out = Path(out)
    return Path(os.path.realpath(out)) if out.is_symlink() else out


_HELD: set[str] = set()  # lock files this process holds: POSIX locks do not exclude their own process
_HELD_GUARD = threading.Lock()


def _lock_holder(fd: int) -> str:
    """The pid the holder wrote into the lock file (it writes it just after locking: wait a moment)."""
    for _ in range(50):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.02)
    return "unknown"


def _acquire(path: Path, out: Path, wait: bool, quiet: bool) -> Optional[int]:
    """The locked file descriptor of ``path``; None (after a warning) where the filesystem has no locks."""
    announced = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BuildError(f"cannot write beside the output ({path}): {e.strerror or e}") from None
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    print(
                        f"packer: warning: cannot lock {path} ({e.strerror}); nothing stops a second build "
                        f"of {out} meanwhile",
                        file=sys.stderr,
                        flush=True,
                    )
                    os.close(fd)
                    return None
                if not wait:
                    raise BuildError(f"{out} is being built by pid {_lock_holder(fd)}") from None
                if not announced and not quiet:
                    print(
                        f"packer: waiting for pid {_lock_holder(fd)}, which is building {out}",
                        file=sys.stderr,
                        flush=True,
                    )
                announced = True
                fcntl.lockf(fd, fcntl.LOCK_EX)  # Ctrl-C and SIGTERM interrupt the wait
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a file its last holder removed
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def build_lock(out: Path, wait: bool = False, quiet: bool = False) -> Iterator[None]:
    """Hold OUT's build lock for the block: one build (or clean) per OUT at a time.

    A POSIX record lock (``lockf``) on :func:`lock_path`: the kernel drops it when the holder exits,
    however it exits (kill -9 included), and forked worker processes do not inherit it, so no stale
    lock survives a build. Another holder: BuildError "OUT is being built by pid N", or with ``wait``
    block until it is done. The holder removes the file on release while still holding it; a waiter
    that then gets the lock on the removed file notices (another inode at the path) and starts over.
    """
    path = lock_path(out)
    key = os.path.abspath(path)
    with _HELD_GUARD:
        if key in _HELD:
            raise BuildError(f"{out} is being built by pid {os.getpid()} (this process)")
        _HELD.add(key)
    fd = None
    try:
        fd = _acquire(path, out, wait, quiet)
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(key)


def _check_split_names(split: dict[str, float]) -> None:
    try:
        check_splits(split)
    except ValueError as e:
        raise BuildError(str(e)) from None


def lock_outputs(
    stack: contextlib.ExitStack, out: Path, backend: str, split: Optional[dict[str, float]], wait: bool, quiet: bool
) -> None:
    """Take the build locks of OUT and, with --split, of each split dataset inside it, onto ``stack``."""
    if split:
        _check_split_names(split)  # before their names become lock files
    for target in [out, *(split_path(out, name, backend) for name in (TRAIN, *split))] if split else [out]:
        stack.enter_context(build_lock(target, wait, quiet))


def _made_by_packer(path: Path, sibling: bool) -> bool:
    """A dataset (manifest), a build's staging folder (its settings, or empty: ``sibling`` only), or a
    --split folder holding nothing but those."""
    if path.is_symlink() or not path.is_dir():
        return False
    if (path / MANIFEST).is_file() or (path / BUILD_STATE).is_file():
        return True
    entries = list(path.iterdir())
    if not entries:
        return sibling
    return all(
        _made_by_packer(e, e.name.startswith(".") and e.name.endswith((".packer-tmp", ".packer-old")))
        or (e.name.startswith(".") and e.name.endswith(".packer-lock") and e.is_file())
        for e in entries
    )


def clean(out: str | os.PathLike) -> list[Path]:
    """Delete the dataset at OUT, its interrupted build and its replaced copy (``.NAME.packer-tmp``,
    ``.NAME.packer-old``), and nothing else; returns what was deleted. Behind a symlink, the dataset
    the link points to goes, then the link. Refuses (BuildError) anything that is not packer's, and
    an OUT that a build holds."""
    given, out = Path(out), dataset_path(out)
    if not out.parent.is_dir():  # nothing there to delete (and no folder to make for a lock file)
        if given.is_symlink():
            given.unlink()
            return [given]
        return []
    with build_lock(out):
        doomed = [path for path in (out, staging_path(out), old_path(out)) if path.exists() or path.is_symlink()]
        for path in doomed:
            if not _made_by_packer(path, sibling=path != out):
                raise BuildError(f"{path} is not a packer dataset or build folder; refusing to delete it")
        for path in doomed:
            shutil.rmtree(path)
        if given.is_symlink():
            given.unlink()
            doomed.append(given)
    return doomed


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

    def add_scan_report(self, found: Scan) -> None:
        """What the scan already knows: ignored files, and --labels rows with no file behind them."""
        for rel, reason in found.ignored:
            self.add_report(rel, "ignored", reason)
        for rel, reason in found.missing:
            self.add_report(rel, "skipped", reason)

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
    text = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode("utf-8")
    write_atomic(path, lambda f: f.write(text))


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
            print(
                f"packer: {self.done}/{self.total} files{', ' + note if note else ''}, {rate:.1f} images/s, "
                f"ETA {eta:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _replay_digest(staging: Path, backend: str, index: np.ndarray) -> Digest:
    """Recompute the running digest over already-written records when resuming (a sequential walk)."""
    digest = Digest()
    labels = index["label"].tolist()
    for i, data, _ in walk(staging, backend, index) if len(index) else ():
        if data is None:
            raise BuildError(
                f"cannot --resume: record {i} of the journal is missing from {staging}; build again without --resume"
            )
        digest.update(labels[i], data)
    return digest


def build(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    backend: Optional[str] = None,
    format: str = "jpeg",
    short_edge: int = 320,
    quality: int = 90,
    workers: Optional[int] = None,
    shard_size: int = 10_000,
    labels: Optional[str] = None,
    force: bool = False,
    resume: bool = False,
    on_error: Optional[str] = None,
    max_pixels: int = 256_000_000,
    min_size: int = 16,
    max_aspect: float = 10.0,
    quiet: bool = False,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
    update: bool = False,
    checksum: bool = False,
    split: Optional[dict[str, float]] = None,
    split_seed: int = 0,
    wait: bool = False,
    labelling: Optional[Labelling] = None,
) -> BuildReport:
    """Pack ``raw_dir`` into ``out``; see ``packer build --help`` for the options.

    ``labelling``: a fixed class list, unlabeled images, several labels per image, numeric targets
    (:class:`packer.labels.Labelling`; default: one class per image, from folders or ``labels``).

    ``update``: refresh the dataset at ``out`` (or build it), copying the records of unchanged files
    (same path, size and mtime; with ``checksum`` same size and content hash) instead of decoding them.
    ``split`` ({"val": 0.05, ...}): ``out`` becomes a folder with one dataset per split plus ``train``.
    ``on_error``: "skip" bad files, or "fail" at the first; None (the default) skips bad files but fails
    on a folder under raw/ that cannot be read. ``wait``: if another build holds OUT, wait for it
    instead of failing.
    """
    t0 = time.monotonic()
    backend = backend or default_backend(out)  # from the name given: a symlink's target may differ
    given, out = Path(out), dataset_path(out)
    with contextlib.ExitStack() as locks:
        lock_outputs(locks, out, backend, split, wait, quiet)
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
            update=update,
            resume=resume,
            checksum=checksum,
            split=split,
            labelling=labelling,
            quiet=quiet,
        )
        job = _Job(
            raw=Path(raw_dir),
            opts=opts,
            workers=workers or os.cpu_count() or 1,
            on_error=on_error or "skip",
            quiet=quiet,
            checkpoint_seconds=checkpoint_seconds,
            resume=resume,
            update=update,
            keep_current=update or (resume and not force),
        )
        if not split:
            report = _build_dataset(out, found, settings, job)
        else:
            out.mkdir(parents=True, exist_ok=True)
            reports = {
                name: _build_dataset(
                    split_path(out, name, settings["backend"]), part, settings | {"inputs": part.fingerprint()}, job
                )
                for name, part in split_scan(found, split, split_seed).items()
            }
            report = BuildReport.combine(str(out), reports)
    report.out = str(given)
    report.seconds = time.monotonic() - t0
    return report


@dataclass(frozen=True)
class _Job:
    """What every dataset of one build shares (a --split build makes several)."""

    raw: Path
    opts: Options
    workers: int
    on_error: str
    quiet: bool
    checkpoint_seconds: float
    resume: bool
    update: bool  # reuse the records of unchanged files from the dataset being replaced
    keep_current: bool  # leave a dataset alone whose recorded inputs and settings equal this build's


def _build_dataset(out: Path, found: Scan, settings: dict[str, Any], job: _Job) -> BuildReport:
    """One dataset at ``out`` from ``found``: kept when up to date, else staged (reusing records with
    --update), then renamed into place."""
    t0 = time.monotonic()
    previous = previous_dataset(out, job.quiet) if job.keep_current else None
    if previous is not None and previous[0].inputs == inputs_digest(found, settings):
        return _up_to_date(out, previous[0])
    if job.keep_current and not job.update and out.exists():  # --resume of a build that already finished
        raise _built_otherwise(out)
    if previous is not None:
        _warn_class_changes(out, previous[0].classes, found.classes, job.quiet)
    cache = reuse_plan(out, previous, found, settings, job.quiet) if job.update and previous else None
    staging = staging_path(out)
    state = _open_staging(staging, settings, job.resume)
    try:
        report = _run(out, staging, found, settings, job, state, cache)
    except (lmdb.Error, OSError) as e:  # LMDB reports a full disk as a bare "Input/output error"
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        raise BuildError(
            f"cannot write {staging}: {e} (disk full? the work so far is kept there: "
            f"free some space, then run the same build with --resume)"
        ) from e
    finally:
        if cache is not None:
            close_lmdb(out)  # our handle on the old OUT: it is being replaced
    report.seconds = time.monotonic() - t0
    return report


def _up_to_date(out: Path, manifest: Manifest) -> BuildReport:
    """The report of a build that finds OUT already built from the same inputs and options."""
    return BuildReport(
        out=str(out),
        count=manifest.count,
        scanned=manifest.scanned,
        skipped=manifest.skipped,
        ignored=manifest.ignored,
        bytes=manifest.bytes,
        digest=manifest.digest,
        seconds=0.0,
        up_to_date=True,
    )


def _built_otherwise(out: Path) -> BuildError:
    return BuildError(
        f"{out} is a complete dataset built from other input or options than this --resume "
        f"(use --update to refresh it, or --force to replace it)"
    )


def resume_finished(out: Path, found: Scan, settings: dict[str, Any], quiet: bool) -> Optional[BuildReport]:
    """--resume on an OUT that exists: its up-to-date report when it holds what this build would write
    (a retried job succeeds), None when there is no dataset at OUT, else BuildError."""
    if not out.exists():
        return None
    previous = previous_dataset(out, quiet)
    if previous is None or previous[0].inputs != inputs_digest(found, settings):
        raise _built_otherwise(out)
    return _up_to_date(out, previous[0])


def _warn_class_changes(out: Path, old: list[str], new: list[str], quiet: bool) -> None:
    """A refresh that renumbers classes says so (a class folder deleted or added shifts the ids after it)."""
    moved = [f"{name!r} {i} -> {new.index(name)}" for i, name in enumerate(old) if name in new and new.index(name) != i]
    if moved and not quiet:
        gone = [name for name in old if name not in new]
        print(
            f"packer: warning: class ids change from those of {out}"
            + (f" (gone: {', '.join(map(repr, gone))})" if gone else "")
            + f": {', '.join(moved[:5])}"
            + (f" and {len(moved) - 5} more" if len(moved) > 5 else ""),
            file=sys.stderr,
            flush=True,
        )


def prepare(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    backend: Optional[str],
    format: str,
    short_edge: int,
    quality: int,
    shard_size: int,
    labels: Optional[str],
    force: bool,
    on_error: Optional[str],
    max_pixels: int,
    min_size: int,
    max_aspect: float,
    update: bool = False,
    resume: bool = False,
    checksum: bool = False,
    split: Optional[dict[str, float]] = None,
    labelling: Optional[Labelling] = None,
    quiet: bool = False,
) -> tuple[Path, Options, Scan, dict[str, Any]]:
    """Validate the options and scan raw/; shared with the Dask build so both refuse the same inputs.

    Returns OUT, the preprocessing options, the scan (with each source's identity), and the settings
    that ``--resume`` must match.
    """
    out = Path(out)
    backend = backend or default_backend(out)
    if backend not in BACKENDS:
        raise BuildError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if format not in FORMATS:
        raise BuildError(f"--format must be one of {', '.join(FORMATS)}, not {format!r}")
    if not (1 <= quality <= 100) or short_edge < 1 or shard_size < 1 or min_size < 1 or max_aspect < 1:
        raise BuildError("--quality must be 1..100; --short-edge, --shard-size, --min-size, --max-aspect >= 1")
    if on_error not in (None, "skip", "fail"):
        raise BuildError(f"--on-error must be skip or fail, not {on_error!r}")
    if split:
        _check_split_names(split)
        if (out / MANIFEST).is_file():
            raise BuildError(
                f"{out} is a dataset; --split writes a folder of datasets "
                f"({split_path(out, TRAIN, backend)}, ...): choose another OUT"
            )
    for target in [split_path(out, name, backend) for name in (TRAIN, *split)] if split else [out]:
        if target.exists() and not (force or update or resume):
            raise BuildError(f"{target} already exists (use --force to replace it, or --update to refresh it)")
        if target.exists() and not force and not (target / MANIFEST).is_file():
            raise BuildError(
                f"{target} exists and is not a packer dataset; --update and --resume only "
                f"replace a dataset (use --force to replace it anyway)"
            )
    opts = Options(
        format=format,
        short_edge=short_edge,
        quality=quality,
        max_pixels=max_pixels,
        min_size=min_size,
        max_aspect=max_aspect,
    )
    labelling = labelling or Labelling()
    try:
        found = scan(raw_dir, labels, labelling, strict=on_error == "fail")
    except (ScanError, LabelError) as e:
        raise BuildError(str(e)) from None
    if found.unreadable and on_error != "skip":
        rel, reason = found.unreadable[0]
        more = f" (and {len(found.unreadable) - 1} more)" if len(found.unreadable) > 1 else ""
        raise BuildError(
            f"{Path(raw_dir) / rel}: {reason}{more}; its files cannot be packed (pass "
            f"--on-error skip to build without them)"
        )
    for a, b in confusable(found.classes):
        if not quiet:
            print(
                f"packer: warning: class names {a!r} and {b!r} differ only in Unicode normalization or "
                f"case: they are two classes",
                file=sys.stderr,
                flush=True,
            )
    for note in found.notes if not quiet else ():
        print(f"packer: {note}", file=sys.stderr, flush=True)
    if not found.sources:
        hint = "" if labels or labelling.unlabeled else "; for a flat folder of unlabeled images use --unlabeled"
        raise BuildError(f"{raw_dir}: no images found (expected class folders with images inside{hint})")
    found.identity = identify(raw_dir, found.sources, checksum)
    settings = {
        "options": asdict(opts),
        "backend": backend,
        "shard_size": shard_size,
        "inputs": found.fingerprint(),
        "codec": codec_name(),
        "checksum": checksum,
        "labels": labelling.settings(),
    }
    return out, opts, found, settings


def _open_staging(staging: Path, settings: dict[str, Any], resume: bool) -> Optional[dict[str, Any]]:
    """The checkpoint to continue from, or None after (re)creating an empty staging folder."""
    if resume and (staging / PROGRESS).is_file():
        try:
            previous = json.loads((staging / BUILD_STATE).read_text(encoding="utf-8"))
            progress = json.loads((staging / PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BuildError(
                f"cannot --resume: the journal in {staging} is damaged ({e}); build again without --resume"
            ) from None
        if previous != settings:
            raise BuildError(
                f"cannot --resume: raw/ or the options changed since the interrupted build "
                f"({staging}); build again without --resume"
            )
        return progress
    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
        _write_json_atomic(staging / BUILD_STATE, settings)
    except OSError as e:
        raise BuildError(f"cannot write beside the output ({staging}): {e.strerror}") from None
    return None


def _run(
    out: Path,
    staging: Path,
    found: Scan,
    settings: dict[str, Any],
    job: _Job,
    state: Optional[dict[str, Any]],
    cache: Optional[Cache],
) -> BuildReport:
    raw, backend, on_error = job.raw, settings["backend"], job.on_error
    done = int(state["sources_done"]) if state else 0
    journal = _Journal(staging, state["journal"] if state else None)
    if state is None:
        journal.add_scan_report(found)
    written = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    digest = _replay_digest(staging, backend, written)  # first: py-lmdb opens a path once per process
    writer = open_writer(backend, staging, state["writer"] if state else None, settings["shard_size"])
    count, skipped = len(written), int(state["skipped"]) if state else len(found.missing)
    del written

    last_checkpoint = time.monotonic()

    def checkpoint() -> None:
        nonlocal last_checkpoint
        progress = {
            "sources_done": done,
            "skipped": skipped,
            "writer": writer.checkpoint(),
            "journal": journal.checkpoint(),
        }
        _write_json_atomic(staging / PROGRESS, progress)
        last_checkpoint = time.monotonic()

    todo = found.sources[done:]
    progress = _Progress(len(found.sources), done, job.quiet)
    row = np.zeros((), dtype=INDEX_DTYPE)
    old_of = cache.old_of[done:] if cache is not None else np.full(len(todo), -1, dtype=np.int64)
    results = ordered_results(raw, todo, old_of, cache, job.opts, job.workers)
    reused = 0
    try:
        for source, identity, (result, was_reused) in zip(todo, found.identities()[done:], results):
            reused += was_reused
            if isinstance(result, Record):
                shard, offset = writer.append(result.data)
                rel = source.rel.encode("utf-8", "surrogateescape")
                row["shard"], row["offset"], row["length"] = shard, offset, len(result.data)
                row["label"], row["height"], row["width"] = source.label, result.height, result.width
                row["crc32"] = result.crc32
                row["src_offset"], row["src_length"] = journal.sources_size(), len(rel)
                for name in IDENTITY_FIELDS:
                    row[name] = identity[name]
                journal.add_record(row, rel)
                digest.update(source.label, result.data)
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
            if done % CHECKPOINT_RECORDS == 0 or time.monotonic() - last_checkpoint >= job.checkpoint_seconds:
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
    total = writer.total_bytes()
    if cache is not None:
        close_lmdb(out)  # before the rename replaces the old dataset under our handle
    report = complete(
        staging,
        out,
        found,
        settings,
        skipped=skipped,
        total=total,
        digest=digest,
        shards=shards,
        resumed_from=int(state["sources_done"]) if state else 0,
    )
    report.processed, report.reused = len(todo) - reused, reused
    return report


def _record_labels(found: Scan, rows: np.ndarray, blob: np.ndarray) -> dict[str, np.ndarray]:
    """The per-record label arrays (LABELS, TARGETS) the scan has for this dataset's records.

    Records are the packed sources in scan order, so a merge walk over their source paths (the
    journal's) finds each one's source without a lookup table.
    """
    per_source = {name: a for name, a in ((LABELS, found.multi), (TARGETS, found.targets)) if a is not None}
    if not per_source:
        return {}
    at = np.empty(len(rows), dtype=np.int64)
    j = 0
    for k, (o, n) in enumerate(zip(rows["src_offset"].tolist(), rows["src_length"].tolist())):
        rel = bytes(blob[o : o + n]).decode("utf-8", "surrogateescape")
        while found.sources[j].rel != rel:
            j += 1
        at[k], j = j, j + 1
    return {name: a[at] for name, a in per_source.items()}


def complete(
    staging: Path,
    out: Path,
    found: Scan,
    settings: dict[str, Any],
    *,
    skipped: int,
    total: int,
    digest: Digest,
    shards: list[dict[str, Any]],
    resumed_from: int,
) -> BuildReport:
    """Manifest from the settings and totals, then :func:`_finalize`; shared with the Dask build."""
    opts = settings["options"]
    rows = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    blob = np.fromfile(staging / SOURCES_PART, dtype=np.uint8)
    arrays = _record_labels(found, rows, blob)
    counts = class_counts(found.kind, rows["label"], arrays.get(LABELS), len(found.classes))
    labels_digest = arrays_digest(arrays.get(LABELS), arrays.get(TARGETS))
    manifest = Manifest(
        backend=settings["backend"],
        format=opts["format"],
        short_edge=opts["short_edge"],
        quality=opts["quality"],
        classes=found.classes,
        count=len(rows),
        class_counts=[int(c) for c in counts],
        bytes=total,
        digest=digest.hexdigest(labels_digest),
        shards=shards,
        scanned=found.scanned,
        skipped=skipped,
        ignored=len(found.ignored),
        options=opts | {"shard_size": settings["shard_size"], "checksum": settings["checksum"]},
        codec=settings["codec"],
        packer_version=__version__,
        inputs=inputs_digest(found, settings),
        index_digest=index_digest(rows),
        label_kind=found.kind,
        targets=found.target_names,
        labels_digest=labels_digest,
        sources_digest=index_digest(blob),
    )
    _finalize(staging, out, manifest, arrays)
    return BuildReport(
        out=str(out),
        count=manifest.count,
        scanned=manifest.scanned,
        skipped=skipped,
        ignored=manifest.ignored,
        bytes=total,
        digest=manifest.digest,
        seconds=0.0,
        resumed_from=resumed_from,
    )


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _finalize(staging: Path, out: Path, manifest: Manifest, arrays: dict[str, np.ndarray]) -> None:
    """Journal -> .npy (and the label ``arrays``), manifest last, everything fsynced, then one rename
    makes OUT appear whole."""
    index = np.lib.format.open_memmap(staging / INDEX, mode="w+", dtype=INDEX_DTYPE, shape=(manifest.count,))
    index[:] = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    index.flush()
    del index
    np.save(staging / SOURCES, np.fromfile(staging / SOURCES_PART, dtype=np.uint8), allow_pickle=False)
    for name, a in arrays.items():
        np.save(staging / name, a, allow_pickle=False)
    for name in (BUILD_STATE, PROGRESS, INDEX_PART, SOURCES_PART):
        (staging / name).unlink()
    (staging / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    for p in staging.iterdir():
        fsync_path(p)
    fsync_path(staging)
    if out.exists() and _exchange(staging, out):  # OUT is the old dataset, then the new one: never absent
        shutil.rmtree(staging)
    elif out.exists():  # no atomic exchange here: a crash between these two renames leaves OUT absent
        trash = old_path(out)
        if trash.exists():
            shutil.rmtree(trash)
        out.rename(trash)
        staging.rename(out)
        shutil.rmtree(trash)
    else:
        staging.rename(out)
    fsync_path(out.parent)
