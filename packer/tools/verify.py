"""``packer verify``: read every record once, in order, and check it against the index and manifest.

Opening a dataset (``Manifest.load``, ``load_index``) only refuses metadata that would make a reader
misbehave; it cannot see a flipped bit inside a record or an index row that still points somewhere
valid. Verify reads all the data sequentially (packer.backends.walk: one pass in storage order, with
readahead), recomputes each record's crc32 and the dataset digest, and cross-checks index, manifest
and data files, so that bit rot, a bad copy or tampering is found before a training run trusts the
data. Every problem it finds is a line of text; records are named by number and source path.

liblmdb trusts its file: a hostile or damaged B-tree page can make it read outside the map and die of
SIGBUS. So before data.mdb is opened, py-lmdb's pure-Python structural verifier (``lmdb.verify``,
py-lmdb >= 3.0) walks every page; a data.mdb that fails it is never handed to liblmdb.

Everything else a reader trusts is covered by a digest the build wrote into the manifest: the
records and labels (``digest``), the index rows (``index_digest``), the source paths
(``sources_digest``) and the manifest's own fields, class names and options included
(``manifest_digest``). A format-1 dataset (written before the last two) is verified as far as its
digests go, and the result's ``notes`` say what could not be checked; in a format-2 manifest they
must be there.

A URL is verified in the store, without the node cache: the version's metadata is fetched into a
temporary folder, and each data file's object is checked against ``files.json`` (size, sha256) and
the manifest, its records against the index (length, CRC-32, the record format's own checks). A
memmap shard is streamed through once, a record at a time (memory: one piece of the response and one
record); an LMDB file, whose B-tree cannot be walked as a stream, is fetched into the temporary folder
one file at a time, checked as a local one, and deleted. Every missing or damaged object is named,
whatever ``limit`` says.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..backends import BACKENDS, data_files
from ..backends.pin import pin
from ..backends.walk import by_file, walk
from ..errors import is_url, local_path
from ..format import (
    INDEX,
    LABELS,
    MANIFEST,
    SOURCES,
    TARGETS,
    DatasetError,
    Digest,
    Manifest,
    bytes_per_file,
    index_digest,
    load_index,
    load_label_arrays,
    logical_digest,
    source_path,
)
from ..format.fields import record_problem
from ..format.label_arrays import arrays_digest, class_counts
from ..format.records import FORMATS
from ..store import ObjectNotFound, open_store
from ..store.base import ObjectInfo, Store
from ..store.published import POINTER, FileEntry, file_sha256, read_files, read_pointer, version_id, version_key


@dataclass
class Verification:
    """What verify found: ``problems`` holds the first ``limit`` findings, ``bad_records`` all of them."""

    root: str
    count: int
    digest: str
    problems: list[str] = field(default_factory=list)  # the first ``limit`` of them, to print
    notes: list[str] = field(default_factory=list)  # what could not be checked (a format-1 dataset)
    bad_records: int = 0
    limit: int = 10
    found: int = 0  # every problem, listed or not: the verdict never depends on the limit

    @property
    def ok(self) -> bool:
        return self.found == 0

    def add(self, problem: str, *, always: bool = False) -> None:
        """A finding; listed while under the limit, or ``always`` (a missing or damaged object)."""
        self.found += 1
        if always or len(self.problems) < self.limit:
            self.problems.append(problem)


def verify(root: str | os.PathLike, limit: int = 10, *, version: str = "") -> Verification:
    """Check the dataset at ``root`` (a local path, or a URL: checked in the store, see the module;
    ``version``: that published version's id instead of the current one); raises DatasetError only
    when it cannot be opened or read safely."""
    if is_url(root):
        return _verify_url(os.fsdecode(root), limit, version)
    pinned = pin(str(local_path(root).resolve()))  # manifest and arrays of one version; special files refused
    manifest, index = pinned.manifest, pinned.index
    result = Verification(str(root), manifest.count, "", limit=limit)
    checks = _Checks(result, manifest, index, pinned.sources, pinned.multi, pinned.targets)
    for problem in BACKENDS[manifest.backend].check_files(Path(root), manifest):
        result.add(problem)
    try:
        for i, data, crc in walk(root, manifest, index, checks.extra_keys):
            checks.record(i, data, crc)
    except OSError as e:
        raise DatasetError(f"{root}: read failed ({e})") from None
    checks.finish()
    return result


class _Checks:
    """The checks of a dataset's metadata (at once), of each record as it is handed over (in storage
    order: a local walk, or a stream from the store), and of the totals (:meth:`finish`)."""

    def __init__(
        self,
        result: Verification,
        manifest: Manifest,
        index: np.ndarray,
        sources: np.ndarray,
        multi: Optional[np.ndarray],
        targets: Optional[np.ndarray],
    ) -> None:
        self.result, self.manifest, self.index, self.sources = result, manifest, index, sources
        self.labels_digest = arrays_digest(multi, targets)
        _check_metadata(result, manifest, index, sources, multi, targets)
        self.segmented = manifest.format_version >= 3
        self.digest = Digest()  # versions 1 and 2 digest the bytes; 3 the index (logical_digest)
        self.labels = index["label"].tolist()
        self.unused: list[tuple[str, int, int]] = []  # LMDB: (file, records, bytes) no row names

    def extra_keys(self, name: str, n: int, nbytes: int) -> None:
        if self.segmented:  # records a refresh replaced or deleted: their bytes are the manifest's dead_bytes
            self.unused.append((name, n, nbytes))
        else:
            self.result.add(f"{name} holds {n} records the index does not name")

    def record(self, i: int, data: Optional[bytes], crc: int) -> None:
        why = _record_problem(self.manifest, self.index[i], data, crc)
        if why:
            self.result.bad_records += 1
            self.result.add(f"record {i} ({source_path(self.sources, self.index[i])}): {why}")
        if not self.segmented:
            self.digest.update(self.labels[i], data if data is not None else b"")

    def finish(self) -> None:
        result, manifest = self.result, self.manifest
        segmented = self.segmented
        result.digest = (
            logical_digest(self.index, self.labels_digest) if segmented else self.digest.hexdigest(self.labels_digest)
        )
        if result.digest != manifest.digest:
            result.add(f"dataset digest {result.digest} differs from the manifest's {manifest.digest}")
        if segmented and BACKENDS[manifest.backend].keyed:
            found = {name: (n, nbytes) for name, n, nbytes in self.unused}
            for s in manifest.shards:
                n, nbytes = found.get(str(s["file"]), (0, 0))
                if nbytes != int(s.get("dead", 0)):
                    result.add(
                        f"{s['file']} holds {n} records the index does not name ({nbytes} bytes), "
                        f"the manifest says {int(s.get('dead', 0))} dead bytes"
                    )
        _check_digests(result, manifest, self.index, self.sources)  # last: the problems found above say more


def _verify_url(url: str, limit: int, version: str) -> Verification:
    """:func:`verify` of the dataset at ``url``, in the store (see the module)."""
    store = open_store(url)
    if version:
        try:
            text = store.get(version_key(version, MANIFEST))
        except ObjectNotFound:
            raise DatasetError(f"{url}: no version {version} there") from None
    else:
        pointer = read_pointer(store)  # a publish may replace it meanwhile: read again
        if pointer is None:
            raise DatasetError(f"{url}: no dataset there")
        text = pointer.text
    pinned, version = version, version or version_id(text)
    listed = read_files(store, version)  # None: a copy synced as it is, everything at U/NAME
    if pinned and listed is None:
        raise DatasetError(f"{url}: version {version} has no files.json (a publish that did not finish)")
    with tempfile.TemporaryDirectory(prefix="packer-verify-") as tmp:
        root = Path(tmp)
        (root / MANIFEST).write_bytes(text)
        manifest = Manifest.load(root)
        names = [INDEX, SOURCES] + [LABELS] * (manifest.label_kind == "multi") + [TARGETS] * bool(manifest.targets)
        for name in names:  # fetched into files: the index of a large dataset need not fit in memory twice
            key = version_key(version, name) if listed is not None else name
            try:
                _fetch(store, key, root / name)
            except ObjectNotFound:
                raise DatasetError(f"{store.name(key)}: missing (the manifest needs it)") from None
        index, sources = load_index(root, manifest)
        multi, targets = load_label_arrays(root, manifest)
        result = Verification(url if listed is None else f"{url} (version {version})", manifest.count, "", limit=limit)
        checks = _Checks(result, manifest, index, sources, multi, targets)
        if listed is not None and not pinned:  # the version's own copy of the manifest the pointer holds
            key = version_key(version, MANIFEST)
            try:
                if store.get(key) != text:
                    result.add(
                        f"{store.name(key)}: differs from {store.name(POINTER)} (damaged or replaced)", always=True
                    )
            except ObjectNotFound:
                result.add(f"{store.name(key)}: missing", always=True)
        _check_objects(store, root, manifest, index, listed, checks)
        checks.finish()
    return result


def _fetch(store: Store, key: str, path: Path, info: Optional[ObjectInfo] = None) -> None:
    """The object into a new local file, in parallel ranged parts."""
    info = info or store.head(key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, info.size)
        store.download(key, fd, info)
    finally:
        os.close(fd)


def _check_objects(
    store: Store,
    tmp: Path,
    manifest: Manifest,
    index: np.ndarray,
    listed: Optional[dict[str, FileEntry]],
    checks: _Checks,
) -> None:
    """Each data file's object against files.json and the manifest, and its records (see the module)."""
    backend, places, result = BACKENDS[manifest.backend], by_file(manifest, index), checks.result
    sizes = [int(s["bytes"]) for s in manifest.shards] if backend.lists_files(manifest) else None
    for k, name in enumerate(data_files(manifest)):
        rows = places.rows(k)
        entry = listed.get(name) if listed is not None else FileEntry(name, -1)
        if entry is None:
            result.add(f"{name}: files.json does not list it ({len(rows)} records)", always=True)
            info = None
        else:
            try:
                info = store.head(entry.key)
            except ObjectNotFound:
                result.add(f"{store.name(entry.key)}: missing ({name}, {len(rows)} records)", always=True)
                info = None
        if info is None or entry is None:
            for i in rows.tolist():
                checks.record(i, None, 0)
            continue
        what = store.name(entry.key)
        for says, size in (("files.json", entry.size), ("the manifest", sizes[k] if sizes else -1)):
            if size >= 0 and info.size != size:
                result.add(f"{what}: {info.size} bytes, {says} says {size} (truncated or replaced)", always=True)
        positions, lengths = places.position[rows], index["length"][rows]
        if backend.keyed:  # an LMDB file: walked as a local one, then deleted
            path = tmp / name
            _fetch(store, entry.key, path, info)
            sha256 = file_sha256(path)
            try:
                backend.check_walkable(path)
                for i, data in backend.walk_file(path, rows, positions, lengths, checks.extra_keys):
                    checks.record(i, None if data is None else bytes(data), zlib.crc32(data) if data is not None else 0)
            except DatasetError as e:
                result.add(f"{what}: {str(e).removeprefix(f'{path}: ')}", always=True)
            path.unlink()
        else:
            digest = hashlib.sha256()
            _stream_records(store, entry.key, info, rows, positions, lengths, digest.update, checks)
            sha256 = digest.hexdigest()
        if entry.sha256 and sha256 != entry.sha256:
            result.add(f"{what}: sha256 differs from files.json's (damaged or replaced bytes)", always=True)
    for i in places.order[places.bounds[-1] :].tolist():  # rows naming a data file that is not listed
        checks.record(i, None, 0)


