"""The build engine under both ``packer build`` and ``packer build --dask``: the staging folder and
the record sink.

The staging folder ``.<OUT name>.packer-tmp`` beside OUT holds the writer's data plus a journal (index
rows, source paths, report lines) and ``progress.json``, rewritten atomically at every checkpoint after
the data is durable. A dataset at OUT is therefore complete or absent, and ``--resume`` continues from
the last checkpoint with the same result as an uninterrupted build. What the build decided before
its first record (:class:`Plan`: whether it refreshes OUT, which of OUT's data files it links, where
its own data files start) and the scan identities of its sources are recorded there too, and a
--resume repeats them or refuses (:func:`rewind`): data files a complete dataset links to are only
ever read, and a file changed since the journal holds it is packed again.

Every record reaches the dataset through one :class:`RecordSink`, whichever engine decoded it: the
writer appends its bytes, its index row is filled (the only place that fills a dataset's row), its
source path journalled. A --dask worker also writes rows of INDEX_DTYPE, but into its fragment's own
table (:func:`packer.builder.dask.pack_shard`: where each record lies in that fragment, read back as
Records when the fragments are assembled through this sink); it is staging data a --resume reads,
not an index row. A record a refresh keeps in its old (linked) data file (:class:`packer.builder.update.Kept`, see
packer.builder.segments) enters the same way, its row pointing where it lies. :func:`complete` then writes the
manifest, with the digest of the index's logical content (docs/FORMAT.md, "The digest"), and
:func:`finalize` renames the staging folder into place.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._version import __version__
from ..backends import BACKENDS, Writer
from ..backends.write import fsync_path, write_atomic
from ..codec import codec_name
from ..errors import say
from ..format import (
    IDENTITY_DTYPE,
    IDENTITY_FIELDS,
    INDEX,
    INDEX_DTYPE,
    LABELS,
    MANIFEST,
    REPORT,
    SOURCES,
    TARGETS,
    DatasetError,
    Manifest,
    index_digest,
    json_text,
    logical_digest,
    written_version,
)
from ..format.fields import Field
from ..format.label_arrays import arrays_digest, class_counts
from .options import CHECKPOINT_RECORDS, BuildError, BuildOptions, Resolved
from .preprocess import Record, Result, Skip
from .scan import Scan, Source
from .segments import Base, Fetch, data_table, link_base, old_files
from .update import Changes, Kept, ReusePlan, inputs_digest

BUILD_STATE = "build.json"
PROGRESS = "progress.json"
INDEX_PART = "index.part"
SOURCES_PART = "sources.part"
PLAN = "plan.json"
IDENTITIES = "identities.part"  # the scan identities of the sources, in scan order (IDENTITY_DTYPE)
#: a checkpoint per CHECKPOINT_RECORDS sources, one per line: what a rewind goes back to (one per
#: checkpoint would grow with the build's length times its memmap shards)
CHECKPOINTS = "checkpoints.jsonl"
#: a packer.Writer's journal of every sample given, packed or skipped, in order (SAMPLE_DTYPE): what
#: its resume checks the samples given again against, and the label and identity of each
SAMPLES_PART = "samples.part"
SAMPLE_DTYPE = np.dtype([("label", "<i4"), *((name, IDENTITY_DTYPE[name]) for name in IDENTITY_FIELDS)])
#: what a finished staging folder drops before it becomes the dataset
STAGING_STATE = (BUILD_STATE, PROGRESS, INDEX_PART, SOURCES_PART, PLAN, IDENTITIES, CHECKPOINTS, SAMPLES_PART)


@dataclass(frozen=True)
class OptionNames:
    """How a caller's messages name its options and inputs: the CLI's flags, or the keywords of
    packer.build or packer.Writer."""

    update: str
    resume: str
    force: str
    run: str  #: what the caller runs again ("build", "pack")
    allow_empty: str
    inputs: str  #: what it packs ("files", "samples")


CLI_OPTIONS = OptionNames("--update", "--resume", "--force", "build", "--allow-empty", "files")
#: packer.build's keywords
BUILD_OPTIONS = OptionNames("update=True", "resume=True", "force=True", "build", "allow_empty=True", "files")
WRITER_OPTIONS = OptionNames("update=True", "resume=True", "force=True", "pack", "allow_empty=True", "samples")


@dataclass
class BuildReport:
    """What a build did (``summary()`` is the CLI's last line); with --split, one per dataset inside."""

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
    reused: int = 0  # records of the previous dataset kept (linked) or copied by --update
    up_to_date: bool = False  # --update found nothing to do and left OUT untouched
    splits: dict[str, BuildReport] = field(default_factory=dict)  # --split: one report per dataset
    #: --update: the files added, changed, deleted and retried since the version it replaced (None for
    #: a build that reused nothing); up to date: only the skipped files it tried again, still skipped
    changes: Optional[Changes] = None

    def summary(self) -> str:
        if self.splits:
            return "\n".join(r.summary() for r in self.splits.values())
        if self.up_to_date:
            retried = len(self.changes.retried) if self.changes is not None else 0
            again = f", {retried} skipped file{'s' * (retried != 1)} tried again and still skipped" if retried else ""
            return f"packer: {self.out} is up to date ({self.count} records, {self.digest}{again}); nothing to do"
        rate = self.processed / self.seconds if self.seconds > 0 else 0.0
        return (
            f"packer: {self.out}: packed {self.count} of {self.scanned} scanned "
            f"({self.skipped} skipped, {self.ignored} ignored; see {REPORT}), "
            f"{self.processed} processed, {self.reused} reused, {self.bytes / 1e6:.1f} MB, "
            f"{self.seconds:.1f} s, {rate:.1f} images/s" + (f"; {self.changes}" if self.changes is not None else "")
        )

    @classmethod
    def of(cls, out: Path, manifest: Manifest, **more: Any) -> BuildReport:
        """The report of the dataset ``manifest`` describes, at ``out``."""
        fields = ("count", "scanned", "skipped", "ignored", "bytes", "digest")
        return cls(out=str(out), seconds=0.0, **{name: getattr(manifest, name) for name in fields}, **more)

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


class Journal:
    """Append-only index rows, source paths and report lines (and, for a packer.Writer, ``samples``:
    SAMPLES_PART), truncated back to a checkpoint on resume."""

    def __init__(self, root: Path, state: dict[str, int] | None, samples: bool = False) -> None:
        self.root = root
        names = {"index": INDEX_PART, "sources": SOURCES_PART, "report": REPORT}
        if samples:
            names["samples"] = SAMPLES_PART
        self.files = {}
        for key, name in names.items():
            f = open(root / name, "r+b" if state else "w+b")
            f.truncate(state[key] if state else 0)
            f.seek(0, os.SEEK_END)
            self.files[key] = f

    def add_record(self, row: np.ndarray, rel: bytes) -> None:
        self.files["index"].write(row.tobytes())
        self.files["sources"].write(rel)

    def add_sample(self, row: np.ndarray) -> None:
        """A sample given to a packer.Writer (a row of SAMPLE_DTYPE), packed or skipped."""
        self.files["samples"].write(row.tobytes())

    def add_report(self, rel: str, status: str, reason: str) -> None:
        line = json_text({"path": rel, "status": status, "reason": reason})
        self.files["report"].write(line.encode("utf-8") + b"\n")

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


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode("utf-8")
    write_atomic(path, lambda f: f.write(text))


class Progress:
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
            say(f"{self.done}/{self.total} files{', ' + note if note else ''}, {rate:.1f} images/s, ETA {eta:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def open_staging(
    staging: Path, settings: dict[str, Any], *, resume: bool, names: OptionNames
) -> Optional[dict[str, Any]]:
    """The checkpoint to continue from, or None after (re)creating an empty staging folder
    (``names``: how the refusals name the caller's options)."""
    if resume and (staging / PROGRESS).is_file():
        redo = f"{names.run} again without {names.resume}"
        try:
            previous = json.loads((staging / BUILD_STATE).read_text(encoding="utf-8"))
            progress = json.loads((staging / PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise cannot_resume(f"the journal in {staging} is damaged ({e}); {redo}", names.resume) from None
        if previous != settings:
            raise cannot_resume(
                f"the input or the options changed since the interrupted {names.run} ({staging}); {redo}",
                names.resume,
            )
        return progress
    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
        write_json_atomic(staging / BUILD_STATE, settings)
    except OSError as e:
        raise BuildError(f"cannot write beside the output ({staging}): {e.strerror}") from None
    return None


def cannot_resume(why: str, resume: str) -> BuildError:
    """The one-line refusal of a resume that cannot continue its interrupted build's plan; ``resume``:
    how the caller names that option (OptionNames.resume)."""
    return BuildError(f"cannot {resume}: {why}")


@dataclass(frozen=True)
class Plan:
    """What a build decides before its first record and its --resume must repeat, not decide again
    (``plan.json``): ``of``, the manifest digest of the OUT version whose records a refresh reuses
    (None: the build writes every record itself, --force or a first build); ``base``, the entries
    (packer.builder.segments.Base) of that version's data files linked into the staging folder, and
    ``linked``, their (st_dev, st_ino): files of a complete dataset, which this build only ever reads
    (None for one left in object storage, :attr:`~packer.builder.segments.Base.elsewhere`);
    ``first``, the number of the first data file the build writes itself (always a new file). The
    rest of a refresh's reuse plan follows from OUT's version and the sources' paths and identities,
    which the staging folder also records (IDENTITIES)."""

    of: Optional[str]
    base: list[dict[str, Any]]
    linked: list[Optional[list[int]]]
    first: int

    @classmethod
    def made(cls, staging: Path, of: Optional[str], base: Optional[Base]) -> Plan:
        """The plan of a build that refreshes the version ``of`` (None: writes every record), with
        ``base`` linked into ``staging``."""
        entries = base.entries if base is not None else []
        elsewhere = base.elsewhere if base is not None else frozenset()
        stats = [None if e["file"] in elsewhere else os.stat(staging / str(e["file"])) for e in entries]
        return cls(of, entries, [None if st is None else [st.st_dev, st.st_ino] for st in stats], len(entries))

    def record(self, staging: Path, found: Scan) -> None:
        """Into the staging folder, with the scan identities its journal rows will come from."""
        identities = np.ascontiguousarray(found.identities(), dtype=IDENTITY_DTYPE)
        write_atomic(staging / IDENTITIES, lambda f: f.write(identities.tobytes()))
        self.write(staging)

    def write(self, staging: Path) -> None:
        """Into the staging folder alone (a packer.Writer's, whose samples come later)."""
        write_json_atomic(staging / PLAN, asdict(self))

    @classmethod
    def recorded(cls, staging: Path, names: OptionNames) -> Plan:
        """The plan the interrupted build at ``staging`` recorded (``names``: the caller's options)."""
        try:
            data = json.loads((staging / PLAN).read_text(encoding="utf-8"))
            linked = [None if x is None else list(x) for x in data["linked"]]
            return cls(data["of"], list(data["base"]), linked, int(data["first"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise cannot_resume(
                f"{staging} holds no plan this packer can continue ({e}); {names.run} again without {names.resume}",
                names.resume,
            ) from None

    def check_linked(self, old: Path, names: OptionNames) -> None:
        """Refuse unless the data files linked into the staging folder are still those of ``old``."""
        for entry, linked in zip(self.base, self.linked):
            if linked is None:  # left in object storage: ``of`` names its version
                continue
            dev, ino = linked
            try:
                st = os.stat(old / str(entry["file"]))
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != (dev, ino):
                raise cannot_resume(
                    f"{old} changed since the interrupted refresh linked its {entry['file']}; "
                    f"run the {names.update} again without {names.resume}",
                    names.resume,
                )


def rewind(
    staging: Path, found: Scan, state: dict[str, Any], backend: str, first: int, quiet: bool, names: OptionNames
) -> Optional[dict[str, Any]]:
    """The checkpoint a --resume continues from: ``state``, or the last one before the first source
    the journal holds whose scan identity changed since it was packed (a file re-exported in place:
    it is packed again, and everything after it); None to start from the first source (the build's
    own data files, numbered ``first`` on, are then deleted: its writer creates them anew). The
    recorded identities become the scan's. (The writers refuse to reopen a data file that anything
    else links to: packer.backends.write.open_written.)"""
    if "sources_done" not in state:  # a --dask build: its fragments say what is done (packer.builder.dask)
        return state
    done = int(state["sources_done"])
    current = np.ascontiguousarray(found.identities(), dtype=IDENTITY_DTYPE)
    damaged, redo = f"the journal in {staging} is damaged", f"{names.run} again without {names.resume}"
    try:
        recorded = np.fromfile(staging / IDENTITIES, dtype=IDENTITY_DTYPE)
        lines = (staging / CHECKPOINTS).read_bytes().splitlines()
    except OSError as e:
        raise cannot_resume(f"{damaged} ({e}); {redo}", names.resume) from None
    if len(recorded) != len(current):
        raise cannot_resume(f"{damaged}; {redo}", names.resume)
    history = []  # the checkpoints up to ``state``: not a line torn by a kill, nor one past progress.json
    for line in lines:
        try:
            checkpoint = json.loads(line)
        except ValueError:
            break
        if int(checkpoint["sources_done"]) > done:
            break
        history.append(checkpoint)
    changed = np.flatnonzero(recorded[:done] != current[:done])
    earlier: Optional[dict[str, Any]] = state
    if len(changed):
        at = int(changed[0])
        while history and int(history[-1]["sources_done"]) > at:
            history.pop()
        earlier = history[-1] if history else None
        again = int(earlier["sources_done"]) if earlier else 0
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        say(
            f"{found.sources.paths[at]}{more} changed since it was packed: packing again from file "
            f"{again + 1} of {len(current)}",
            quiet,
        )
        if earlier is None:
            for path in BACKENDS[backend].written_from(staging, first):
                path.unlink(missing_ok=True)
    text = b"".join(json.dumps(c, sort_keys=True).encode() + b"\n" for c in history)
    write_atomic(staging / CHECKPOINTS, lambda f: f.write(text))
    write_atomic(staging / IDENTITIES, lambda f: f.write(current.tobytes()))
    return earlier


class RecordSink:
    """Where each record goes, in scan order, whichever engine decoded it: writer, index row, source
    path, report line. ``state`` (a checkpoint) continues a journal. ``base``: the old data files a
    refresh linked into the staging folder (the writer numbers its own after them). ``samples``: a
    packer.Writer's, which journals every sample (:data:`SAMPLES_PART`)."""

    def __init__(
        self,
        staging: Path,
        found: Scan,
        state: Optional[dict[str, Any]],
        writer: Callable[[Optional[dict[str, Any]]], Writer],
        base: Optional[Base] = None,
        samples: bool = False,
    ) -> None:
        self.staging, self.base = staging, base
        self.journal = Journal(staging, state["journal"] if state else None, samples)
        if state is None:
            self.journal.add_scan_report(found)
        self.writer = writer(state["writer"] if state else None)
        self._history = open(staging / CHECKPOINTS, "ab" if state else "wb")
        self._stretch = int(state["sources_done"]) // CHECKPOINT_RECORDS if state else -1  # of the last one kept
        self.skipped = int(state["skipped"]) if state else len(found.missing)
        self.reused = 0
        self._row = np.zeros((), dtype=INDEX_DTYPE)

    def add(self, source: Source, identity: np.void, record: Record | Kept) -> None:
        """A record decoded by this build, or one a refresh keeps where it lies (no bytes to write)."""
        if isinstance(record, Kept):
            shard, offset, length = record.shard, record.offset, record.length
        else:
            (shard, offset), length = self.writer.append(record.data), len(record.data)
        rel = source.rel.encode("utf-8", "surrogateescape")
        row = self._row
        row["shard"], row["offset"], row["length"] = shard, offset, length
        row["label"], row["height"], row["width"] = source.label, record.height, record.width
        row["crc32"] = record.crc32
        row["src_offset"], row["src_length"] = self.journal.sources_size(), len(rel)
        for name in IDENTITY_FIELDS:  # what a later --update compares
            row[name] = identity[name]
        self.journal.add_record(row, rel)

    def reuse(self, source: Source, identity: np.void, record: Record | Kept) -> None:
        """A record of the dataset being replaced (--update): kept in its linked data file, or copied
        (checked against its old index row)."""
        self.add(source, identity, record)
        self.reused += 1

    def skip(self, rel: str, reason: str) -> None:
        self.journal.add_report(rel, "skipped", reason)
        self.skipped += 1

    def checkpoint(self, sources_done: int, more: Optional[dict[str, Any]] = None) -> None:
        """Make everything so far durable, then say so in progress.json (what --resume continues from),
        with ``more``: what else the engine needs to continue (a packer.Writer's field counts)."""
        progress = {
            "sources_done": sources_done,
            "skipped": self.skipped,
            "writer": self.writer.checkpoint(),
            "journal": self.journal.checkpoint(),
        } | ({"more": more} if more is not None else {})
        if sources_done // CHECKPOINT_RECORDS != self._stretch:
            self._stretch = sources_done // CHECKPOINT_RECORDS
            self._history.write(json.dumps(progress, sort_keys=True).encode() + b"\n")
            self._history.flush()
            os.fsync(self._history.fileno())
        write_json_atomic(self.staging / PROGRESS, progress)

    def close(self) -> list[dict[str, Any]]:
        """Close the writer and journal; the data files the writer wrote (``{file, count, bytes}``)."""
        try:
            return self.writer.close()
        finally:
            self.journal.close()
            self._history.close()


def fill(
    sink: RecordSink,
    found: Scan,
    done: int,
    results: Iterable[tuple[Result | Kept, bool]],
    options: BuildOptions,
    raw: Path,
    progress: Progress,
) -> None:
    """Sources ``done``.. with their results (and whether each was reused) into ``sink`` in scan order,
    with a checkpoint every CHECKPOINT_RECORDS sources or ``checkpoint_seconds``, and at the end.
    ``--on-error fail``: BuildError at the first skip, after a checkpoint (--resume redoes that file)."""
    last = time.monotonic()
    for source, identity, (result, reused) in zip(found.sources[done:], found.identities()[done:], results):
        if isinstance(result, (Record, Kept)):
            (sink.reuse if reused else sink.add)(source, identity, result)
        else:
            assert isinstance(result, Skip)
            if options.on_error == "fail":
                sink.checkpoint(done)
                raise BuildError(f"{raw / source.rel}: {result.reason} (--on-error fail)")
            sink.skip(source.rel, result.reason)
        done += 1
        progress.update()
        if done % CHECKPOINT_RECORDS == 0 or time.monotonic() - last >= options.checkpoint_seconds:
            sink.checkpoint(done)
            last = time.monotonic()
    sink.checkpoint(done)


def _record_labels(found: Scan, rows: np.ndarray, staging: Path) -> dict[str, np.ndarray]:
    """The per-record label arrays (LABELS, TARGETS) the scan has for this dataset's records.

    Records are the packed sources in scan order, so a merge walk over their source paths (the
    journal's) finds each one's source without a lookup table.
    """
    per_source = {name: a for name, a in ((LABELS, found.multi), (TARGETS, found.targets)) if a is not None}
    if not per_source:
        return {}
    blob = (staging / SOURCES_PART).read_bytes()
    at = np.empty(len(rows), dtype=np.int64)
    j = 0
    for k, (o, n) in enumerate(zip(rows["src_offset"].tolist(), rows["src_length"].tolist())):
        while found.sources.paths.encoded(j) != blob[o : o + n]:
            j += 1
        at[k], j = j, j + 1
    return {name: a[at] for name, a in per_source.items()}


def left_as_it_was(out: Path) -> str:
    """What a build or pack that stops before its end leaves at ``out``, in words."""
    return f"{out} is left as it was" if out.exists() else f"nothing written to {out}"


def _nothing_packed(staging: Path, out: Path, candidates: int, names: OptionNames) -> BuildError:
    """Every file was skipped: a broken decoder or environment far more often than a wanted empty
    dataset, so the build fails, naming the first reason, before anything replaces OUT."""
    first = ""
    with open(staging / REPORT, "rb") as f:
        for line in f:
            entry = json.loads(line.decode("utf-8", "surrogateescape"))
            if entry["status"] == "skipped":
                first = f" (the first, {entry['path']}: {entry['reason']})"
                break
    return BuildError(
        f"packed 0 of {candidates} {names.inputs}: every one was skipped{first}, all listed in "
        f"{staging / REPORT}; {left_as_it_was(out)} (pass {names.allow_empty} to write an empty dataset)"
    )


def complete(
    staging: Path,
    out: Path,
    found: Scan,
    options: Resolved,
    sink: RecordSink,
    resumed_from: int,
    fields: Sequence[Field] = (),
    field_counts: Optional[dict[str, dict[str, Any]]] = None,
    names: OptionNames = CLI_OPTIONS,
) -> BuildReport:
    """Close ``sink``, write the manifest from ``options`` and the totals (and the ``fields`` each
    record holds with their ``field_counts``, :mod:`packer.format.fields`), then :func:`finalize`.
    ``names``: how a refusal names the caller's options and inputs."""
    written = sink.close()
    rows = np.fromfile(staging / INDEX_PART, dtype=INDEX_DTYPE)
    if not len(rows) and len(found.sources) and not options.allow_empty:
        raise _nothing_packed(staging, out, len(found.sources), names)
    arrays = _record_labels(found, rows, staging)
    counts = class_counts(found.kind, rows["label"], arrays.get(LABELS), len(found.classes))
    labels_digest = arrays_digest(arrays.get(LABELS), arrays.get(TARGETS))
    shards, total, dead, segments = data_table(staging, rows, sink.base, written)
    manifest = Manifest(
        backend=options.backend,
        format=options.format,
        short_edge=options.short_edge,
        quality=options.quality,
        classes=found.classes,
        count=len(rows),
        class_counts=[int(c) for c in counts],
        bytes=total,
        digest=logical_digest(rows, labels_digest),
        shards=shards,
        scanned=found.scanned,
        skipped=sink.skipped,
        ignored=len(found.ignored),
        options=options.manifest_options(),
        codec=codec_name(),
        packer_version=__version__,
        inputs=inputs_digest(found, options.settings(found)),
        index_digest=index_digest(rows),
        label_kind=found.kind,
        targets=found.target_names,
        labels_digest=labels_digest,
        sources_digest=index_digest(np.fromfile(staging / SOURCES_PART, np.uint8)),
        dead_bytes=dead,
        segments=segments,
        fields=[f.to_json() for f in fields],
        field_counts=field_counts or {},
        format_version=written_version([f.to_json() for f in fields]),
    )
    finalize(staging, out, manifest, arrays)
    return BuildReport.of(out, manifest, resumed_from=resumed_from, reused=sink.reused)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _npy_from(part: Path, npy: Path, dtype: np.dtype) -> None:
    """The journal file ``part`` (an array's bytes) as the .npy ``np.save`` would write, copied in
    blocks rather than loaded whole."""
    count = part.stat().st_size // dtype.itemsize
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    with open(npy, "wb") as f, open(part, "rb") as src:
        np.lib.format.write_array_header_1_0(f, header)
        shutil.copyfileobj(src, f, 1 << 20)


def finalize(staging: Path, out: Path, manifest: Manifest, arrays: dict[str, np.ndarray]) -> None:
    """Journal -> .npy (and the label ``arrays``), manifest last, everything fsynced, then one rename
    makes OUT appear whole. A manifest that readers would refuse (over their size limit) fails the
    build first, OUT and the journal untouched."""
    try:
        text = manifest.encode(staging / MANIFEST)
    except DatasetError as e:
        raise BuildError(f"{out} cannot be written: readers would refuse its manifest ({e})") from None
    _npy_from(staging / INDEX_PART, staging / INDEX, INDEX_DTYPE)
    _npy_from(staging / SOURCES_PART, staging / SOURCES, np.dtype(np.uint8))
    for name, a in arrays.items():
        np.save(staging / name, a, allow_pickle=False)
    for name in STAGING_STATE:
        (staging / name).unlink(missing_ok=True)  # packer compact writes only BUILD_STATE
    for tmp in staging.glob(".*.tmp-*"):
        tmp.unlink()  # a write_atomic that a kill -9 cut short: not part of the dataset
    (staging / MANIFEST).write_bytes(text)
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


def continue_plan(
    out: Path,
    staging: Path,
    reuse: Optional[ReusePlan],
    quiet: bool,
    fetch: Optional[Fetch],
    names: OptionNames,
) -> Plan:
    """The :class:`~packer.builder.staging.Plan` the interrupted build at ``staging`` recorded, its old
    data files linked again (not a new plan: the journal's rows point into the data files it chose),
    or BuildError where this command cannot continue it: a refresh resumed as a build that writes
    every record, or the other way round, or a refresh of an OUT replaced since. ``names``: how the
    errors name the options (the caller's: CLI flags or packer.Writer's keywords)."""
    n = names
    recorded = Plan.recorded(staging, n)
    if recorded.of is not None and reuse is None:
        raise cannot_resume(
            f"the interrupted {n.run} refreshed {out} ({n.update}), reusing its records; "
            f"resume it with {n.update} {n.resume}, or {n.run} again without {n.resume}",
            n.resume,
        )
    if recorded.of is None and reuse is not None:
        raise cannot_resume(
            f"the interrupted {n.run} of {out} wrote every record itself ({n.force} or a first {n.run}); "
            f"resume it without {n.update}, or run the {n.update} again without {n.resume}",
            n.resume,
        )
    if reuse is not None:
        if recorded.of != reuse.manifest.computed_digest:
            raise cannot_resume(
                f"{out} changed since the interrupted refresh; run the {n.update} again without {n.resume}",
                n.resume,
            )
        recorded.check_linked(out, n)
        if recorded.base:
            reuse.base = link_base(out, staging, recorded.base, quiet, remote=fetch is not None)
            if reuse.base is None:
                raise cannot_resume(
                    f"the data files of {out} cannot be linked again; {n.run} again without {n.resume}", n.resume
                )
        fetch_copied(out, reuse, fetch)
    return recorded


def fetch_copied(out: Path, reuse: ReusePlan, fetch: Optional[Fetch]) -> None:
    """The old data files whose records the refresh copies (those after the linked ones), fetched into
    ``out`` from object storage where they are not there."""
    linked = len(reuse.base.files) if reuse.base is not None else 0
    names = [str(f["file"]) for f in old_files(reuse.manifest, reuse.index)[linked:]]
    missing = [name for name in names if not os.path.lexists(out / name)]
    if fetch is not None and missing and reuse.old_of.max(initial=-1) >= 0:
        fetch(out, missing)
