"""The on-disk format: file names, LMDB key scheme, index dtype, manifest schema, digest.

Everything a reader needs to trust a dataset lives here, so docs/FORMAT.md has one place to match.
Only JSON and .npy (loaded with ``allow_pickle=False``) are used: opening an untrusted dataset never
runs code.
"""

from __future__ import annotations

import builtins
import errno
import functools
import hashlib
import io
import json
import math
import mmap
import os
import re
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import DatasetError
from .fields import FIELDS_VERSION, Field, declare, record_fields
from .records import FORMATS

FORMAT_VERSION = 3
#: Versions this packer reads: 1 lacks label kinds and targets (every dataset is "class", see LABEL_KINDS);
#: 1 and 2 hold one data file per backend layout (LMDB: data.mdb, keys in index order) and digest the
#: record bytes; 3 adds segments (any row may point into any data file) and the logical digest.
#: 4 is 3 with fields beside the image in every record (packer.format.fields); a dataset without
#: fields is still written as version 3.
READABLE_VERSIONS = (1, 2, 3, FIELDS_VERSION)
MANIFEST = "manifest.json"
INDEX = "index.npy"
SOURCES = "sources.npy"
REPORT = "report.jsonl"
LMDB_DATA = "data.mdb"  # an LMDB dataset's first segment (its only data file before version 3)
MAX_MANIFEST = 64 << 20  # bytes of manifest.json read at most (a real one is a few KB per 100 classes)
#: manifest ``label_kind`` (see packer.builder.labels): one class id per record in ``label``; several classes per
#: record, a bit-packed multi-hot row each in LABELS (``label`` -1); no labels (``label`` -1, no classes).
LABEL_KINDS = ("class", "multi", "none")
LABELS = "labels.npy"  # "multi": uint8, count x ceil(len(classes) / 8), little-endian bit order
TARGETS = "targets.npy"  # with manifest ``targets``: float32, count x len(targets), finite

