"""``--update``: what a dataset was built from, and which of its records a refresh can copy.

OUT itself is the build's cache: its index records each source's identity (size, mtime, optional content
hash) and its manifest an ``inputs`` digest over everything the bytes depend on, so a refresh decodes
only added or changed files and still writes what a full rebuild would.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._version import __version__
from ..backends import BACKENDS, record_places
from ..backends.walk import InOrder
from ..errors import say
from ..format import MANIFEST, REPORT, DatasetError, Manifest, load_index, open_regular
from .preprocess import PreprocessSpec, Record, Result, Skip, process_chunk
from .scan import Paths, Scan, Sources
from .segments import Base
from .workers import results


def inputs_digest(found: Scan, settings: dict[str, Any]) -> str:
    """What a dataset's bytes depend on: the scanned inputs with their identities, every setting, the
    packer version. Equal digests mean a rebuild would write the same dataset (manifest ``inputs``)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
    h.update(f"\0{__version__}\0{found.fingerprint(identity=True)}".encode())
    return "sha256:" + h.hexdigest()


def previous_dataset(out: Path, quiet: bool) -> Optional[tuple[Manifest, np.ndarray, np.ndarray]]:
    """The dataset already at ``out`` (manifest, index, source paths), or None when there is none or it
    cannot be read (then it is rebuilt in full)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        manifest = Manifest.load(out)
        return (manifest, *load_index(out, manifest))
    except DatasetError as e:
        say(f"cannot reuse {out} ({e}); rebuilding every record", quiet)
        return None


@dataclass(frozen=True)
class Changes:
    """What a refresh changed since the version it replaces, by source path: files added, changed
    (same path, other identity), deleted, and skipped last time and so decoded again (retried)."""

    added: Paths
    changed: Paths
    deleted: Paths
    retried: Paths

    def __str__(self) -> str:
        return ", ".join(f"{len(getattr(self, name))} {name}" for name in ("added", "changed", "deleted", "retried"))

    @classmethod
    def only_retried(cls, retried: Paths) -> Changes:
        none = Paths.of(())
        return cls(none, none, none, retried)


def skipped_before(out: Path) -> Optional[dict[str, str]]:
    """The files OUT's report lists as skipped, with their reasons, in scan order; None where the
    report cannot be read (or is not the dataset's own regular file)."""
    skipped: dict[str, str] = {}
    try:
        with open(open_regular(out / REPORT), "rb") as f:
            for line in f:
                entry = json.loads(line.decode("utf-8", "surrogateescape"))
                if entry["status"] == "skipped":
                    skipped[entry["path"]] = entry["reason"]
    except (OSError, DatasetError, ValueError, KeyError, TypeError):
        return None
    return skipped


def still_skipped(
    raw: Path, out: Path, manifest: Manifest, found: Scan, opts: PreprocessSpec, workers: int
) -> Optional[Paths]:
    """The files skipped when OUT was built, decoded again (a decoder installed since, a transient
    error gone): all of them when each is skipped again for the same reason, so OUT still holds what a
    rebuild would write ("up to date"); None at the first that packs or fails otherwise (the refresh
    then decodes them). Skips the scan made (--labels rows without a file) are not decoding's."""
    if manifest.skipped == len(found.missing):
        return Paths.of(())
    before = skipped_before(out)
    if before is None:
        return None
    for rel, _ in found.missing:
        before.pop(rel, None)
    rels = Paths.of(before)
    fresh = results(str(raw), rels, opts, workers, chunk=2)  # in worker processes: some crashed theirs
    try:
        for rel, result in zip(rels, fresh):
            if not isinstance(result, Skip) or result.reason != before[rel]:
                return None
    finally:
        fresh.close()
    return rels


@dataclass
class ReusePlan:
    """A refresh's reuse plan: which records of the dataset being replaced --update keeps instead of
    decoding again (``old_of``), and, once its data files are linked, where they stay (``base``)."""

    root: Path
    manifest: Manifest
    index: np.ndarray
    old_of: np.ndarray  # per source in scan order: its record number in the old dataset, or -1
    changes: Changes
    #: set once the old data files are linked into the staging folder (packer.builder.segments): records are
    #: then kept where they lie, not copied
    base: Optional[Base] = None

    def kept(self, old: np.ndarray) -> list[Optional[Kept]]:
        """Old records ``old`` (record numbers, -1 for none) left in their data files, where those are
        linked (versions 1 and 2 key LMDB record j as j); None where a record is to be copied. A chunk
        at a time, in columns: a refresh of a million files asks for a million of them."""
        if self.base is None or not len(self.index):  # nothing linked, or no old record at all
            return [None] * len(old)
        at = np.maximum(old, 0)
        rows = self.index[at]
        shard, offset = record_places(self.manifest, self.index, at)
        linked = (old >= 0) & (shard < len(self.base.entries))
        columns = (shard, offset, rows["length"], rows["height"], rows["width"], rows["crc32"])
        return [Kept(*facts) if keep else None for keep, *facts in zip(linked.tolist(), *(c.tolist() for c in columns))]


@dataclass(frozen=True)
class Kept:
    """An old record that stays in its (linked) data file: where it lies, and its index row's facts."""

    shard: int
    offset: int
    length: int
    height: int
    width: int
    crc32: int


class OldRecords:
    """The old dataset's records by number, copied (those of the data files a refresh does not link):
    read in sequential walks (packer.backends.walk.InOrder: readahead, the disk's speed)."""

    def __init__(self, plan: ReusePlan) -> None:
        self._plan = plan
        self._records: Optional[InOrder] = None
        self._checked: set[int] = set()  # data files checked before a walk reads them (LMDB: their pages)
        self._broken = False

    def record(self, j: int) -> Optional[Record]:
        """Old record ``j`` as its index row describes it, or None when its bytes are missing, differ
        from the row (damaged since they were written: the file is decoded again) or cannot be read
        (a damaged old dataset: then every later record is decoded again too)."""
        row = self._plan.index[j]
        if self._broken:
            return None
        try:
            c = self._plan
            if self._records is None:
                self._records = InOrder(c.root, c.manifest, c.index)
            k = int(self._records.number[j])
            if k not in self._checked and k < len(self._records.files):
                BACKENDS[c.manifest.backend].check_walkable(c.root / self._records.files[k])
                self._checked.add(k)
            data = self._records.intact(j)
        except (DatasetError, OSError):
            self.close()
            self._broken = True
            return None
        return None if data is None else Record(data, int(row["height"]), int(row["width"]), int(row["crc32"]))

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
            self._records = None


def stale_reason(manifest: Manifest, settings: dict[str, Any]) -> Optional[str]:
    """Why the old records are not what this build would write (options, codec, version), or None.

    Backend and shard size only change the layout, so records are reused across them.
    """
    changed = [
        f"{k} {manifest.options.get(k)!r} -> {v!r}"
        for k, v in settings["options"].items()
        if manifest.options.get(k) != v
    ]
    if manifest.codec != settings["codec"]:
        changed.append(f"codec {manifest.codec} -> {settings['codec']}")
    if manifest.packer_version != __version__:
        changed.append(f"packer {manifest.packer_version} -> {__version__}")
    if settings["checksum"] and not manifest.options.get("checksum"):
        # size and mtime cannot stand in for the hash: a file edited keeping both would keep its stale
        # record, and now with its new hash beside it, so every later --checksum refresh would trust it
        changed.append(
            "built without --checksum, so it stores no content hashes to compare: every file is decoded "
            "this once, and the new version stores them for the next --checksum refresh"
        )
    return ", ".join(changed) or None


def old_paths(index: np.ndarray, paths: np.ndarray, start: int, stop: int) -> list[str]:
    """The source paths of old rows ``start:stop``."""
    view = np.ascontiguousarray(paths).data
    spans = zip(index["src_offset"][start:stop].tolist(), index["src_length"][start:stop].tolist())
    return [bytes(view[o : o + n]).decode("utf-8", "surrogateescape") for o, n in spans]


class PathIndex:
    """The old rows by source path: a join on the paths' 64-bit hashes (a sort, then a binary search
    per path looked up), each match confirmed on the path itself: a few numpy arrays, not a dict of a
    million old paths (measured: docs/PERFORMANCE.md, "Refresh cost with segments"); the old paths
    are decoded a chunk at a time. A hash shared by two old paths (~1e-8 at 1M files) leaves one of
    them unmatched: its file is decoded again, the result the same."""

    def __init__(self, index: np.ndarray, paths: np.ndarray, step: int = 1 << 16) -> None:
        self._index, self._paths, self._step = index, paths, step
        hashes = np.empty(len(index), np.int64)
        for start in range(0, len(index), step):
            hashes[start : start + step] = [hash(p) for p in old_paths(index, paths, start, start + step)]
        self._order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[self._order]

    def find(self, rels: Sequence[str]) -> np.ndarray:
        """Per path of ``rels``, the old row with that source path, or -1."""
        hashes, step = self._hashes, self._step
        wanted = np.fromiter((hash(r) for r in rels), np.int64, count=len(rels))
        at = np.minimum(np.searchsorted(hashes, wanted), max(len(hashes) - 1, 0))
        hit = np.flatnonzero(hashes[at] == wanted) if len(hashes) else np.zeros(0, np.int64)
        del wanted
        candidate = np.full(len(rels), -1, np.int64)
        for start in range(0, len(hit), step):
            part = hit[start : start + step]
            rows = self._order[at[part]]
            for k, j, p in zip(part.tolist(), rows.tolist(), old_paths(self._index[rows], self._paths, 0, len(rows))):
                if p == rels[k]:
                    candidate[k] = j
        return candidate


def reuse_plan(
    out: Path, previous: tuple[Manifest, np.ndarray, np.ndarray], found: Scan, settings: dict[str, Any], quiet: bool
) -> Optional[ReusePlan]:
    """Match each source to an old record by path and identity (size and mtime, or size and content
    hash with --checksum); None when the old records were built differently."""
    manifest, index, paths = previous
    why = stale_reason(manifest, settings)
    if why:
        say(f"{out}: cannot reuse its records ({why}): rebuilding every record", quiet)
        return None
    candidate = PathIndex(index, paths).find(found.sources.paths)
    known = np.flatnonzero(candidate >= 0)
    same = np.ones(len(known), dtype=bool)
    for name in ("src_size", "src_hash") if settings["checksum"] else ("src_size", "src_mtime_ns"):
        same &= index[name][candidate[known]] == found.identities()[name][known]
    old_of = np.full(len(found.sources), -1, dtype=np.int64)
    old_of[known[same]] = candidate[known[same]]
    return ReusePlan(out, manifest, index, old_of, _changes(out, previous, found, candidate, known[~same]))


def _changes(
    out: Path,
    previous: tuple[Manifest, np.ndarray, np.ndarray],
    found: Scan,
    candidate: np.ndarray,
    changed: np.ndarray,
) -> Changes:
    """A refresh's :class:`Changes` from its path join: ``candidate`` (per source, the old row with its
    path, or -1) and ``changed`` (the sources whose old row's identity differs)."""
    manifest, index, paths = previous
    rels = found.sources.paths
    new = np.flatnonzero(candidate < 0)
    skipped = (skipped_before(out) or {}) if manifest.skipped else {}
    was_skipped = np.fromiter((rels[k] in skipped for k in new.tolist()), bool, count=len(new))
    retried = np.zeros(len(rels), bool)
    retried[new[was_skipped]] = True
    added = candidate < 0
    added[retried] = False
    edited = np.zeros(len(rels), bool)
    edited[changed] = True
    kept = np.zeros(len(index), bool)
    kept[candidate[candidate >= 0]] = True
    gone = np.flatnonzero(~kept)
    return Changes(
        rels.select(added),
        rels.select(edited),
        Paths.of(old_paths(index[gone], paths, 0, len(gone))),
        rels.select(retried),
    )


def ordered_results(
    raw: Path,
    todo: Sources,
    old_of: np.ndarray,
    reuse: Optional[ReusePlan],
    opts: PreprocessSpec,
    workers: int,
    fresh: Optional[Generator[Result, None, None]] = None,
) -> Generator[tuple[Result | Kept, bool], None, None]:
    """Each source's result in scan order, and whether it was reused: when ``old_of`` names an old
    record, that record left in place (a :class:`Kept`, its data file being linked) or copied, else
    from ``fresh``: the results of the files to decode, in order (by default this machine's worker
    pool, which sees only those files; a --dask build passes its own)."""
    if fresh is None:
        rels = todo.paths.select(old_of < 0)
        fresh = results(str(raw), rels, opts, workers if rels else 1, chunk=2)  # nothing to decode: start no pool
    old = OldRecords(reuse) if reuse is not None else None
    step = 4096
    kept: Iterator[Optional[Kept]] = (
        itertools.chain.from_iterable(reuse.kept(old_of[at : at + step]) for at in range(0, len(old_of), step))
        if reuse is not None
        else itertools.repeat(None)
    )
    try:
        for source, j, keep in zip(todo, old_of.tolist(), kept):
            if j < 0 or reuse is None or old is None:
                yield next(fresh), False
            elif keep is not None:
                yield keep, True
            elif (record := old.record(j)) is not None:
                yield record, True
            else:
                yield process_chunk([str(raw / source.rel)], opts)[0], False  # damaged since: decode again
    finally:
        fresh.close()
        if old is not None:
            old.close()
