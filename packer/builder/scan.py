"""Walk raw/ into a sorted list of labelled sources, and account for every file it will not use.

A depth-first walk with each folder's entries sorted by name makes the record order, and so the
digest, independent of the filesystem and of the number of workers. Symlinked directories are followed
once (by device and inode), so a link back up the tree cannot loop. Only regular files are ever opened
(a symlink is judged by its target: one named ``x.jpg`` pointing at a FIFO or ``/dev/zero`` is ignored,
never read).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import unicodedata
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO, Optional, overload

import numpy as np

from ..errors import ScanError
from ..format import IDENTITY_DTYPE
from ..format.label_arrays import pack
from .labels import Labelling, class_list, read_classes, read_csv

IMAGE_EXTENSIONS = frozenset(
    [
        ".jpg",
        ".jpeg",
        ".jpe",
        ".jfif",
        ".png",
        ".webp",
        ".tif",
        ".tiff",
        ".bmp",
        ".gif",
        ".heic",
        ".heif",
        ".ppm",
        ".pgm",
        ".pbm",
    ]
)


@dataclass(frozen=True, slots=True)
class Source:
    rel: str  # POSIX path relative to raw/
    label: int  # class id; -1 for kinds "multi" and "none" (see packer.builder.labels)


_CHUNK = 1 << 16  # items a lazy iteration turns into Python objects at a time


def _encode(rel: str) -> bytes:
    return rel.encode("utf-8", "surrogateescape")  # the journal's and sources.npy's encoding


class Paths(Sequence[str]):
    """Relative paths held as one UTF-8 blob plus offsets: a fraction of a list of str's memory (a
    million-file scan: docs/PERFORMANCE.md, "Compact scan"). Items are decoded as they are read; a
    slice shares the blob."""

    __slots__ = ("_at", "blob", "offsets")

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        self.blob = blob
        self.offsets = offsets  # int64, len + 1 entries: item i is blob[offsets[i]:offsets[i + 1]]
        self._at = offsets.data  # a memoryview: a Python int per read, far cheaper than numpy indexing

    @classmethod
    def of(cls, rels: Iterable[str]) -> Paths:
        builder = PathsBuilder()
        for rel in rels:
            builder.add(rel)
        return builder.paths()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Paths: ...
    def __getitem__(self, i: int | slice) -> str | Paths:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            assert step == 1, "contiguous slices only"
            return Paths(self.blob, self.offsets[start : max(start, stop) + 1])
        return self.encoded(i).decode("utf-8", "surrogateescape")

    def encoded(self, i: int) -> bytes:
        """Item ``i`` as the journal stores it."""
        at = self._at
        if i < 0:
            i += len(at) - 1
        if not 0 <= i < len(at) - 1:
            raise IndexError(i)
        return self.blob[at[i] : at[i + 1]]

    def encoded_items(self) -> Iterator[bytes]:
        for start in range(0, len(self), _CHUNK):
            ends = self.offsets[start : start + _CHUNK + 1].tolist()
            for a, b in pairwise(ends):
                yield self.blob[a:b]

    def __iter__(self) -> Iterator[str]:
        for rel in self.encoded_items():
            yield rel.decode("utf-8", "surrogateescape")

    def select(self, mask: np.ndarray) -> Paths:
        """The items where ``mask`` is true, in a blob of their own."""
        if mask.all():
            return self
        if not mask.any():
            return Paths(b"", np.zeros(1, dtype=np.int64))
        first, lengths = int(self.offsets[0]), np.diff(self.offsets)
        blob = np.frombuffer(self.blob, dtype=np.uint8, count=int(self.offsets[-1]) - first, offset=first)
        offsets = np.zeros(int(mask.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths[mask], out=offsets[1:])
        return Paths(blob[np.repeat(mask, lengths)].tobytes(), offsets)


class PathsBuilder:
    """Appends paths straight into the blob, so that no list of a million str exists on the way."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.ends = array("q", [0])

    def add(self, rel: str) -> None:
        self.blob += _encode(rel)
        self.ends.append(len(self.blob))

    def paths(self) -> Paths:
        return Paths(bytes(self.blob), np.array(self.ends, dtype=np.int64))