def _stream_records(
    store: Store,
    key: str,
    info: ObjectInfo,
    rows: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    hashed: Callable[[bytes], object],
    checks: _Checks,
) -> None:
    """The object read once, front to back: every piece to ``hashed``, each record (``rows`` at
    byte ``positions``, sorted, ``lengths`` long) handed to ``checks`` as its last byte arrives."""
    state = {"at": 0, "j": 0}
    record = bytearray()
    starts, ends = positions.tolist(), (positions + lengths.astype(np.int64)).tolist()
    numbers = rows.tolist()

    def sink(piece: bytes) -> None:
        hashed(piece)
        start, end = state["at"], state["at"] + len(piece)
        state["at"] = end
        j = state["j"]
        while j < len(numbers) and starts[j] < end:
            record.extend(piece[max(starts[j], start) - start : min(ends[j], end) - start])
            if ends[j] > end:
                break
            checks.record(numbers[j], bytes(record), zlib.crc32(record))
            record.clear()
            j += 1
        state["j"] = j

    store.fetch(key, 0, info.size, info.etag, sink)
    for i in numbers[state["j"] :]:  # past the object's end: missing
        checks.record(i, None, 0)


def _check_digests(result: Verification, manifest: Manifest, index: np.ndarray, sources: np.ndarray) -> None:
    """The manifest's own fields, the index rows and the source paths against the build's digests."""
    for name, key, stored, computed, what in (
        (
            MANIFEST,
            "manifest_digest",
            manifest.manifest_digest,
            manifest.computed_digest,
            "fields (class names, options, counts, short edge)",
        ),
        (INDEX, "index_digest", manifest.index_digest, index_digest(index), "rows"),
        (SOURCES, "sources_digest", manifest.sources_digest, index_digest(sources), "source paths"),
    ):
        if not stored and manifest.format_version < 2:
            result.notes.append(
                f"{name}: {what} not checked (the manifest has no {key}: written by format 1; rebuild to cover them)"
            )
        elif stored != computed:
            why = f"the manifest has no {key}" if not stored else f"manifest {key}"
            result.add(f"{name}: {what} differ from those the build wrote ({why}; damaged or edited)")