#: One row per record. ``shard``/``offset`` locate memmap records (0 for LMDB, where the key is the
#: zero-padded record number). ``src_offset``/``src_length`` slice the UTF-8 source-path blob.
#: ``src_size``/``src_mtime_ns``/``src_hash`` identify the source file as it was packed, so that
#: ``build --update`` can tell an unchanged file (its record is kept) from a changed one.
INDEX_DTYPE = np.dtype(
    [
        ("shard", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("label", "<i4"),
        ("height", "<u4"),
        ("width", "<u4"),
        ("crc32", "<u4"),
        ("src_offset", "<u8"),
        ("src_length", "<u4"),
        ("src_size", "<u8"),
        ("src_mtime_ns", "<i8"),
        ("src_hash", "<u8"),
    ]
)
IDENTITY_FIELDS = ("src_size", "src_mtime_ns", "src_hash")
#: A source file's identity (see :func:`packer.builder.scan.identify`); ``src_hash`` is 0 unless built with --checksum.
IDENTITY_DTYPE = np.dtype([(name, INDEX_DTYPE[name]) for name in IDENTITY_FIELDS])


def lmdb_key(i: int) -> bytes:
    """Zero-padded so that keys sort in record order and ``put(append=True)`` fills pages fully."""
    return b"%010d" % i


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def lmdb_segment_name(k: int) -> str:
    """Segment 0 is data.mdb (the name of versions 1 and 2); segment k an LMDB file of its own, each
    written once and never changed (a refresh adds one rather than writing into a file that readers of
    the old version have open without locks)."""
    return LMDB_DATA if k == 0 else f"data-{k:05d}.mdb"


@dataclass
class Manifest:
    """The per-dataset summary, written last: its presence marks a complete dataset."""

    backend: str
    format: str
    short_edge: int
    quality: int
    classes: list[str]
    count: int
    class_counts: list[int]
    bytes: int
    digest: str
    shards: list[dict[str, Any]] = field(default_factory=list)  # JSON: {"file", "count", "bytes"}, see _check
    scanned: int = 0
    skipped: int = 0
    ignored: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    codec: str = ""
    packer_version: str = ""
    inputs: str = ""  # digest of the scanned inputs and all settings: --update's "up to date" test
    index_digest: str = ""  # see index_digest(): verify notices any edited index row, src_* included
    label_kind: str = "class"  # one of LABEL_KINDS
    targets: list[str] = field(default_factory=list)  # names of the TARGETS columns (CSV columns)
    labels_digest: str = ""  # sha256 of LABELS' then TARGETS' data ("" with neither)
    sources_digest: str = ""  # index_digest() of sources.npy's bytes: verify notices an edited path
    format_version: int = FORMAT_VERSION
    #: Version 3: record bytes in the data files that no index row points to any more (records a
    #: refresh replaced or deleted), and how many writes (segments) the data files come from; see
    #: docs/FORMAT.md "Segments". 0 and 1 in a dataset written in one go.
    dead_bytes: int = 0
    segments: int = 1
    #: sha256 over every other key of manifest.json (see :func:`manifest_digest`): verify notices an
    #: edited class name, option or count. Empty in datasets of packers before it; then unchecked.
    manifest_digest: str = ""
    #: Version 4: the declared fields, ``{"name", "kind", "dtype"}`` each (packer.format.fields), in
    #: record order. Absent from manifest.json when empty, so a dataset without fields is as it was.
    fields: list[dict[str, Any]] = field(default_factory=list)
    #: Version 4: per record field, ``{"records": with a non-empty value, "items": in all}``, for
    #: boxes ``"per_record"``: ``{"<boxes>": records with that many}``, for box labels ``"per_class"``:
    #: ``{"<label id>": boxes}`` (``packer info``). Absent when empty.
    field_counts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        fields = asdict(self)
        for key in ("fields", "field_counts"):
            if not fields[key]:
                del fields[key]
        fields["manifest_digest"] = manifest_digest(fields)
        return json.dumps(fields, indent=1, sort_keys=True)

    def encode(self, path: str | os.PathLike) -> builtins.bytes:
        """The bytes of manifest.json at ``path``, refused (DatasetError) unless a reader would accept
        them (:meth:`parse`, too big say): a build never writes a dataset that no reader opens."""
        text = self.to_json().encode("utf-8")  # JSON escapes every non-ASCII character
        Manifest.parse(text, path)
        return text

    @classmethod
    def load(cls, root: str | os.PathLike) -> Manifest:
        path = Path(root) / MANIFEST
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            raise DatasetError(f"{root}: not a packer dataset (no {MANIFEST}; incomplete or wrong path)") from None
        try:
            return cls.read(fd, path)
        finally:
            os.close(fd)

    @classmethod
    def read(cls, fd: int, path: str | os.PathLike) -> Manifest:
        """The manifest in the open file ``fd`` (``path`` names it in errors), checked."""
        try:
            with open(os.dup(fd), "rb") as f:
                # Asked for its size, not the limit: a read of n bytes allocates n first.
                size = os.fstat(f.fileno()).st_size
                text = f.read(min(size, MAX_MANIFEST) + 1)
                if len(text) > size:  # it grew since fstat: read on, to the limit
                    text += f.read(MAX_MANIFEST + 1 - len(text))
        except OSError as e:
            raise DatasetError(f"{path}: unreadable manifest ({e})") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text: builtins.bytes, path: str | os.PathLike) -> Manifest:
        """The manifest ``text`` (the bytes of ``path``), checked: every rule a reader applies, and
        the one place they are, so that a build can apply them to what it writes (:meth:`encode`).
        ``path`` is named as given (a URL's ``s3://`` would lose a slash to Path)."""
        if len(text) > MAX_MANIFEST:
            raise DatasetError(f"{path}: manifest is over {MAX_MANIFEST >> 20} MiB, the most packer reads")
        try:
            data = json.loads(text.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and bad JSON
            raise DatasetError(f"{path}: unreadable manifest ({e})") from None
        if not isinstance(data, dict):
            raise DatasetError(f"{path}: manifest is not a JSON object")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise DatasetError(
                f"{path}: format_version {version!r} is not supported (this packer reads "
                f"{', '.join(map(str, READABLE_VERSIONS))})"
            )
        known = set(cls.__dataclass_fields__)
        try:
            m = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise DatasetError(f"{path}: manifest is missing fields ({e})") from None
        m._check(path)
        m.computed_digest = manifest_digest(data)
        return m

    # manifest_digest() of the file as read, set by load(). Not annotated, so not a dataclass field: it is
    # per instance but never written to manifest.json.
    computed_digest = ""

    def _check(self, path: str | os.PathLike) -> None:
        """Types and ranges, so that later arithmetic on tampered values cannot misbehave."""

        def bad(what: str) -> DatasetError:
            return DatasetError(f"{path}: manifest field {what} is invalid")

        def size(v: Any) -> bool:  # fits the index's unsigned 64-bit fields (numpy would overflow)
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63

        for name in ("short_edge", "quality", "count", "bytes", "scanned", "skipped", "ignored", "dead_bytes"):
            if not size(getattr(self, name)):
                raise bad(name)
        if self.short_edge < 1:
            raise bad("short_edge")
        if not size(self.segments) or self.segments < 1:
            raise bad("segments")
        if self.backend not in LAYOUTS:
            raise bad("backend")
        if self.format not in FORMATS:
            raise bad("format")
        if not isinstance(self.classes, list) or not all(isinstance(c, str) for c in self.classes):
            raise bad("classes")
        if not isinstance(self.class_counts, list) or len(self.class_counts) != len(self.classes):
            raise bad("class_counts")
        if not all(size(c) for c in self.class_counts):
            raise bad("class_counts")
        if self.label_kind not in LABEL_KINDS or (self.format_version == 1 and self.label_kind != "class"):
            raise bad("label_kind")
        if self.label_kind == "none" and self.classes:
            raise bad("classes")
        if not (
            isinstance(self.targets, list)
            and all(isinstance(t, str) and t for t in self.targets)
            and len(set(self.targets)) == len(self.targets)
            and (self.format_version > 1 or not self.targets)
        ):
            raise bad("targets")
        texts = (
            self.digest,
            self.inputs,
            self.index_digest,
            self.codec,
            self.packer_version,
            self.labels_digest,
            self.sources_digest,
            self.manifest_digest,
        )
        if not all(isinstance(v, str) for v in texts) or not isinstance(self.shards, list):
            raise bad("digest/shards")
        if not isinstance(self.options, dict):
            raise bad("options")
        for s in self.shards:
            file = s.get("file") if isinstance(s, dict) else None
            if not (
                isinstance(file, str)
                and file == os.path.basename(file)
                and file[:1] not in ("", ".")
                and "\0" not in file
                and size(s.get("count"))
                and size(s.get("bytes"))
                and size(s.get("segment", 0))
                and size(s.get("dead", 0))
            ):
                raise bad("shards")
        if not LAYOUTS[self.backend].check_manifest(self):
            raise bad("shards")
        try:
            declared = self.declared if isinstance(self.fields, list) else None
        except ValueError:
            declared = None
        if declared is None or bool(declared) != (self.format_version == FIELDS_VERSION):
            raise bad("fields")
        if declared and any(f.kind == "label" for f in declared) == (self.label_kind == "none"):
            raise bad("fields")
        counts = self.field_counts
        if not (
            isinstance(counts, dict)
            and set(counts) <= {f.name for f in self.record_fields}
            and all(
                isinstance(c, dict)
                and size(c.get("records"))
                and c["records"] <= self.count
                and size(c.get("items"))
                and _per_record(c.get("per_record", {}), self.count)
                and _per_class(c.get("per_class", {}), c["items"])
                for c in counts.values()
            )
        ):
            raise bad("field_counts")

    @functools.cached_property
    def declared(self) -> tuple[Field, ...]:
        """The fields, parsed and checked (ValueError); not a dataclass field, never written."""
        return declare(self.fields)

    @property
    def record_fields(self) -> tuple[Field, ...]:
        """The fields whose payloads each record holds after its image (empty: records are images)."""
        return record_fields(self.declared)


#: A number of boxes as ``field_counts``' ``per_record`` keys spell it: ASCII digits, no leading zero,
#: at most 18 (below 2**60: a record's bytes fit the index's u8 length, a box is 16 of them).
_BOX_COUNT = re.compile(r"0|[1-9][0-9]{0,17}")


def _per_record(per: Any, count: int) -> bool:
    """Whether ``per`` is a boxes-per-record histogram a reader can trust (``packer info`` draws it
    without expanding it): ``{"<boxes>": records}``, keys as :data:`_BOX_COUNT` says, the records
    adding up to at most the dataset's ``count`` (a manifest's numbers are untrusted)."""
    if not isinstance(per, dict) or len(per) > count:
        return False
    total = 0
    for k, n in per.items():
        if not (isinstance(k, str) and _BOX_COUNT.fullmatch(k) and isinstance(n, int) and not isinstance(n, bool)):
            return False
        if n < 0:
            return False
        total += n
    return total <= count


#: A box label id as ``field_counts``' ``per_class`` keys spell it: an int32 in decimal.
_LABEL_ID = re.compile(r"-?(0|[1-9][0-9]{0,9})")


def _per_class(per: Any, items: int) -> bool:
    """Whether ``per`` is a boxes-per-category count a reader can trust: ``{"<label id>": boxes}``,
    the boxes adding up to the field's ``items`` (its labels in all)."""
    if not isinstance(per, dict) or len(per) > items:
        return False
    for k, n in per.items():
        if not (isinstance(k, str) and _LABEL_ID.fullmatch(k) and isinstance(n, int) and not isinstance(n, bool)):
            return False
        if n < 1:
            return False
    return not per or sum(per.values()) == items


def written_version(fields: list[dict[str, Any]]) -> int:
    """The ``format_version`` packer writes for a dataset declaring ``fields`` (manifest entries):
    4 with fields, else 3, so that a dataset without them is what it always was."""
    return FIELDS_VERSION if fields else FORMAT_VERSION


class Digest:
    """Version 1 and 2's content digest: sha256 of label, length and bytes per record in order, and
    the label arrays' digest when there are any. Kept to check datasets of those versions; version 3
    digests the logical content instead (:func:`logical_digest`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, label: int, data: bytes | memoryview) -> None:
        self._h.update(struct.pack("<qQ", label, len(data)))
        self._h.update(data)

    def hexdigest(self, labels_digest: str = "") -> str:
        return with_labels("sha256:" + self._h.hexdigest(), labels_digest)


def with_labels(records: str, labels_digest: str) -> str:
    """The manifest's ``digest`` from the records' digest and, when the dataset has label arrays
    (``labels_digest``), theirs: the sha256 of both, so that it covers everything a reader returns."""
    if not labels_digest:
        return records
    return "sha256:" + hashlib.sha256(f"{records}\0{labels_digest}".encode("ascii")).hexdigest()


#: What version 3's digest covers per record, packed little-endian (28 bytes a record).
LOGICAL_DTYPE = np.dtype([("label", "<i8"), ("length", "<u8"), ("crc32", "<u4"), ("height", "<u4"), ("width", "<u4")])


def logical_digest(index: np.ndarray, labels_digest: str = "") -> str:
    """Version 3's ``digest``: sha256 over each record's label, length, CRC-32, height and width in
    index order (:data:`LOGICAL_DTYPE`), with the label arrays' digest (:func:`with_labels`). It needs
    the index only, never the record bytes, and not where they lie: a refresh that keeps old records in
    their data files digests exactly as a full rebuild of the same input. ``packer verify`` checks every
    record's bytes against its CRC-32, so the digest still vouches for them."""
    h = hashlib.sha256()
    step = 1 << 16
    for start in range(0, len(index), step):
        rows = index[start : start + step]
        packed = np.empty(len(rows), LOGICAL_DTYPE)
        for name in LOGICAL_DTYPE.names or ():
            packed[name] = rows[name]
        h.update(packed.data)
    return with_labels("sha256:" + h.hexdigest(), labels_digest)


_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj: Any, **options: Any) -> str:
    """``json.dumps(obj)`` with UTF-8 left readable, yet valid UTF-8: a file name's undecodable bytes
    (os.fsdecode's lone surrogates, which UTF-8 cannot encode) become ``\\udcXX`` escapes, as in
    manifest.json, which ``json.loads`` then ``os.fsencode`` turn back into the very same bytes."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(obj, ensure_ascii=False, **options))


def manifest_digest(fields: dict[str, Any]) -> str:
    """sha256 of a manifest's keys and values except ``manifest_digest`` itself, as compact JSON
    with sorted keys (keys a later packer adds are covered too)."""
    rest = {k: v for k, v in fields.items() if k != "manifest_digest"}
    text = json.dumps(rest, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def index_digest(rows: np.ndarray) -> str:
    """sha256 of an array's bytes: the index rows (whose ``src_*`` identity fields nothing else
    checks) or the source-path blob."""
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(rows).view(np.uint8).data).hexdigest()


def open_regular(path: str | os.PathLike, dir_fd: Optional[int] = None, label: str | os.PathLike = "") -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file, itself: a dataset's
    files are its own, so a symlink (to another dataset's data file, to a device) is never followed.
    Opened non-blocking, so a FIFO put in a dataset's place cannot hang the open, and checked before
    any read, so a device (/dev/zero) is never read. FileNotFoundError passes through for the caller
    to word; ``label`` names the file in the error (``path`` relative to ``dir_fd`` otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise DatasetError(f"{label or path}: is a symbolic link, not a regular file; refusing to read it") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = {
            stat.S_IFIFO: "a FIFO",
            stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket",
            stat.S_IFDIR: "a directory",
        }.get(stat.S_IFMT(mode), "not a file")
        raise DatasetError(f"{label or path}: is {kind}, not a regular file; refusing to read it")
    return fd


def fd_path(fd: int) -> Optional[str]:
    """A path that opens the file open as ``fd`` itself, wherever it is now, deleted or not
    (/proc/self/fd/N on Linux, /dev/fd/N on macOS), for code that opens files by name (liblmdb);
    None where the system has neither."""
    for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
        if os.path.exists(path):
            return path
    return None


#: numpy parses an .npy header with ast.literal_eval, whose recursion-depth count CPython 3.11 keeps
#: per interpreter, unlocked: two threads parsing at once can fail with "SystemError: AST constructor
#: recursion depth mismatch" (python/cpython#106905). Headers are parsed one at a time.
_NPY_HEADERS = threading.Lock()


def read_npy_header(head: io.BytesIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The (shape, fortran order, dtype) of the .npy file whose start ``head`` holds, parsed by numpy
    (no pickle, no code), its position left at the data."""
    version = np.lib.format.read_magic(head)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    with _NPY_HEADERS:
        return read_header(head)