class Sources(Sequence[Source]):
    """The scan's sources in order: :class:`Paths` and a label array, a :class:`Source` made per item
    as it is read (never a million of them held)."""

    __slots__ = ("labels", "paths")

    def __init__(self, paths: Paths, labels: np.ndarray) -> None:
        assert len(paths) == len(labels)
        self.paths, self.labels = paths, labels  # labels: int32, one per source

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, i: int) -> Source: ...
    @overload
    def __getitem__(self, i: slice) -> Sources: ...
    def __getitem__(self, i: int | slice) -> Source | Sources:
        if isinstance(i, slice):
            return Sources(self.paths[i], self.labels[i])
        return Source(self.paths[i], int(self.labels[i]))

    def rel(self, i: int) -> str:
        return self.paths[i]

    def __iter__(self) -> Iterator[Source]:
        for start in range(0, len(self), _CHUNK):
            part = self[start : start + _CHUNK]
            yield from map(Source, part.paths, part.labels.tolist())

    def select(self, mask: np.ndarray) -> Sources:
        return Sources(self.paths.select(mask), self.labels[mask])


@dataclass
class Scan:
    sources: Sources
    classes: list[str]
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (rel path, reason)
    # skipped before decoding: listed in --labels but not on disk, or a label not in --classes
    missing: list[tuple[str, str]] = field(default_factory=list)
    identity: Optional[np.ndarray] = None  # IDENTITY_DTYPE, one row per source (see identify)
    unreadable: list[tuple[str, str]] = field(
        default_factory=list
    )  # folders among ``ignored`` that could not be listed
    kind: str = "class"  # label kind (packer.builder.labels)
    target_names: list[str] = field(default_factory=list)  # --targets columns
    multi: Optional[np.ndarray] = None  # kind "multi": bit-packed multi-hot row per source
    targets: Optional[np.ndarray] = None  # float32 row per source, with --targets
    notes: list[str] = field(default_factory=list)  # things the user should hear (unused CSV columns)

    def identities(self) -> np.ndarray:
        """``identity``, which the build fills in (identify) before anything reads it."""
        assert self.identity is not None, "identify() the sources first"
        return self.identity

    @property
    def scanned(self) -> int:
        return len(self.sources) + len(self.ignored) + len(self.missing)

    def fingerprint(self, identity: bool = False) -> str:
        """Identifies the input list, so that --resume refuses a raw/ that changed meanwhile.

        With ``identity``, also every source's size, mtime and hash and the ignored and missing
        entries: everything a dataset's content and report depend on, which --update compares.
        (--resume must not: a file fixed in place after a failed build is the point of resuming.)
        """
        h = hashlib.sha256()
        labels = self.sources.labels
        for start in range(0, len(labels), _CHUNK):  # f"{rel}\0{label}\n" per source, joined per chunk
            rels = self.sources.paths[start : start + _CHUNK].encoded_items()
            h.update(b"".join(b"%s\0%d\n" % line for line in zip(rels, labels[start : start + _CHUNK].tolist())))
        h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
        for extra in (self.multi, self.targets):
            if extra is not None:
                h.update(np.ascontiguousarray(extra).view(np.uint8).data)
        if identity:
            assert self.identity is not None, "identify() the sources first"
            h.update(np.ascontiguousarray(self.identity).view(np.uint8).data)
            for rel, reason in self.ignored + self.missing:
                h.update(f"\n{rel}\0{reason}".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def subset(self, mask: np.ndarray, keep: Callable[[str], bool]) -> Scan:
        """The sources where ``mask`` is true and the ignored and missing entries whose path ``keep``
        accepts, with the same classes."""
        return replace(
            self,
            sources=self.sources.select(mask),
            ignored=[e for e in self.ignored if keep(e[0])],
            missing=[e for e in self.missing if keep(e[0])],
            **{
                name: getattr(self, name)[mask]
                for name in ("identity", "multi", "targets")
                if getattr(self, name) is not None
            },
        )


def open_source(path: str) -> BinaryIO:
    """The source image ``path`` opened for reading if it is a regular file, else OSError (the file
    is skipped): never blocks on a FIFO or streams a device that replaced a file after the scan
    (opened non-blocking, checked, then made blocking again). A symlink is followed, as the scan
    follows it; a dataset's own files are opened by :func:`packer.format.open_regular` instead."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _content_hash(path: str, stop: threading.Event) -> int:
    """64-bit BLAKE2b of the file's bytes (0 when unreadable: such a file is skipped anyway, or when
    ``stop`` is set: the build is being interrupted)."""
    h = hashlib.blake2b(digest_size=8)
    try:
        with open_source(path) as f:
            while chunk := f.read(1 << 20):
                if stop.is_set():
                    return 0
                h.update(chunk)
    except OSError:
        return 0
    return int.from_bytes(h.digest(), "little")


def identify(root: str | os.PathLike, sources: Sources, checksum: bool = False) -> np.ndarray:
    """Each source's size and mtime (ns), and with ``checksum`` a content hash (``src_hash``, else 0).

    Stored in every index row, so that ``build --update`` can tell which files are unchanged. Hashing
    reads every file; threads overlap the reads (hashlib releases the GIL on large buffers).
    """
    n = len(sources)
    sizes, mtimes = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    # relative to an open raw/: no million joined paths held at once, shorter lookups
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, rel in enumerate(sources.paths):
            try:
                st = os.stat(rel, dir_fd=root_fd)
            except OSError:  # a broken symlink: it is skipped at decode time, never reused
                continue
            sizes[i], mtimes[i] = st.st_size, st.st_mtime_ns
    finally:
        os.close(root_fd)
    out = np.zeros(n, IDENTITY_DTYPE)
    out["src_size"], out["src_mtime_ns"] = sizes, mtimes
    if checksum:
        # Ctrl-C or SIGTERM while the threads hash: queued files are dropped and running ones stop at
        # their next MiB, so the build stops within moments however large the files are.
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4))
        try:
            for i in range(0, n, 4096):  # batches: map() would queue a future per file at once
                paths = [os.path.join(root, rel) for rel in sources.paths[i : i + 4096]]
                out["src_hash"][i : i + 4096] = list(pool.map(partial(_content_hash, stop=stop), paths))
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
    return out


def _not_regular(entry: os.DirEntry) -> Optional[str]:
    """Why ``entry`` (its target, for a symlink) is not a file to open: "FIFO", "symlink to a character
    device", ...; None for a regular file or a broken link (skipped as unreadable when decoded)."""
    if not entry.is_symlink() and entry.is_file(follow_symlinks=False):
        return None  # the directory entry's own type says so: no stat call per file
    try:
        mode = entry.stat(follow_symlinks=True).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    kind = next((name for is_kind, name in kinds if is_kind(mode)), "special file")
    return f"symlink to a {kind}" if entry.is_symlink() else kind