def _record_problem(manifest: Manifest, row: np.void, data: Optional[bytes], crc: int) -> Optional[str]:
    """Why this record (its bytes and their CRC-32) does not match its index row, or None."""
    if data is None:
        return "missing"
    if len(data) != int(row["length"]):
        return f"{len(data)} bytes, the index says {int(row['length'])}"
    if crc != int(row["crc32"]):
        return f"crc32 {crc:08x} differs from the index's {int(row['crc32']):08x} (damaged bytes)"
    height, width = int(row["height"]), int(row["width"])
    fmt = FORMATS[manifest.format]
    if not manifest.declared:
        return fmt.problem(data, height=height, width=width)

    def image_problem(image: memoryview) -> Optional[str]:
        if not fmt.compressed and len(image) != height * width * 3:
            return f"raw image of {len(image)} bytes, the index says {height} x {width} x 3"
        return fmt.problem(image, height=height, width=width)

    return record_problem(manifest.declared, memoryview(data), height=height, width=width, image_problem=image_problem)


def _first_gap(offsets: np.ndarray, lengths: np.ndarray, total: int) -> Optional[int]:
    """The first item that does not start where the previous one ended (``len(offsets)`` when the
    last one does not end at ``total``), or None when the items tile ``0..total`` back to back."""
    ends = offsets.astype(np.uint64) + lengths
    starts = np.concatenate([np.zeros(1, np.uint64), ends[:-1]])
    bad = np.flatnonzero(offsets != starts)
    if len(bad):
        return int(bad[0])
    return None if (int(ends[-1]) if len(ends) else 0) == total else len(offsets)


