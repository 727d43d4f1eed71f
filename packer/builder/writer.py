"""``packer.Writer`` and ``packer.pack``: a dataset from code (an iterator, a torch Dataset, a list of
arrays) rather than a folder, with fields beside each image (packer.format.fields).

It is the build's machinery fed one sample at a time: the same OUT checks and build lock, the same
staging folder renamed into place at the end (:func:`packer.builder.staging.complete`: OUT is complete
or absent), the same record sink and journal, the same preprocessing of the image (EXIF orientation,
RGB, short edge, JPEG or raw: packer.builder.preprocess), with boxes and masks scaled as the image is.
A sample that cannot be packed is a reported skip naming it (``report.jsonl``), and counts add up.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import mmap
import os
import shutil
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

import numpy as np
from PIL import Image

from ..backends import BACKENDS, close_all
from ..codec import codec_name
from ..errors import BuildError, local_path, say
from ..format import IDENTITY_DTYPE, IDENTITY_FIELDS, MANIFEST, Manifest
from ..format.fields import (
    Field,
    box_array,
    declare,
    encode_fields,
    join_record,
    mask_pixels,
    nearest,
    record_fields,
    split_record,
)
from ..format.records import FORMATS
from .options import CHECKPOINT_RECORDS, SHARD_SIZE, BuildOptions, Resolved
from .paths import check_target, dataset_path, lock_outputs
from .preprocess import PreprocessSpec, Record, Skip, describe, load_bytes, load_image
from .scan import Paths, PathsBuilder, Scan, Source, Sources, open_source
from .segments import Base, Fetch, link_base, old_files, plan
from .shared import Blocks, attach, detach
from .staging import (
    PLAN,
    PROGRESS,
    SAMPLE_DTYPE,
    SAMPLES_PART,
    WRITER_OPTIONS,
    BuildReport,
    OptionNames,
    Plan,
    RecordSink,
    cannot_resume,
    complete,
    continue_plan,
    left_as_it_was,
    open_staging,
    staging_path,
)
from .update import (
    Changes,
    Kept,
    OldRecords,
    PathIndex,
    ReusePlan,
    old_paths,
    previous_dataset,
    skipped_before,
    stale_reason,
)
from .workers import ordered

#: BuildOptions of a folder build, which a Writer has no use for: they walk a folder, split it, compare
#: its files, or renumber its folder-named classes (a Writer's label ids are the caller's).
FOLDER_ONLY = ("labels", "split", "split_seed", "checksum", "coco", "on_class_change")
#: What a sample dict holds besides its fields: ``skip``, a reason found before it came (a converter's
#: own check), reports it skipped instead of packing it (no image needed).
SAMPLE_KEYS = ("image", "source", "skip")


class Writer:
    """Writes a dataset at ``out`` one sample at a time: ``with packer.Writer(out, fields=...) as w:
    w.write({"image": ..., "boxes": ..., ...})``; ``w.report`` once it closes.

    ``fields``: what each sample holds beside its image, by name (``{"label": "label", "boxes":
    "boxes", "box_labels": "box_labels", "mask": "mask", "caption": "text", "emb": ("array",
    "float32")}``; docs/FIELDS.md; default: none). A sample's ``image`` is a path, encoded bytes, a
    Pillow image, or pixels (a numpy array or torch tensor: :func:`_pixels`); ``source`` (optional)
    names it in ``ds.source(i)`` and the report
    (default: the path, else ``sample-N``). Boxes (x0, y0, x1, y1) and masks are given in the
    pixels of the upright source image and scaled with it. ``classes``: the names of the label ids
    (default "0", "1", ... up to the largest). ``options`` and keywords: :class:`BuildOptions`
    (``backend``, ``format``, ``short_edge``, ``quality``, ``force``, ``on_error``, ``resume``,
    ``update``, ``allow_empty``, ...). Leaving the ``with`` block by an exception writes nothing (OUT
    stays as it was; with ``resume`` the work so far is kept for the next run to continue); Ctrl-C's
    KeyboardInterrupt then says so. No samples, or every one skipped, is refused the same way
    unless ``allow_empty=True`` (as a folder build refuses them). ``names``: how messages name the
    options (the CLI's --coco build passes its flags).

    ``resume``: continue the interrupted pack of the same samples and options (its samples are
    checked against those given again, by content, not packed again). ``update``: refresh OUT,
    keyed by each sample's ``source``: a sample whose source and content OUT already holds keeps its
    record (not encoded again), the others are packed, samples OUT holds that are not given are
    dropped. Both need a digest of every sample's inputs, which a pack without them skips (its
    speed): a later update of such a dataset packs every sample once more."""

    #: OUT is the local copy of a dataset in object storage (packer.tools.publish): a refresh fetches
    #: the old data files it copies records from, and keeps those not on this disk where they are
    _fetch: Optional[Fetch] = None

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        fields: Any = None,
        options: Optional[BuildOptions] = None,
        classes: Optional[Sequence[str]] = None,
        quiet: bool = True,
        names: OptionNames = WRITER_OPTIONS,
        **changes: Any,
    ) -> None:
        self.options = (options or BuildOptions()).but(**changes)
        self._names = names
        given = [name for name in FOLDER_ONLY if getattr(self.options, name) not in (None, False)]
        if given or self.options.labelling != type(self.options.labelling)():
            raise BuildError(
                f"packer.Writer does not take {', '.join(given) or 'labelling'} (options of a folder build)"
            )
        try:
            self.fields = declare(fields if fields is not None else {})
        except ValueError as e:
            raise BuildError(f"packer.Writer: {e}") from None
        self._labelled = any(f.kind == "label" for f in self.fields)
        self._in_record = record_fields(self.fields)
        #: per record field: records with a value, items, and (boxes) records per number of boxes
        self._counts: dict[str, dict[str, Any]] = {
            f.name: {"records": 0, "items": 0, **({"per_record": {}} if f.kind == "boxes" else {})}
            for f in self._in_record
        }
        self.classes = list(classes) if classes is not None else None
        if self.classes is not None and not self._labelled:
            raise BuildError("packer.Writer: classes= needs a label field")
        local_path(out)
        self._given, self.out = Path(out), dataset_path(out)
        self._resolved = self.options.resolved(out, SHARD_SIZE)
        self._spec = self._resolved.preprocess
        self._paths = PathsBuilder()
        self._written = 0  # samples given so far (packed, kept or skipped)
        self._named = 0  # samples named so far (handed to workers, perhaps not yet accepted)
        self._quiet = quiet
        self.report: Optional[BuildReport] = None
        self._started = self._last = time.monotonic()  # _last: the last checkpoint
        self._locks = contextlib.ExitStack()
        self._staging = staging_path(self.out)
        self._keep_staging = self.options.resume  # an exception keeps the work for the next run
        self._identified = self.options.resume or self.options.update  # samples' digests are taken
        self._resumed: Optional[np.ndarray] = None  # the interrupted pack's samples (SAMPLE_DTYPE)
        self._refresh: Optional[Refresh] = None
        try:
            lock_outputs(self._locks, self.out, self._resolved, quiet)
            check_target(self.out, replaces=self.options.force, keeps=self.options.update or self.options.resume)
            if self.options.update and not self.options.force:
                self._refresh = Refresh.of(self.out, self._resolved, self.fields, quiet, self._fetch)
            elif (self.out / MANIFEST).is_file() and not self.options.force:
                if self.options.resume and (self._staging / PLAN).is_file():  # refused if it was a refresh
                    continue_plan(self.out, self._staging, None, quiet, None, names)
                raise self._complete()
            settings = {
                "writer": [f.to_json() for f in self.fields],
                "options": self._resolved.manifest_options(),
                "codec": codec_name(),
                "classes": self.classes,
            }
            state = open_staging(self._staging, settings, resume=self.options.resume, names=names)
            reuse = self._refresh.reuse if self._refresh is not None else None
            if state is None:  # what a resume must repeat: which old data files it links (update)
                if self._refresh is not None:
                    self._refresh.link(self._staging, self._resolved, quiet)
                of = reuse.manifest.computed_digest if reuse is not None else None
                Plan.made(self._staging, of, reuse.base if reuse is not None else None).write(self._staging)
            else:
                continue_plan(self.out, self._staging, reuse, quiet, self._fetch, names)
                if self._refresh is not None:
                    self._refresh.relinked()
            backend, shard_size = BACKENDS[self._resolved.backend], self._resolved.shard_size
            base = self._refresh.base if self._refresh is not None else None
            first = len(base.files) if base is not None else 0
            self._sink = RecordSink(
                self._staging,
                _scan([], []),
                state,
                lambda s: backend.open_writer(self._staging, s, shard_size, first),
                base,
                samples=True,
            )
            if state is not None:
                self._resume(state)
        except BaseException as e:
            self._locks.close()
            if isinstance(e, KeyboardInterrupt):
                self._interrupted(e)
            raise
        classes_count = len(self.classes) if self.classes is not None else None
        # with update, this process takes each sample's digest (to compare it), not the workers
        identified = self._identified and self._refresh is None
        self._job = SampleJob(self._spec, self.fields, self._labelled, classes_count, identified)

    def _complete(self) -> BuildError:
        """Why OUT, a complete dataset, is not written without force=True or update=True: an
        interrupted pack staged beside it continues only when told to replace it, as it was going to
        (a folder build's --resume never replaces a complete dataset either)."""
        n = self._names
        if self.options.resume and (self._staging / PROGRESS).is_file():
            return BuildError(
                f"{self.out} is a complete dataset: the interrupted {n.run} in {self._staging} would replace it; "
                f"resume it with {n.force} (and {n.resume}) to replace it, or {n.update} to refresh it instead"
            )
        return BuildError(
            f"{self.out} is a complete dataset: nothing to resume ({n.update} refreshes it, {n.force} replaces it)"
        )

    def _interrupted(self, e: KeyboardInterrupt) -> None:
        """Ctrl-C (or the CLI's SIGTERM) given its one line: what is left at OUT, and whether a
        resume continues (the CLI prints it after "interrupted;")."""
        n = self._names
        if e.args:  # worded already (a Writer inside another)
            return
        if self._keep_staging:
            then = f"the work so far is kept in {self._staging}: {n.run} again with {n.resume} to continue"
        else:
            then = (
                f"nothing was kept (a {n.run} continues after an interruption only if it had {n.resume} from its start)"
            )
        e.args = (f"{left_as_it_was(self.out)}; {then}",)

    def _resume(self, state: dict[str, Any]) -> None:
        """Continue the interrupted pack whose checkpoint is ``state``: its samples, to check against
        those given again, and its field counts."""
        self._resumed = np.fromfile(self._staging / SAMPLES_PART, SAMPLE_DTYPE)
        if len(self._resumed) != int(state["sources_done"]) or "more" not in state:
            raise cannot_resume(
                f"the journal in {self._staging} is damaged; {self._names.run} again without {self._names.resume}",
                self._names.resume,
            )
        if not state["more"].get("identified"):
            n = self._names
            raise cannot_resume(
                f"the interrupted {n.run} of {self.out} was not made resumable (it took no digest of its "
                f"{n.inputs} to check those given again against: pass {n.resume} from the first run); "
                f"{n.run} again without {n.resume}",
                n.resume,
            )
        for name, tally in state["more"]["field_counts"].items():
            if "per_record" in tally:
                tally["per_record"] = {int(k): n for k, n in tally["per_record"].items()}
            self._counts[name] = tally
        say(f"resuming the pack of {self.out} after its first {len(self._resumed)} samples", self._quiet)

    @classmethod
    def pack(
        cls, samples: Iterable[dict[str, Any]], out: str | os.PathLike, *, fields: Any = None, **options: Any
    ) -> BuildReport:
        """Every sample of ``samples`` into a dataset at ``out``, by a Writer of this class
        (``packer.pack``). Ctrl-C ends it with a KeyboardInterrupt whose one line says what is left
        and whether ``resume=True`` continues, its traceback from here (not from inside the pack)."""
        try:
            with cls(out, fields=fields, **options) as w:
                w.write_all(samples)
        except KeyboardInterrupt as e:
            raise e.with_traceback(None) from None
        assert w.report is not None, "closed on leaving the with block"
        return w.report

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: Optional[type], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if e is None:
            self.close()
        else:
            self.abort()
            if isinstance(e, KeyboardInterrupt):
                self._interrupted(e)

    @property
    def written(self) -> int:
        """Samples given so far (packed, kept or skipped)."""
        return self._written

    def write(self, sample: dict[str, Any]) -> None:
        """Pack one sample, in this process, or report it skipped (``on_error="fail"``: BuildError)
        naming its source."""
        sample = _untensored(sample)
        if self._again(sample):
            return
        source = self._checked(sample)
        identity, kept = self._kept(source, sample)
        if kept is not None:
            self._keep(source, *kept)
        else:
            self._accept(source, encode_chunk([sample], job=self._job)[0], identity)

    def write_all(self, samples: Iterable[dict[str, Any]]) -> None:
        """Pack every sample of ``samples``, in order, decoded by the build's worker processes
        (``workers``; 0 or 1: in this process, as :meth:`write`). A script calling it must do so
        under ``if __name__ == "__main__":``, as for ``packer.build``. A map-style torch Dataset
        (``__len__`` and ``__getitem__``, no ``__iter__``) gives its ``len()`` samples."""
        processes = self.options.processes
        if processes <= 1:
            for sample in _each(samples):
                self.write(sample)
            return
        it = map(_untensored, _each(samples))
        if self._resumed is not None:  # the interrupted pack's samples, checked in this process
            for sample in itertools.islice(it, max(0, len(self._resumed) - self._written)):
                self._again(sample)
        #: the samples handed over, in order: a name (and, with update, its identity) to encode, or a
        #: name and the record kept for it
        pending: deque[tuple[str, Optional[np.void], Optional[Reused]]] = deque()
        blocks = Blocks()  # their arrays, in shared memory until their results are in

        def chunks() -> Iterator[list[dict[str, Any]]]:
            batch: list[dict[str, Any]] = []
            for sample in it:
                source = self._checked(sample)  # in this process: a BuildError stops all
                identity, kept = self._kept(source, sample)
                pending.append((source, identity, kept))
                if kept is None:
                    batch.append(sample)
                    if len(batch) == CHUNK:
                        yield blocks.share(batch)
                        batch = []
            if batch:
                yield blocks.share(batch)

        job = functools.partial(encode_chunk, job=self._job)

        def name(sample: dict[str, Any]) -> str:
            return str(sample.get("source") or "a sample")

        def kept_ones() -> None:
            while pending and pending[0][2] is not None:
                source, _, kept = pending.popleft()
                assert kept is not None
                self._keep(source, *kept)

        try:
            # depth 1: a sample may still carry big bytes or a Pillow image through the pipe
            for result in ordered(chunks(), job, processes, name=name, depth=1):
                kept_ones()
                source, identity, _ = pending.popleft()
                self._accept(source, result, identity)
                blocks.taken()
            kept_ones()
        finally:
            blocks.close()

    def _again(self, sample: Any) -> bool:
        """Whether ``sample`` is one the interrupted pack this one resumes packed already (then
        counted, not packed again); BuildError where it is not the same sample."""
        done = self._resumed
        if done is None or self._written >= len(done):
            return False
        source = self._checked(sample)
        k = self._written
        identity = sample_identity(sample, self.fields)
        known = done[k]["src_size"] != 0  # 0: a sample that crashed its worker, of no known identity
        if known and (identity["src_size"], identity["src_hash"]) != (done[k]["src_size"], done[k]["src_hash"]):
            n = self._names
            raise cannot_resume(
                f"sample {k} ({source}) is not the one the interrupted {n.run} of {self.out} packed there "
                f"(its content differs): give the same {n.inputs} in the same order, or {n.run} again "
                f"without {n.resume}",
                n.resume,
            )
        if self._refresh is not None:
            self._refresh.resumed(source, identity)
        self._paths.add(source)
        self._written += 1
        return True

    def _checked(self, sample: Any) -> str:
        """The name of a sample this Writer can take (BuildError for one it cannot: a dict with an
        image and declared fields only)."""
        if self.report is not None:
            raise BuildError(f"packer.Writer for {self.out} is closed")
        if not isinstance(sample, dict) or not ("image" in sample or isinstance(sample.get("skip"), str)):
            raise BuildError(f"packer.Writer: a sample is a dict with an 'image', not {type(sample).__name__}")
        unknown = set(sample) - set(SAMPLE_KEYS) - {f.name for f in self.fields}
        if unknown:  # a misspelt field would otherwise be dropped from every record
            raise BuildError(f"packer.Writer: sample keys {sorted(unknown)} are not declared fields")
        image, n = sample.get("image"), self._named
        self._named += 1
        named = sample.get("source") or (os.fspath(image) if isinstance(image, (str, os.PathLike)) else None)
        if self._refresh is not None:
            if not named:
                raise BuildError(
                    f"packer.Writer: sample {n} has no 'source' (nor a path as its image): update=True "
                    f"keys samples by their source"
                )
            self._refresh.seen(str(named), n)
        return str(named) if named else f"sample-{n}"

    def _kept(self, source: str, sample: dict[str, Any]) -> tuple[Optional[np.void], Optional[Reused]]:
        """With update: the sample's identity, and the record OUT holds for this same sample, or
        None to pack it; (None, None) without update."""
        if self._refresh is None:
            return None, None
        identity = sample_identity(sample, self.fields)
        return identity, self._refresh.kept(source, identity, len(self._in_record))

    def _keep(self, source: str, label: int, identity: np.void, record: Any, payloads: list[bytes]) -> None:
        self._sink.reuse(Source(source, label), identity, record)
        self._add(source, label, identity, payloads)

    def _accept(
        self, source: str, result: tuple[np.void, Encoded | Skip] | Skip, identity: Optional[np.void] = None
    ) -> None:
        """A sample's result, in order: its record into the sink (with its field counts), or a skip
        (a bare Skip: the sample crashed its worker, and has no identity). ``identity``: the one this
        process took (update), else the worker's."""
        taken, outcome = (np.zeros(1, IDENTITY_DTYPE)[0], result) if isinstance(result, Skip) else result
        identity = identity if identity is not None else taken
        if isinstance(outcome, Skip):
            self.skip(source, outcome.reason, identity)
        else:
            label, record, payloads = outcome
            self._sink.add(Source(source, label), identity, record)
            self._add(source, label, identity, payloads)

    def _add(self, source: str, label: int, identity: np.void, payloads: list[bytes]) -> None:
        """A record added to the dataset: its sample journalled, its fields counted."""
        for f, payload in zip(self._in_record, payloads):
            items = f.of.count(memoryview(payload))
            tally = self._counts[f.name]
            tally["records"] += items > 0
            tally["items"] += items
            if f.kind == "boxes":
                tally["per_record"][items] = tally["per_record"].get(items, 0) + 1
            elif f.kind == "box_labels":  # boxes per category (packer info), keyed as JSON keeps them
                per = tally.setdefault("per_class", {})
                for label_id, n in zip(*np.unique(np.frombuffer(payload, "<i4"), return_counts=True)):
                    per[str(label_id)] = per.get(str(label_id), 0) + int(n)
        self._journal(source, label, identity)

    def _journal(self, source: str, label: int, identity: np.void) -> None:
        row = np.zeros((), SAMPLE_DTYPE)
        row["label"] = label
        for name in IDENTITY_FIELDS:
            row[name] = identity[name]
        self._sink.journal.add_sample(row)
        self._paths.add(source)
        self._written += 1
        if self._written % CHECKPOINT_RECORDS == 0 or time.monotonic() - self._last >= self.options.checkpoint_seconds:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Everything so far made durable (what a resume continues from), with the field counts."""
        self._sink.checkpoint(self._written, {"field_counts": self._field_counts(), "identified": self._identified})
        self._last = time.monotonic()

    def _field_counts(self) -> dict[str, dict[str, Any]]:
        """The field counts as the manifest holds them (JSON: per_record by str)."""
        return {
            name: c
            | ({"per_record": {str(k): n for k, n in sorted(c["per_record"].items())}} if "per_record" in c else {})
            for name, c in self._counts.items()
        }

    def skip(self, source: str, why: str, identity: Optional[np.void] = None) -> None:
        """Report a sample that cannot be packed (``why``) as skipped, counted with the others
        (``on_error="fail"``: BuildError)."""
        if self.options.on_error == "fail":
            raise BuildError(f"sample {self.written} ({source}): {why} (on_error='fail')")
        self._sink.skip(source, why)
        self._journal(source, -1, identity if identity is not None else np.zeros(1, IDENTITY_DTYPE)[0])

    def close(self) -> BuildReport:
        """Finish the dataset: manifest written, staging folder renamed to OUT. Idempotent."""
        if self.report is not None:
            return self.report
        try:
            n = self._names
            if self._resumed is not None and self._written < len(self._resumed):
                raise cannot_resume(
                    f"the interrupted {n.run} of {self.out} had packed {len(self._resumed)} {n.inputs}, this one "
                    f"gave only {self._written}",
                    n.resume,
                )
            if not self._written and not self.options.allow_empty:  # as a folder build refuses no images
                left = left_as_it_was(self.out)
                raise BuildError(f"no {n.inputs} to pack: {left} (pass {n.allow_empty} to write an empty dataset)")
            self._checkpoint()
            rows = np.fromfile(self._staging / SAMPLES_PART, SAMPLE_DTYPE)
            labels = rows["label"]
            classes = self.classes
            if classes is None:
                classes = [str(c) for c in range(int(labels.max(initial=-1)) + 1)] if self._labelled else []
            found = _scan(self._paths.paths(), labels, classes, "class" if self._labelled else "none")
            found.identity = np.ascontiguousarray(rows[list(IDENTITY_FIELDS)]).astype(IDENTITY_DTYPE)
            refresh = self._refresh
            if refresh is not None:
                refresh.close()  # before the new version replaces OUT
            unchanged = refresh is not None and refresh.unchanged(self._written, self._sink, classes, self._resolved)
            if refresh is not None and unchanged and self._resumed is None:  # (a resumed one: written all the same)
                self._sink.close()
                shutil.rmtree(self._staging)
                assert refresh.old is not None
                changes = refresh.changes()
                report = BuildReport.of(
                    self.out, refresh.old[0], up_to_date=True, changes=changes, reused=self._sink.reused
                )
            else:
                counts = self._field_counts()
                report = complete(
                    self._staging, self.out, found, self._resolved, self._sink, 0, self.fields, counts, self._names
                )
                report.changes = refresh.changes() if refresh is not None else None
        except BaseException:
            self.abort()
            raise
        self._locks.close()
        report.resumed_from = len(self._resumed) if self._resumed is not None else 0
        report.processed = self._written - report.resumed_from - report.reused
        report.out = str(self._given)
        report.seconds = time.monotonic() - self._started
        self.report = report
        return report

    def abort(self) -> None:
        """Drop everything written: OUT stays as it was (with ``resume``: the work so far stays in
        the staging folder, for the next run to continue)."""
        with contextlib.suppress(Exception):
            self._sink.close()
        if self._refresh is not None:
            self._refresh.close()
        if not self._keep_staging:
            shutil.rmtree(self._staging, ignore_errors=True)
        self._locks.close()


class Refresh:
    """``update=True``: the dataset at OUT (``old``: its manifest, index and source paths; None when
    there is none, or its records cannot be kept) and what the samples given keep of it. A sample
    keeps its old record when OUT holds one with its source and identity (:func:`sample_identity`),
    left in OUT's data files, which are hard-linked into the staging folder (packer.builder.segments:
    the new records form a new segment), or copied where they are not linked. The samples arrive one
    by one, so which old records stay is known only at the end: every old data file is linked (bar
    :func:`~packer.builder.segments.plan`'s segment limit), and the dead bytes left grow until
    ``packer compact`` rewrites them (a folder build rewrites at MAX_DEAD)."""

    def __init__(self, out: Path, old: Optional[tuple[Manifest, np.ndarray, np.ndarray]], fetch: Optional[Fetch]):
        self.out, self.old, self._fetch = out, old, fetch
        self._seen: dict[str, int] = {}  # source -> sample number: duplicates are an error
        self._matched = np.zeros(len(old[1]) if old else 0, bool)  # old rows a sample's source found
        self._kept: list[int] = []  # old rows kept, in sample order
        self._added: list[str] = []
        self._changed: list[str] = []
        self.base: Optional[Base] = None
        self._finder = PathIndex(old[1], old[2]) if old else None
        self.reuse = ReusePlan(out, old[0], old[1], np.zeros(0, np.int64), _NO_CHANGES) if old else None
        self._records = OldRecords(self.reuse) if self.reuse is not None else None

    @classmethod
    def of(cls, out: Path, options: Resolved, fields: Sequence[Field], quiet: bool, fetch: Optional[Fetch]) -> Refresh:
        """The refresh of OUT by a Writer of ``fields`` with ``options``; where its records cannot be
        kept, it says why (every sample is packed)."""
        old = previous_dataset(out, quiet)
        if old is None:
            return cls(out, None, fetch)
        manifest, index, _ = old
        settings = {"options": asdict(options.preprocess), "codec": codec_name(), "checksum": False}
        why = stale_reason(manifest, settings)
        if manifest.fields != [f.to_json() for f in fields]:
            why = "its fields are not those declared"
        elif not why and len(index) and not index["src_size"].any():
            why = (
                "it holds no digest of its samples (packed without update=True): every sample is packed "
                "this once, and the new version holds them"
            )
        if why:
            say(f"{out}: cannot keep its records ({why}): packing every sample", quiet)
            return cls(out, None, fetch)
        return cls(out, old, fetch)

    def link(self, staging: Path, options: Resolved, quiet: bool) -> None:
        """Link the old data files into ``staging`` (as many as the refresh keeps: every one, bar
        :func:`~packer.builder.segments.plan`'s segment limit), then :meth:`fetch` what is not here."""
        if self.old is None or self.reuse is None:
            return
        manifest, index, _ = self.old
        keep, why = plan(manifest, index, np.arange(len(index)), options.backend, options.shard_size)
        if why:
            say(f"{self.out}: {why}", quiet)
        if keep:
            files = old_files(manifest, index)[:keep]
            self.base = self.reuse.base = link_base(self.out, staging, files, quiet, remote=self._fetch is not None)
        self.fetch()

    def relinked(self) -> None:
        """The old data files linked again by a resume (its recorded plan's), then :meth:`fetch`."""
        if self.reuse is not None:
            self.base = self.reuse.base
            self.fetch()

    def fetch(self) -> None:
        """Every old data file not on this disk (OUT a copy of a version in object storage) brought
        here: those whose records are copied, and those left in the store, whose kept records are
        read to count their fields (a folder build's refresh reads none of them)."""
        if self.old is None or self._fetch is None:
            return
        files = [str(f["file"]) for f in old_files(self.old[0], self.old[1])]
        missing = [name for name in files if not os.path.lexists(self.out / name)]
        if missing:
            self._fetch(self.out, missing)

    def seen(self, source: str, n: int) -> None:
        """Sample ``n`` is keyed ``source``: BuildError when an earlier sample was too."""
        first = self._seen.setdefault(source, n)
        if first != n:
            raise BuildError(
                f"packer.Writer: samples {first} and {n} both have source {source!r}: update=True keys "
                f"samples by their source, which must be unique"
            )

    def _old_row(self, source: str, identity: np.void) -> int:
        """The old row holding this sample (its source, with this identity), or -1 (then it is
        counted as added or changed)."""
        j = int(self._finder.find([source])[0]) if self._finder is not None else -1
        if j < 0 or self.reuse is None:
            self._added.append(source)
            return -1
        self._matched[j] = True
        row = self.reuse.index[j]
        if (int(row["src_size"]), int(row["src_hash"])) != (int(identity["src_size"]), int(identity["src_hash"])):
            self._changed.append(source)
            return -1
        return j

    def kept(self, source: str, identity: np.void, fields: int) -> Optional[Reused]:
        """The old record of this sample when OUT holds it unchanged, else None (it is packed)."""
        j = self._old_row(source, identity)
        if j < 0 or self._records is None or self.reuse is None:
            return None
        record = self._records.record(j)  # read and checked, not decoded: its fields are counted
        if record is None:  # damaged since it was written
            self._changed.append(source)
            return None
        self._kept.append(j)
        # (a dataset without fields, format version 3, has no field table in its records)
        payloads = split_record(memoryview(record.data), fields)[1] if fields else []
        place = self.reuse.kept(np.array([j]))[0]
        label = int(self.reuse.index[j]["label"])
        return label, identity, place if place is not None else record, [bytes(p) for p in payloads]

    def resumed(self, source: str, identity: np.void) -> None:
        """A sample the interrupted refresh that this one resumes did already (for the changes)."""
        j = self._old_row(source, identity)
        if j >= 0:
            self._kept.append(j)

    def unchanged(self, count: int, sink: RecordSink, classes: list[str], options: Resolved) -> bool:
        """Whether the samples given were OUT's, in its order, all kept: OUT is then left as it is."""
        if self.old is None:
            return False
        manifest, index, _ = self.old
        return (
            count == len(index) == len(self._kept)
            and sink.skipped == manifest.skipped == 0
            and self._kept == list(range(len(index)))
            and classes == manifest.classes
            and (manifest.backend, manifest.options.get("shard_size")) == (options.backend, options.shard_size)
        )

    def changes(self) -> Optional[Changes]:
        """What the refresh changed (None where it kept nothing of OUT: a full pack)."""
        if self.old is None:
            return None
        _, index, paths = self.old
        gone = np.flatnonzero(~self._matched)
        skipped = (skipped_before(self.out) or {}) if self.old[0].skipped else {}
        return Changes(
            Paths.of([s for s in self._added if s not in skipped]),
            Paths.of(self._changed),
            Paths.of(old_paths(index[gone], paths, 0, len(gone))),
            Paths.of([s for s in self._added if s in skipped]),
        )

    def close(self) -> None:
        """Let go of OUT's files (before the new version replaces it)."""
        if self._records is not None:
            self._records.close()
        close_all(self.out)


_NO_CHANGES = Changes.only_retried(Paths.of(()))
#: A record kept from the dataset being refreshed: its label, the sample's identity, the record (copied)
#: or where it lies (linked), its field payloads.
Reused = tuple[int, np.void, Record | Kept, list[bytes]]


@dataclass(frozen=True)
class SampleJob:
    """What encoding a sample needs, sent to each worker: the preprocessing, the fields, the number
    of classes where labels are checked against it (None: any id >= 0; no label field: -1), and
    whether each sample's digest is taken (:func:`sample_identity`; resume and update need it)."""

    spec: PreprocessSpec
    fields: tuple[Field, ...]
    labelled: bool
    classes: Optional[int]
    identified: bool = False


#: A packed sample: its label (-1 without a label field), its record and its fields' payloads.
Encoded = tuple[int, Record, list[bytes]]
CHUNK = 4  # samples per task handed to a worker (their arrays in one shared-memory block)


def encode_chunk(samples: list[dict[str, Any]], *, job: SampleJob) -> list[tuple[np.void, Encoded | Skip]]:
    """Each sample's identity (zero unless ``job.identified``) and its record, or a Skip saying what
    is wrong with it (never raising for a sample's fault)."""
    blocks: dict[str, mmap.mmap] = {}  # the shared-memory blocks its arrays lie in (packer.builder.shared)
    try:
        return [_encode(attach(sample, blocks), job) for sample in samples]
    finally:
        detach(blocks)


def _encode(sample: dict[str, Any], job: SampleJob) -> tuple[np.void, Encoded | Skip]:
    identity = sample_identity(sample, job.fields) if job.identified else np.zeros(1, IDENTITY_DTYPE)[0]
    if sample.get("skip") is not None:
        return identity, Skip(str(sample["skip"]))
    try:
        label = _label(sample.get("label"), job.classes) if job.labelled else -1
        return identity, (label, *_record(sample, job))
    except MemoryError:
        return identity, Skip("out of memory while decoding")
    except Exception as e:  # the sample's problem: reported with its name, as a bad file is
        return identity, Skip(describe(e))


def sample_identity(sample: dict[str, Any], fields: Sequence[Field]) -> np.void:
    """What a sample's record depends on, as a row of IDENTITY_DTYPE (what a folder build keeps of a
    file: its size and content hash): ``src_hash``, 64 bits of a SHA-256 over its image (a file's
    bytes, encoded bytes, a Pillow image's mode, size, EXIF orientation and pixels, and where it has
    them its palette and ``info["transparency"]``, what :func:`~packer.builder.preprocess.to_rgb`
    reads besides; an array's dtype, shape and bytes) and its fields' values in declared order;
    ``src_size``, the bytes digested plus one (0 is "not known"). The same sample given again has
    the same identity, in any process; an image without a palette or transparency has the identity
    it had before they were digested (the datasets packed then keep their records on update)."""
    h = hashlib.sha256()
    size = 1

    def feed(tag: str, *parts: Any) -> None:
        nonlocal size
        h.update(tag.encode() + b"\0")
        for part in parts:
            data = part if isinstance(part, (bytes, memoryview)) else str(part).encode("utf-8", "surrogateescape")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
            size += len(data)

    def value(v: Any) -> None:
        if v is None or isinstance(v, (str, bool, int, float, np.generic)):
            feed("scalar", type(v).__name__, repr(v.item() if isinstance(v, np.generic) else v))
            return
        try:
            a = np.ascontiguousarray(v)
        except (ValueError, TypeError):  # ragged: refused when encoded; its text is enough here
            feed("other", repr(v))
            return
        if a.dtype.hasobject:
            feed("other", repr(v))
        else:
            feed("array", a.dtype.str, a.shape, a.data.cast("B") if a.size else b"")

    image = sample.get("image")
    if sample.get("skip") is not None:
        feed("skip", sample["skip"])
    elif isinstance(image, (str, os.PathLike)):
        try:
            with open_source(os.fspath(image)) as file:
                feed("file", file.read())
        except OSError as e:
            feed("unreadable", os.fspath(image), e)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        feed("bytes", memoryview(image).cast("B"))
    elif isinstance(image, Image.Image):
        feed("pil", image.mode, image.size, image.getexif().get(0x0112, 1), image.tobytes())
        if image.palette is not None and (palette := image.getpalette(None)) is not None:  # "P", "PA": indices
            feed("palette", image.palette.mode, bytes(palette))
        if "transparency" in image.info:  # a colour key or the palette's alpha: to_rgb composites it
            feed("transparency", repr(image.info["transparency"]))
    else:
        value(image)
    for f in fields:
        feed("field", f.name)
        value(sample.get(f.name))
    identity = np.zeros(1, IDENTITY_DTYPE)[0]
    identity["src_size"], identity["src_hash"] = size, int.from_bytes(h.digest()[:8], "little")
    return identity


def _label(value: Any, classes: Optional[int]) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"label {value!r} is not a class id (an int >= 0)")
    if classes is not None and value >= classes:
        raise ValueError(f"label {value} is beyond the {classes} classes")
    return int(value)


def _record(sample: dict[str, Any], job: SampleJob) -> tuple[Record, list[bytes]]:
    """The sample's record: the image preprocessed as a build's, its fields scaled to it."""
    image, spec = sample["image"], job.spec
    if isinstance(image, (str, os.PathLike)):
        with open_source(os.fspath(image)) as file:
            im, (w0, h0) = load_bytes(file.read(), spec)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        im, (w0, h0) = load_bytes(bytes(image), spec)
    else:
        im, (w0, h0) = load_image(_pixels(image), spec)
    rgb = np.ascontiguousarray(np.asarray(im, dtype=np.uint8))
    h, w = rgb.shape[:2]
    values = {f.name: sample.get(f.name) for f in job.fields}
    for f in job.fields:
        v = values[f.name]
        if f.kind == "boxes" and v is not None:
            values[f.name] = box_array(v, f.name) * np.array([w / w0, h / h0, w / w0, h / h0])
        elif f.kind == "mask" and v is not None:
            mask = mask_pixels(v, f.name)
            if mask.shape != (h0, w0):
                raise ValueError(f"{f.name}: shape {mask.shape}, the image is {h0} x {w0} (upright)")
            values[f.name] = nearest(mask, (0, 0, h0, w0), (h, w)) if (h, w) != (h0, w0) else mask
    payloads = encode_fields(job.fields, values, height=h, width=w)
    data = join_record(FORMATS[spec.format].encode(rgb, quality=spec.quality), payloads)
    return Record(data, h, w, zlib.crc32(data)), payloads


#: the Pillow mode of pixels with 1, 2 or 4 channels (3: RGB, kept as an array)
_MODES = {1: "L", 2: "LA", 4: "RGBA"}
_CHANNELS = (1, 2, 3, 4)


def _pixels(image: Any) -> Image.Image | np.ndarray:
    """A decoded image as :func:`~packer.builder.preprocess.load_image` takes it: a Pillow image,
    or H x W x 3 uint8 pixels. An array (a torch tensor arrives as one: :func:`_untensored`) is
    H x W (grey), H x W x C or C x H x W (C = 1 grey, 2 grey and alpha, 3 RGB, 4 RGBA): channels
    last when its last axis has 1 to 4 entries, else first when its first has (a 3 x 3 x 3 array
    is channels-last). uint8 values are taken as they are; floats must lie in 0..1 (what
    torchvision's ToTensor gives) and become round(x * 255). Grey and alpha go through the folder
    build's conversion (:func:`~packer.builder.preprocess.to_rgb`: alpha over white). ValueError
    for anything else, saying what to pass."""
    if isinstance(image, Image.Image):
        return image
    if not isinstance(image, np.ndarray):
        raise ValueError(f"image: a path, bytes, a PIL image, a numpy array or a torch tensor, not {_kind(image)}")
    a = image[:, :, None] if image.ndim == 2 else image
    if a.ndim == 3 and a.shape[2] not in _CHANNELS and a.shape[0] in _CHANNELS:
        a = a.transpose(1, 2, 0)
    if a.ndim != 3 or a.shape[2] not in _CHANNELS:
        raise ValueError(
            f"image: {_kind(image)} is not H x W, H x W x C or C x H x W pixels with C 1, 2, 3 or 4 channels"
        )
    if a.dtype.kind == "f":
        a = _from_unit(a, image)
    elif a.dtype != np.uint8:
        raise ValueError(f"image: {_kind(image)}: give uint8 pixels (0..255), or floats in 0..1")
    if a.shape[2] == 3:
        return np.ascontiguousarray(a)
    return Image.fromarray(np.ascontiguousarray(a[:, :, 0] if a.shape[2] == 1 else a), _MODES[a.shape[2]])


def _from_unit(a: np.ndarray, image: np.ndarray) -> np.ndarray:
    """Float pixels in 0..1 as uint8, round(x * 255) (exact for ToTensor's k / 255); ValueError
    for values outside 0..1 (0..255 floats, normalized ones: their scale is not known here)."""
    x = a if a.dtype.itemsize >= 4 else a.astype(np.float32)
    lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
    if not (lo >= 0.0 and hi <= 1.0):  # NaN fails too
        raise ValueError(
            f"image: {_kind(image)} with values {lo:g}..{hi:g}: float pixels must lie in 0..1 "
            f"(a normalized or 0..255 image: give its uint8 pixels)"
        )
    return np.rint(x * 255).astype(np.uint8)


def _untensored(sample: Any) -> Any:
    """``sample`` with each torch tensor in it as the numpy array of its values (from any device,
    with grad or not), as :func:`_pixels`, the fields and shared memory take arrays; a tensor that
    cannot be one (a dtype numpy lacks) stays, for the sample's skip to name it. torch is looked up,
    not imported: a sample holds a tensor only where its caller imported torch."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(sample, dict) or not any(isinstance(v, torch.Tensor) for v in sample.values()):
        return sample
    out = dict(sample)
    for key, v in sample.items():
        if isinstance(v, torch.Tensor):
            with contextlib.suppress(TypeError, RuntimeError):
                out[key] = v.detach().cpu().numpy()
    return out


def _each(samples: Any) -> Iterator[dict[str, Any]]:
    """The samples of ``samples``: a map-style dataset (``__len__`` and ``__getitem__`` without
    ``__iter__``, as torch's Dataset) by index up to its ``len()``, as FFCV's writer and LitData's
    optimize read one (Python's fallback iteration would go on until an IndexError, which a
    dataset that wraps its index never raises); anything else by iterating it."""
    if not hasattr(samples, "__iter__") and hasattr(samples, "__len__") and hasattr(samples, "__getitem__"):
        return (samples[i] for i in range(len(samples)))
    return iter(samples)


def _kind(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return (
        f"{type(value).__name__} {getattr(value, 'dtype', '')} {tuple(shape)}"
        if shape is not None
        else type(value).__name__
    )


def _scan(paths: Paths | Sequence[str], labels: Any, classes: Sequence[str] = (), kind: str = "none") -> Scan:
    """The scan a folder build would have made of the samples given: their sources and labels."""
    held = paths if isinstance(paths, Paths) else Paths.of(paths)
    return Scan(Sources(held, np.asarray(labels, dtype=np.int32)), list(classes), kind=kind)


def pack(
    samples: Iterable[dict[str, Any]], out: str | os.PathLike, *, fields: Any = None, **options: Any
) -> BuildReport:
    """Every sample of ``samples`` into a dataset at ``out`` (see :class:`Writer` for the rest)."""
    return Writer.pack(samples, out, fields=fields, **options)