def confusable(names: list[str]) -> list[tuple[str, str]]:
    """Pairs of names that are equal after Unicode NFC normalization and case folding ("Café" typed
    two ways, "Cats" and "cats"): distinct classes that a person reads as one."""
    first: dict[str, str] = {}
    pairs = []
    for name in names:
        key = unicodedata.normalize("NFC", name).casefold()
        if key in first:
            pairs.append((first[key], name))
        else:
            first[key] = name
    return pairs


@dataclass
class _Tree:
    """What the walk found: the candidate image files in order, and for each the index of its top
    folder (``tops``, -1 for a file directly in raw/) among ``top_names``."""

    files: Paths
    tops: np.ndarray
    top_names: list[str]
    ignored: list[tuple[str, str]]
    unreadable: list[tuple[str, str]]  # folders that could not be listed (also among ``ignored``)


def _walk(root: Path) -> _Tree:
    """All candidate image files (sorted), the ignored entries, and the folders that could not be
    listed; symlinked folders are followed once."""
    files = PathsBuilder()
    tops = array("i")
    top_names: list[str] = []
    ignored: list[tuple[str, str]] = []
    unreadable: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()

    def visit(directory: str, rel: str, top: int) -> None:
        """``rel``: the folder's path relative to raw/ with a trailing "/" ("" for raw/ itself); plain
        strings, as a million files' worth of path objects cost seconds (docs/PERFORMANCE.md)."""
        try:
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen:
                ignored.append((rel, "directory already visited (symlink loop or duplicate link)"))
                return
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:  # no permission, an I/O error, removed during the scan, a path too long
            if not rel:
                raise ScanError(f"{directory}: cannot read the raw folder ({e.strerror or e})") from None
            why = (rel, f"unreadable directory ({e.strerror or e})")
            ignored.append(why)
            unreadable.append(why)
            return
        for entry in entries:
            child = rel + entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if entry.name.startswith("."):
                ignored.append((f"{child}/" if is_dir else child, "hidden"))
            elif is_dir:
                if not rel:
                    top_names.append(entry.name)
                visit(entry.path, child + "/", len(top_names) - 1 if not rel else top)
            elif os.path.splitext(entry.name)[1].lower() not in IMAGE_EXTENSIONS:
                ignored.append((child, "not an image extension"))
            elif kind := _not_regular(entry):
                ignored.append((child, f"not a regular file ({kind})"))  # never opened
            else:
                files.add(child)  # a broken symlink is an image we cannot read: skipped, reported
                tops.append(top)

    visit(str(root), "", -1)
    return _Tree(files.paths(), np.array(tops, dtype=np.int32), top_names, ignored, unreadable)