def _check_metadata(
    result: Verification,
    manifest: Manifest,
    index: np.ndarray,
    sources: np.ndarray,
    multi: Optional[np.ndarray],
    targets: Optional[np.ndarray],
) -> None:
    """Counts and layout that the index, manifest, source-path blob and label arrays must agree on."""
    if manifest.scanned != manifest.count + manifest.skipped + manifest.ignored:
        result.add(
            f"manifest: scanned {manifest.scanned} != count + skipped + ignored "
            f"({manifest.count} + {manifest.skipped} + {manifest.ignored})"
        )
    counts = class_counts(manifest.label_kind, index["label"], multi, len(manifest.classes)).tolist()
    if counts != manifest.class_counts:
        where = LABELS if manifest.label_kind == "multi" else "index"
        result.add(f"manifest: class_counts {manifest.class_counts} differ from the {where}'s labels {counts}")
    if arrays_digest(multi, targets) != manifest.labels_digest:
        result.add(
            "labels.npy/targets.npy differ from those the build wrote (manifest labels_digest; damaged or edited)"
        )
    gap = _first_gap(index["src_offset"], index["src_length"], len(sources))
    if gap is not None:
        result.add(f"{INDEX}: source paths are not laid out back to back (at record {gap})")
    if BACKENDS[manifest.backend].lists_files(manifest):
        _check_shards(result, manifest, index)