def map_npy(fd: int, path: str | os.PathLike) -> np.ndarray:
    """The array of the .npy file open as ``fd``, memory-mapped read-only (a descriptor, not a path:
    the file a reader pinned, even after it was deleted). The header is parsed by numpy's own
    parser with pickled (object) dtypes refused, and the data must fit in the file: a hostile shape
    allocates nothing."""
    try:
        head = io.BytesIO(os.pread(fd, 1 << 16, 0))
        shape, fortran, dtype = read_npy_header(head)
        if dtype.hasobject or fortran:
            raise ValueError(f"dtype {dtype} (fortran order {fortran}) is not a plain array")
        start, size = head.tell(), os.fstat(fd).st_size
        items = math.prod(shape)
        if start + items * dtype.itemsize > size:
            raise ValueError(f"{items} items of {dtype.itemsize} bytes do not fit in {size} bytes")
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except Exception as e:  # a tampered header fails numpy's parser in many ways (ValueError, SyntaxError,
        # tokenize.TokenError, OverflowError, ...); the file is at fault, and no code ran
        raise DatasetError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    return np.ndarray(shape, dtype, buffer=mm, offset=start)


def load_index(root: str | os.PathLike, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """Load and bounds-check the index and the source-path blob (never pickled, memory-mapped)."""
    root = Path(root)
    arrays = []
    for name in (INDEX, SOURCES):
        try:
            fd = open_regular(root / name)
        except OSError as e:
            raise DatasetError(f"{root}: unreadable index ({type(e).__name__}: {e})") from None
        try:
            arrays.append(map_npy(fd, root / name))
        finally:
            os.close(fd)
    index, sources = arrays
    check_index(root, index, sources, manifest)
    return index, sources


def check_index(root: Path, index: np.ndarray, sources: np.ndarray, manifest: Manifest) -> None:
    """The index and path blob's types, and the rows' consistency with the manifest."""
    if index.dtype != INDEX_DTYPE or index.ndim != 1:
        raise DatasetError(f"{root / INDEX}: unexpected dtype {index.dtype} / shape {index.shape}")
    if sources.dtype != np.uint8 or sources.ndim != 1:
        raise DatasetError(f"{root / SOURCES}: unexpected dtype {sources.dtype} / shape {sources.shape}")
    if len(index) != manifest.count:
        raise DatasetError(f"{root}: index has {len(index)} rows, manifest says {manifest.count}")
    _check_rows(root, index, sources, manifest)


def _check_rows(root: Path, index: np.ndarray, sources: np.ndarray, manifest: Manifest) -> None:
    """Reject rows that would read outside their shard or the path blob, or carry impossible sizes
    (a stored image's short edge is at most ``short_edge``, a JPEG's long one at most 65,535, a raw
    record's length is height x width x 3: a tampered height or width cannot make a reader allocate
    more than the image could hold)."""
    if len(index) == 0:
        return
    labels = index["label"]
    if manifest.label_kind != "class" and (labels != -1).any():
        raise DatasetError(f"{root}: index has labels other than -1 in a {manifest.label_kind!r}-labelled dataset")
    if manifest.label_kind == "class" and (labels.min() < 0 or labels.max() >= len(manifest.classes)):
        raise DatasetError(f"{root}: index has labels outside 0..{len(manifest.classes) - 1}")
    src_end = index["src_offset"].astype(np.uint64) + index["src_length"]
    if (src_end > len(sources)).any() or (index["src_offset"] > len(sources)).any():
        raise DatasetError(f"{root}: index points outside {SOURCES}")
    fmt = FORMATS[manifest.format]
    table = 8 * (len(manifest.record_fields) + 1) if manifest.record_fields else 0
    wrong = fmt.wrong_lengths(index, table)
    if wrong.any():
        first = int(np.flatnonzero(wrong)[0])
        rule = fmt.length_rule if not table else f"at least its {table}-byte field table and its image"
        raise DatasetError(f"{root}: record {first}: length does not match {rule or 'the format'}")
    if (index["height"] == 0).any() or (index["width"] == 0).any():
        raise DatasetError(f"{root}: index has records of zero size")
    short, long = np.minimum(index["height"], index["width"]), np.maximum(index["height"], index["width"])
    impossible = (short > manifest.short_edge) | (long > fmt.max_edge)
    if impossible.any():
        first = int(np.flatnonzero(impossible)[0])
        raise DatasetError(
            f"{root}: record {first}: stored size {int(index[first]['height'])} x "
            f"{int(index[first]['width'])} is impossible (short edge over {manifest.short_edge}, "
            f"or an edge over {fmt.max_edge}, the most a {fmt.name} record holds)"
        )
    LAYOUTS[manifest.backend].check_places(root, index, manifest)


def load_label_arrays(
    root: str | os.PathLike, manifest: Manifest, open_file: Optional[Callable[[str], int]] = None
) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """The multi-hot rows (LABELS, "multi" datasets) and TARGETS, memory-mapped and checked: shape,
    dtype, no bits beyond the last class, finite targets. None for what the dataset does not have.
    ``open_file(name)`` opens them (packer.backends.pin: the pinned version's), else :func:`open_regular`."""
    root = Path(root)
    wanted = [
        (LABELS, np.uint8, (len(manifest.classes) + 7) // 8, manifest.label_kind == "multi"),
        (TARGETS, np.float32, len(manifest.targets), bool(manifest.targets)),
    ]
    out: list[Optional[np.ndarray]] = []
    for name, dtype, columns, present in wanted:
        if not present:
            out.append(None)
            continue
        path = root / name
        try:
            fd = open_file(name) if open_file is not None else open_regular(path)
        except FileNotFoundError:
            raise DatasetError(f"{path}: missing (the manifest says the dataset has it)") from None
        try:
            a = map_npy(fd, path)
        finally:
            os.close(fd)
        if a.dtype != dtype or a.shape != (manifest.count, columns):
            raise DatasetError(
                f"{path}: unexpected dtype {a.dtype} / shape {a.shape} "
                f"(expected {np.dtype(dtype)} / {(manifest.count, columns)})"
            )
        out.append(a)
    multi, targets = out
    spare = (-len(manifest.classes)) % 8
    if multi is not None and spare and (np.asarray(multi[:, -1]) >> (8 - spare)).any():
        raise DatasetError(f"{root / LABELS}: bits set beyond the last of {len(manifest.classes)} classes")
    if targets is not None and not np.isfinite(targets).all():
        first = int(np.flatnonzero(~np.isfinite(targets).all(axis=1))[0])
        raise DatasetError(f"{root / TARGETS}: record {first} has a target that is not a finite number")
    return multi, targets


def disk_bytes(root: str | os.PathLike) -> int:
    """Bytes of the dataset's files on disk (data, index, manifest, report)."""
    return sum(p.stat().st_size for p in Path(root).iterdir() if p.is_file())


def source_path(sources: np.ndarray, row: np.void) -> str:
    """The source path as the build wrote it: bytes that are not UTF-8 come back as the surrogates
    the build encoded them from (``surrogateescape``), so ``os.fsencode`` gives the original name."""
    start = int(row["src_offset"])
    return bytes(sources[start : start + int(row["src_length"])]).decode("utf-8", "surrogateescape")


class Layout:
    """One backend's layout rules, pure functions of a manifest and its index (no I/O): which data
    files the dataset has, where each row's record lies, which manifests and rows are possible.
    Each backend (packer.backends) is its layout plus the code that writes and reads it; the
    checks here run while a manifest or index is loaded, before any backend code. ``name``: the
    backend's, as manifests and ``--backend`` spell it."""

    name = ""

    def data_files(self, manifest: Manifest) -> list[str]:
        """The dataset's data files, numbered as index rows' ``shard`` numbers them."""
        return [str(s["file"]) for s in manifest.shards]

    def record_places(
        self, manifest: Manifest, index: np.ndarray, rows: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows``' (all when None) data file number and position in it."""
        at = index if rows is None else index[rows]
        return at["shard"].astype(np.int64), at["offset"].astype(np.int64)

    def lists_files(self, manifest: Manifest) -> bool:
        """Whether ``manifest.shards`` lists the data files with their counts and sizes."""
        return True

    def check_places(self, root: Path, index: np.ndarray, manifest: Manifest) -> None:
        """Refuse rows that point outside what their data files can hold (DatasetError)."""
        raise NotImplementedError

    def check_manifest(self, manifest: Manifest) -> bool:
        """Whether the manifest's data file list is possible for this backend: data file k has the
        name this backend's writers give file k, so no name is another file of the dataset's
        (index.npy, manifest.json) and a refresh's new files, numbered after the old ones, never
        take one that the old version uses."""
        return True


def listed_sizes(root: Path, index: np.ndarray, manifest: Manifest) -> np.ndarray:
    """Each row's data file size as the manifest lists it (rows naming a file beyond the list refused)."""
    if index["shard"].max() >= len(manifest.shards):
        raise DatasetError(f"{root}: index names data files beyond the {len(manifest.shards)} listed")
    return np.array([int(s["bytes"]) for s in manifest.shards], dtype=np.uint64)[index["shard"]]


def bytes_per_file(number: np.ndarray, lengths: np.ndarray, files: int) -> np.ndarray:
    """The sum of ``lengths`` per data file ``number`` (0 to ``files - 1``): the record bytes rows
    point to in each file (int64: float weights would round big sums)."""
    total = np.zeros(files, np.int64)
    np.add.at(total, number, lengths.astype(np.int64))
    return total


class LmdbLayout(Layout):
    """LMDB: one file per segment (data.mdb, data-NNNNN.mdb), record ``i`` under key ``offset`` of
    file ``shard``; versions 1 and 2: data.mdb alone, record ``i`` under key ``i``."""

    name = "lmdb"

    def data_files(self, manifest: Manifest) -> list[str]:
        return [LMDB_DATA] if manifest.format_version < 3 else super().data_files(manifest)

    def record_places(
        self, manifest: Manifest, index: np.ndarray, rows: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if manifest.format_version >= 3:
            return super().record_places(manifest, index, rows)
        at = np.arange(len(index), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        return np.zeros(len(at), np.int64), at

    def lists_files(self, manifest: Manifest) -> bool:
        return manifest.format_version >= 3

    def check_manifest(self, manifest: Manifest) -> bool:
        if manifest.format_version < 3:  # data.mdb alone, whatever the list says
            return True
        return bool(manifest.shards) and all(  # data.mdb at least; file k is segment k's name
            s["file"] == lmdb_segment_name(k) for k, s in enumerate(manifest.shards)
        )

    def check_places(self, root: Path, index: np.ndarray, manifest: Manifest) -> None:
        if manifest.format_version < 3:
            if index["shard"].any() or index["offset"].any():
                raise DatasetError(f"{root}: LMDB index rows must have shard 0 and offset 0")
            return
        beyond = index["offset"] >= listed_sizes(root, index, manifest) // 16  # a leaf entry takes over 16 bytes
        if beyond.any():
            raise DatasetError(f"{root}: record {int(np.flatnonzero(beyond)[0])}: key beyond what its segment can hold")


class MemmapLayout(Layout):
    """memmap: shards of ``shard_size`` records, record ``i`` at byte ``offset`` of shard ``shard``."""

    name = "memmap"

    def check_places(self, root: Path, index: np.ndarray, manifest: Manifest) -> None:
        sizes = listed_sizes(root, index, manifest)
        end = index["offset"] + index["length"]
        if (end < index["offset"]).any() or (end > sizes).any():
            first = int(np.flatnonzero((end < index["offset"]) | (end > sizes))[0])
            raise DatasetError(f"{root}: record {first} points outside its shard")

    def check_manifest(self, manifest: Manifest) -> bool:
        return all(s["file"] == shard_name(k) for k, s in enumerate(manifest.shards))


#: Every backend's layout by the name manifests use (packer.backends.BACKENDS: the same names, and each
#: backend is its layout).
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (LmdbLayout(), MemmapLayout())}