def scan(
    raw_dir: str | os.PathLike,
    labels_csv: str | os.PathLike | None = None,
    labelling: Optional[Labelling] = None,
    strict: bool = False,
) -> Scan:
    """The sources under ``raw_dir`` and their labels (folders, or ``labels_csv``) as ``labelling`` says.

    A label not in ``--classes``: with ``strict`` (``--on-error fail``) an error, else the file is
    skipped with that reason (in ``missing``). A bad labels CSV or class list raises LabelError.
    """
    labelling = labelling or Labelling()
    labelling.check(labels_csv)
    root = Path(raw_dir)
    if not root.is_dir():
        raise ScanError(f"{raw_dir}: raw folder does not exist or is not a directory")
    pinned = read_classes(labelling.classes) if labelling.classes else None
    tree = _walk(root)
    ignored, missing, notes = tree.ignored, [], []
    multi = targets = None
    if labels_csv is not None:
        rows, unused = read_csv(labels_csv, labelling)
        if unused:
            notes.append(
                f"{labels_csv}: column(s) {', '.join(map(repr, unused))} not used "
                f"(--targets COL stores numeric columns)"
            )
        files = list(tree.files)  # a labels CSV already costs a dict entry per file
        on_disk = set(files) | {rel for rel, _ in ignored}  # an ignored file is reported once, as ignored
        ignored += [(f, "not listed in the labels file") for f in files if f not in rows]
        missing = [(p, "listed in the labels file but not found under raw/") for p in sorted(rows) if p not in on_disk]
        files = [f for f in files if f in rows]
        named, where = [rows[f].names for f in files], [rows[f].where for f in files]
        classes = class_list(named, where, pinned, integers=True)
        keep, sets, rejected = _class_ids(
            files, named, where, classes, lambda name: f"label {name!r} is not in --classes {labelling.classes}", strict
        )
        label = [s[0] for s in sets] if labelling.kind == "class" else [-1] * len(keep)
        sources = Sources(Paths.of(keep), np.array(label, dtype=np.int32))
        multi = pack(sets, len(classes)) if labelling.kind == "multi" else None
        if labelling.targets:
            targets = np.array([rows[f].targets for f in keep], dtype=np.float32).reshape(
                len(keep), len(labelling.targets)
            )
    elif labelling.unlabeled:
        sources, classes, rejected = Sources(tree.files, np.full(len(tree.files), -1, dtype=np.int32)), [], []
    else:
        sources, classes, rejected = _by_folder(root, tree, pinned, labelling.classes, strict)
    return Scan(
        sources,
        classes,
        sorted(ignored),
        sorted(missing + rejected),
        unreadable=tree.unreadable,
        kind=labelling.kind,
        target_names=list(labelling.targets),
        multi=multi,
        targets=targets,
        notes=notes,
    )


