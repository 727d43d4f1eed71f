"""``packer build``: scan -> preprocess -> write, into a staging folder renamed at the end.

:func:`run_build` is the build both engines share: locks, options and scan (:func:`prepare`), one
dataset per --split, up-to-date check and --update plan, staging (:mod:`packer.builder.staging`), disk-full
handling, manifest. An :class:`Engine` only decodes the sources and feeds their records to the
:class:`~packer.builder.staging.RecordSink`: :class:`LocalEngine` here with this machine's worker processes,
:class:`packer.builder.dask.DaskEngine` on a Dask cluster.

OUT behind a symlink, the build lock and which folders are packer's: :mod:`packer.builder.paths`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from ..backends import BACKENDS, WRITE_ERRORS, close_all
from ..errors import local_path, say
from ..format import MANIFEST, MAX_MANIFEST, Manifest
from .labels import LabelError
from .options import SHARD_SIZE, BuildError, BuildOptions, Resolved
from .paths import check_target, dataset_path, lock_outputs
from .scan import Paths, Scan, ScanError, confusable, identify, scan
from .segments import Fetch, link_base, old_files, plan
from .split import TRAIN, split_path, split_scan
from .staging import (
    BUILD_OPTIONS,
    CLI_OPTIONS,
    BuildReport,
    OptionNames,
    Plan,
    Progress,
    RecordSink,
    complete,
    continue_plan,
    fetch_copied,
    fill,
    open_staging,
    rewind,
    staging_path,
)
from .update import Changes, ReusePlan, inputs_digest, ordered_results, previous_dataset, reuse_plan, still_skipped

__all__ = ["BuildError", "BuildOptions", "BuildReport", "build", "prepare", "run_build"]


def _up_to_date(out: Path, manifest: Manifest, retried: Optional[Paths] = None) -> BuildReport:
    """The report of a build that finds OUT already built from the same inputs and options (and
    ``retried``, its skipped files tried again, skipped again)."""
    changes = Changes.only_retried(retried) if retried is not None else None
    return BuildReport.of(out, manifest, up_to_date=True, changes=changes)


def _built_otherwise(out: Path, names: OptionNames) -> BuildError:
    return BuildError(
        f"{out} is a complete dataset built from other input or options than this {names.resume} "
        f"(use {names.update} to refresh it, or {names.force} to replace it)"
    )


def _check_class_changes(out: Path, old: list[str], new: list[str], options: BuildOptions, quiet: bool) -> None:
    """A refresh that renumbers classes (a class folder deleted or added shifts the ids after it) says
    so, or with ``--on-class-change fail`` stops before anything is written: a job that reopens the
    dataset would train on shifted labels."""
    moved = [f"{name!r} {i} -> {new.index(name)}" for i, name in enumerate(old) if name in new and new.index(name) != i]
    if moved:
        gone = [name for name in old if name not in new]
        change = (
            f"class ids change from those of {out}"
            + (f" (gone: {', '.join(map(repr, gone))})" if gone else "")
            + f": {', '.join(moved[:5])}"
            + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
        )
        if options.class_change_fails:
            raise BuildError(
                f"{change} (--on-class-change fail; {out} is left as it was: keep the ids with --classes "
                f"FILE listing the old classes in order, new ones after them, or pass --on-class-change "
                f"warn to renumber)"
            )
        say(f"warning: {change}", quiet)


def prepare(raw_dir: str | os.PathLike, out: Path, options: Resolved, quiet: bool = False) -> Scan:
    """Refuse an OUT this build must not replace, scan raw/ (with each source's identity); shared
    by both engines so that they refuse the same inputs. ``options``: :meth:`~BuildOptions.resolved`."""
    split, backend, labelling = options.split, options.backend, options.labelling
    force, update, resume = options.force, options.update, options.resume
    if split and (out / MANIFEST).is_file():
        raise BuildError(
            f"{out} is a dataset; --split writes a folder of datasets "
            f"({split_path(out, TRAIN, backend)}, ...): choose another OUT"
        )
    for target in [split_path(out, name, backend) for name in (TRAIN, *split)] if split else [out]:
        check_target(target, replaces=force, keeps=update or resume)
    try:
        found = scan(raw_dir, options.labels, labelling, strict=options.on_error == "fail")
    except (ScanError, LabelError) as e:
        raise BuildError(str(e)) from None
    if found.unreadable and options.on_error != "skip":
        rel, reason = found.unreadable[0]
        more = f" (and {len(found.unreadable) - 1} more)" if len(found.unreadable) > 1 else ""
        raise BuildError(
            f"{Path(raw_dir) / rel}: {reason}{more}; its files cannot be packed (pass "
            f"--on-error skip to build without them)"
        )
    for a, b in confusable(found.classes):
        say(
            f"warning: class names {a!r} and {b!r} differ only in Unicode normalization or case: they are two classes",
            quiet,
        )
    for note in found.notes:
        say(note, quiet)
    if not found.sources:
        hint = "" if options.labels or labelling.unlabeled else "; for a flat folder of unlabeled images, --unlabeled"
        raise BuildError(f"{raw_dir}: no images found (expected class folders with images inside{hint})")
    names = len(json.dumps(found.classes)) + len(json.dumps(found.target_names))  # as the manifest holds them
    if names > MAX_MANIFEST:  # now, not once everything is decoded (when Manifest.encode would refuse it)
        raise BuildError(
            f"{out}: {len(found.classes):,} class names and {len(found.target_names):,} target names take "
            f"{names / 1e6:.1f} MB, over the {MAX_MANIFEST >> 20} MiB manifest packer reads"
        )
    found.identity = identify(raw_dir, found.sources, options.checksum)
    return found


class Engine(Protocol):
    """What decodes a build's sources: this machine's worker pool, or a Dask cluster."""

    #: recorded in the staging folder's build.json (engines stage differently: a --resume must match);
    #: empty for the local engine, so that its build.json is what it always was
    marker: dict[str, str]
    shard_size: int  # the --shard-size default

    @property
    def raw(self) -> str | os.PathLike[str]:
        """raw/ (where --update tries the files skipped last time again, on this machine)."""
        ...

    def pack(
        self, staging: Path, found: Scan, options: Resolved, state: Optional[dict[str, Any]], reuse: Optional[ReusePlan]
    ) -> tuple[RecordSink, int]:
        """Every source of ``found`` into a RecordSink (continuing the checkpoint ``state``, reusing the
        old records ``reuse`` names); the sink and the number of sources an earlier run had done."""
        ...


def run_build(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    options: BuildOptions,
    quiet: bool,
    engine: Engine,
    *,
    fetch: Optional[Fetch] = None,
    names: OptionNames = CLI_OPTIONS,
) -> BuildReport:
    """Pack ``raw_dir`` into ``out`` with ``engine``: the build both engines share (see the module docstring).
    ``fetch``: OUT is the local copy of a dataset in object storage (packer.tools.publish), whose data
    files a refresh keeps where they are when they are not in OUT, and fetches where it copies records.
    ``names``: how messages name the resume options (the caller's: CLI flags or packer.build's keywords)."""
    t0 = time.monotonic()
    local_path(raw_dir)
    options = options.resolved(out, engine.shard_size)  # from the name given: a symlink's target may differ
    given, out = local_path(out), dataset_path(out)
    with contextlib.ExitStack() as locks:
        lock_outputs(locks, out, options, quiet)
        found = prepare(raw_dir, out, options, quiet)
        if not options.split:
            report = _build_dataset(out, found, options, quiet, engine, fetch, names)
        else:
            out.mkdir(parents=True, exist_ok=True)
            reports = {
                name: _build_dataset(split_path(out, name, options.backend), part, options, quiet, engine, fetch, names)
                for name, part in split_scan(found, options.split, options.split_seed).items()
            }
            report = BuildReport.combine(str(out), reports)
    report.out = str(given)
    report.seconds = time.monotonic() - t0
    return report


def _build_dataset(
    out: Path,
    found: Scan,
    options: Resolved,
    quiet: bool,
    engine: Engine,
    fetch: Optional[Fetch],
    names: OptionNames,
) -> BuildReport:
    """One dataset at ``out`` from ``found``: kept when up to date, else staged (reusing records with
    --update), then renamed into place."""
    t0 = time.monotonic()
    settings = options.settings(found)
    previous = previous_dataset(out, quiet) if options.keep_current else None
    if previous is not None and previous[0].fields:  # its records hold fields this build does not write
        raise BuildError(
            f"{out} holds fields beside its images (written by packer.Writer or --coco): a folder build "
            f"cannot {names.update} or {names.resume} it; write it again the way it was made, or replace it "
            f"with {names.force}"
        )
    if previous is not None and previous[0].inputs == inputs_digest(found, settings):
        if not options.update:
            return _up_to_date(out, previous[0])
        retried = still_skipped(Path(engine.raw), out, previous[0], found, options.preprocess, options.processes)
        if retried is not None:
            return _up_to_date(out, previous[0], retried)
    if options.keep_current and not options.update and out.exists():  # --resume of a build that finished
        raise _built_otherwise(out, names)
    if previous is not None:
        _check_class_changes(out, previous[0].classes, found.classes, options, quiet)
    reuse = reuse_plan(out, previous, found, settings, quiet) if options.update and previous else None
    staging = staging_path(out)
    state = open_staging(staging, settings | engine.marker, resume=options.resume, names=names)
    if state is None:
        if reuse is not None:
            _link_old_files(out, staging, reuse, options, quiet, fetch)
        of, base = (reuse.manifest.computed_digest, reuse.base) if reuse is not None else (None, None)
        Plan.made(staging, of, base).record(staging, found)
    else:
        state = _resume(out, staging, found, options, reuse, state, quiet, fetch, names)
    try:
        try:
            sink, resumed_from = engine.pack(staging, found, options, state, reuse)
        finally:
            if reuse is not None:
                close_all(out)  # our handles on the old OUT, before the rename replaces it
        report = complete(staging, out, found, options, sink, resumed_from, names=names)
    except WRITE_ERRORS as e:  # LMDB reports a full disk as a bare "Input/output error"
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        raise BuildError(
            f"cannot write {staging}: {e} (disk full? the work so far is kept there: "
            f"free some space, then run the same {names.run} with {names.resume})"
        ) from e
    report.processed = len(found.sources) - resumed_from - report.reused
    report.changes = reuse.changes if reuse is not None else None
    report.seconds = time.monotonic() - t0
    return report


def _resume(
    out: Path,
    staging: Path,
    found: Scan,
    options: Resolved,
    reuse: Optional[ReusePlan],
    state: dict[str, Any],
    quiet: bool,
    fetch: Optional[Fetch],
    names: OptionNames,
) -> Optional[dict[str, Any]]:
    """The checkpoint the interrupted build at ``staging`` continues from, with its recorded
    :class:`~packer.builder.staging.Plan` (:func:`continue_plan`)."""
    recorded = continue_plan(out, staging, reuse, quiet, fetch, names)
    return rewind(staging, found, state, options.backend, recorded.first, quiet, names)


def _link_old_files(
    out: Path, staging: Path, reuse: ReusePlan, options: Resolved, quiet: bool, fetch: Optional[Fetch]
) -> None:
    """Link the old dataset's data files into ``staging`` so that its records stay where they are
    (packer.builder.segments), as many of them as the refresh keeps; say why where it rewrites records."""
    kept = reuse.old_of[reuse.old_of >= 0]
    keep, why = plan(reuse.manifest, reuse.index, kept, options.backend, options.shard_size)
    if why:
        say(f"{out}: {why}", quiet)
    if keep:
        files = old_files(reuse.manifest, reuse.index)[:keep]
        reuse.base = link_base(out, staging, files, quiet, remote=fetch is not None)
    fetch_copied(out, reuse, fetch)


@dataclass
class LocalEngine:
    """This machine's worker processes (:mod:`packer.builder.workers`), results in scan order."""

    raw: Path
    quiet: bool
    marker: dict[str, str] = field(default_factory=dict)
    shard_size: int = SHARD_SIZE

    def pack(
        self, staging: Path, found: Scan, options: Resolved, state: Optional[dict[str, Any]], reuse: Optional[ReusePlan]
    ) -> tuple[RecordSink, int]:
        backend, shard_size = options.backend, options.shard_size
        done = int(state["sources_done"]) if state else 0
        base = reuse.base if reuse is not None else None
        first = len(base.files) if base is not None else 0  # a refresh's new segment: after the linked files
        sink = RecordSink(
            staging, found, state, lambda s: BACKENDS[backend].open_writer(staging, s, shard_size, first), base
        )
        todo = found.sources[done:]
        old_of = reuse.old_of[done:] if reuse is not None else np.full(len(todo), -1, dtype=np.int64)
        results = ordered_results(self.raw, todo, old_of, reuse, options.preprocess, options.processes)
        progress = Progress(len(found.sources), done, self.quiet)
        try:
            fill(sink, found, done, results, options, self.raw, progress)
        except BaseException:
            results.close()  # stop the worker pool now, not whenever the traceback is freed
            sink.close()
            raise
        finally:
            progress.close()
        return sink, done


def build(
    raw_dir: str | os.PathLike,
    out: str | os.PathLike,
    options: Optional[BuildOptions] = None,
    *,
    quiet: bool = False,
    names: OptionNames = BUILD_OPTIONS,
    **changes: Any,
) -> BuildReport:
    """Pack ``raw_dir`` into ``out`` on this machine's cores; see ``packer build --help``.
    ``names``: how messages name the resume options (these keywords; the CLI passes its flags).

    ``options`` (default ``BuildOptions()``) with ``changes`` applied: any :class:`BuildOptions` field
    by name, e.g. ``build(raw, out, format="raw", workers=4)``; a bad value raises BuildError.
    """
    options = (options or BuildOptions()).but(**changes)
    if options.coco is not None:  # the images a COCO file lists, with their annotations (a Writer)
        from .coco import build_coco

        return build_coco(raw_dir, out, options, quiet, names=names)
    return run_build(raw_dir, out, options, quiet, LocalEngine(Path(raw_dir), quiet), names=names)