def _check_shards(result: Verification, manifest: Manifest, index: np.ndarray) -> None:
    """Record counts and sizes as the manifest lists them per data file. Versions 1 and 2: memmap
    shards filled in index order, records back to back. Version 3 (segments): no two rows share bytes
    or a key, and a memmap dataset's bytes no row points to add up to ``dead_bytes``."""
    backend, files, places = BACKENDS[manifest.backend], data_files(manifest), by_file(manifest, index)
    number, order = places.number, places.order
    counts = np.bincount(number, minlength=len(files)).tolist()
    listed = [int(s["count"]) for s in manifest.shards]
    if counts != listed:
        result.add(f"manifest: data file record counts {listed} differ from the index's {counts}")
    total = sum(int(s["bytes"]) for s in manifest.shards)
    if total != manifest.bytes:
        result.add(f"manifest: bytes {manifest.bytes} differ from the data files' total {total}")
    if manifest.format_version >= 3:
        n, at = number[order], places.position[order]
        ends = at + (1 if backend.keyed else index["length"][order].astype(np.int64))
        shared = np.flatnonzero((n[1:] == n[:-1]) & (at[1:] < ends[:-1]))
        if len(shared):
            result.add(f"{INDEX}: record {int(order[shared[0] + 1])} shares its bytes or key with another record")
        dead = [int(s.get("dead", 0)) for s in manifest.shards]
        if sum(dead) != manifest.dead_bytes:
            result.add(f"manifest: dead_bytes {manifest.dead_bytes} differ from the data files' total {sum(dead)}")
        segments = len({int(s.get("segment", 0)) for s in manifest.shards}) or 1
        if segments != manifest.segments:
            result.add(f"manifest: segments {manifest.segments} differ from the data files' {segments}")
        if not backend.keyed:  # keyed (LMDB): the walk counts the unused records' bytes
            live = bytes_per_file(number, index["length"], len(files))
            for s, n, d in zip(manifest.shards, live.tolist(), dead):
                if int(s["bytes"]) - n != d:
                    result.add(f"{s['file']}: {int(s['bytes']) - n} bytes no record uses, the manifest says {d}")
        return
    backwards = np.flatnonzero(np.diff(number) < 0)
    if len(backwards):
        result.add(f"{INDEX}: shard numbers go backwards at record {int(backwards[0]) + 1}")
    for k, s in enumerate(manifest.shards):
        rows = np.flatnonzero(number == k)
        gap = _first_gap(index["offset"][rows], index["length"][rows], int(s["bytes"]))
        if gap is not None:
            where = f"record {int(rows[gap])}" if gap < len(rows) else "its end"
            result.add(f"{s['file']}: records are not back to back filling {s['bytes']} bytes (at {where})")