def _by_folder(
    root: Path, tree: _Tree, pinned: Optional[list[str]], classes_file: Optional[str], strict: bool
) -> tuple[Sources, list[str], list[tuple[str, str]]]:
    """Class folders: each file's class is its top folder (computed per folder, not per file). The
    sources, the class names, and the files whose folder is not in ``pinned`` (with ``strict``: an
    error at the first); files directly in raw/ join ``tree.ignored``."""
    inside = tree.tops >= 0
    tree.ignored += [(rel, "not inside a class folder") for rel in tree.files.select(~inside)]
    files, tops = tree.files.select(inside), tree.tops[inside]
    used = [tree.top_names[t] for t in np.unique(tops).tolist()]  # folders with files
    # A class folder that cannot be listed stays a class (with no files this time), so that the ids
    # of the classes after it do not shift under a refresh that goes on without it (--on-error skip).
    unlisted = sorted({rel.rstrip("/") for rel, _ in tree.unreadable if rel.count("/") == 1})
    names = used + unlisted
    classes = class_list([(n,) for n in names], [f"{root / n}/" for n in names], pinned, integers=False)
    ids = {c: i for i, c in enumerate(classes)}
    label = np.array([ids.get(n, -1) for n in tree.top_names], dtype=np.int32)[tops]
    ok = label >= 0
    rejected: list[tuple[str, str]] = []
    if not ok.all():

        def unknown(t: int) -> str:
            return f"class folder {tree.top_names[t]!r} is not in --classes {classes_file}"

        bad = tops[~ok].tolist()
        if strict:
            raise ScanError(f"{root / tree.top_names[bad[0]]}/: {unknown(bad[0])} (--on-error fail)")
        rejected = [(rel, unknown(t)) for rel, t in zip(files.select(~ok), bad)]
    return Sources(files.select(ok), label[ok]), classes, rejected


def _class_ids(
    files: list[str],
    named: list[tuple[str, ...]],
    where: list[str],
    classes: list[str],
    unknown: Callable[[str], str],
    strict: bool,
) -> tuple[list[str], list[list[int]], list[tuple[str, str]]]:
    """The files whose label names are all in ``classes``, their class ids, and the others with the
    reason (``unknown(name)`` and the CSV row); with ``strict`` the first other one is an error."""
    ids = {c: i for i, c in enumerate(classes)}
    keep: list[str] = []
    sets: list[list[int]] = []  # read-only: files with the same label names share one list
    shared: dict[tuple[str, ...], list[int]] = {}
    rejected: list[tuple[str, str]] = []
    for f, names, at in zip(files, named, where):
        bad = next((n for n in names if n not in ids), None)
        if bad is None:
            keep.append(f)
            if (class_ids := shared.get(names)) is None:
                class_ids = shared[names] = [ids[n] for n in names]
            sets.append(class_ids)
        elif strict:
            raise ScanError(f"{at}: {unknown(bad)} (--on-error fail)")
        else:
            rejected.append((f, f"{unknown(bad)} ({at})"))
    return keep, sets, rejected
