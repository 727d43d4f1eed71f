"""Segments: a refresh (``build --update``) that costs what changed (``packer compact``: packer.tools.compact).

A dataset's data files (memmap shards, LMDB files) are written once and never changed (docs/FORMAT.md,
"Segments"). A refresh hard-links the old version's data files into its staging folder, writes only
the records of added and changed files into a new segment (new shards, or a new LMDB file
``data-NNNNN.mdb``) and a new index in scan order whose rows point into old and new files alike: the
record work is the change's, plus a pass over the metadata. The records of deleted and changed files
stay behind in the old files as dead bytes, counted per data file (``dead``) and in the manifest's
``dead_bytes``. A refresh that would make too many segments (:data:`MAX_SEGMENTS`) links only the
first segment's files and rewrites the later ones' live records into its new segment; one that would
leave too much dead (:data:`MAX_DEAD`) rewrites everything into one segment, as ``packer compact``
does on demand (see :func:`plan`).

Readers of the old version are untouched: its files keep their inodes and bytes (the old directory
is swapped out and deleted, the links in the new one keep the shared files), and packer.backends.pin holds
every file of the version a reader opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..backends import BACKENDS, data_files, record_places
from ..errors import DatasetError, say
from ..format import Manifest, bytes_per_file, open_regular

#: ``fetch(out, names)``: the old version's data files ``names``, not on this disk, brought into ``out``
#: (from object storage: packer.tools.publish), for the records a refresh copies rather than links.
Fetch = Callable[[Path, list[str]], None]

#: A refresh rewrites every record into one segment when, after it, more than this share of the record
#: bytes in the old data files would be dead (records of deleted or changed files)...
MAX_DEAD = 0.25
#: ... or when the dataset would come from more than this many segments (files to open and map).
MAX_SEGMENTS = 16


@dataclass(frozen=True)
class Base:
    """The old version's data files that a refresh links into its staging folder: the new version's
    first data files, numbered as before (a kept record's row keeps its ``shard`` and ``offset``).
    Each entry: ``file``, ``segment`` and ``stored``, its record bytes live or dead (and ``bytes``, its
    size, where the manifest lists it). ``elsewhere``: those not linked because they are not on this
    disk (the old version is in object storage: packer.tools.publish); the new version names them all
    the same, and its publish reuses their objects."""

    entries: list[dict[str, Any]]
    elsewhere: frozenset[str] = frozenset()

    @property
    def files(self) -> list[str]:
        return [str(e["file"]) for e in self.entries]


def old_files(manifest: Manifest, index: np.ndarray) -> list[dict[str, Any]]:
    """The old version's data files in order: ``file``, ``segment`` (0 before version 3), ``stored``
    (record bytes in it: its rows' lengths plus its ``dead``) and, where the manifest lists it, ``bytes``."""
    files = data_files(manifest)
    live = bytes_per_file(record_places(manifest, index)[0], index["length"], len(files))
    listed = manifest.shards if manifest.format_version >= 3 else [{} for _ in files]
    return [
        {"file": name, "segment": int(e.get("segment", 0)), "stored": int(n) + int(e.get("dead", 0))}
        | ({"bytes": int(e["bytes"])} if "bytes" in e else {})
        for name, e, n in zip(files, listed, live.tolist())
    ]


def plan(manifest: Manifest, index: np.ndarray, kept: np.ndarray, backend: str, shard_size: int) -> tuple[int, str]:
    """How many of the old data files (a prefix) a refresh that keeps the old records ``kept`` (their
    old row numbers) links rather than rewrites; with a message saying why it rewrites, "" when it
    links them all. All of them normally; those of the first segment when one more segment would be
    over :data:`MAX_SEGMENTS` (the later, smaller segments' live records are rewritten into the new
    one); none when what it keeps would be over :data:`MAX_DEAD` dead, or the layout changes."""
    if manifest.backend != backend:
        return 0, f"rewriting every record into one segment (the backend changes: {manifest.backend} -> {backend})"
    if BACKENDS[backend].concatenated and manifest.options.get("shard_size") != shard_size:
        was = manifest.options.get("shard_size")
        return 0, f"rewriting every record into one segment (the shard size changes: {was} -> {shard_size})"
    files = old_files(manifest, index)
    keep, why = len(files), ""
    if manifest.segments + 1 > MAX_SEGMENTS:
        keep = sum(1 for f in files if f["segment"] == files[0]["segment"])
        why = (
            f"rewriting the live records of its last {manifest.segments - 1} segments into one "
            f"(over {MAX_SEGMENTS} segments otherwise)"
        )
    live = bytes_per_file(record_places(manifest, index)[0][kept], index["length"][kept], len(files))
    stored = sum(f["stored"] for f in files[:keep])
    dead = stored - int(live[:keep].sum())
    if stored and dead > MAX_DEAD * stored:
        return (
            0,
            f"rewriting every record into one segment ({dead / stored:.0%} of them would be dead, over {MAX_DEAD:.0%})",
        )
    return keep, why


def link_base(
    old: Path, staging: Path, entries: list[dict[str, Any]], quiet: bool, *, remote: bool = False
) -> Optional[Base]:
    """Hard-link the old data files ``entries`` (:func:`old_files`) into ``staging`` (already there from
    an interrupted run: kept); None, after saying why, where the filesystem cannot or a file is not
    the dataset's own regular file (then every record is rewritten). ``remote``: the old version is in
    object storage, and those of its files not in ``old`` (whose size its manifest lists) stay there
    (:attr:`Base.elsewhere`)."""
    files = [str(e["file"]) for e in entries]
    elsewhere = frozenset(
        str(e["file"]) for e in entries if remote and "bytes" in e and not os.path.lexists(old / str(e["file"]))
    )
    try:
        for name in files:
            if name not in elsewhere:
                _link_regular(old / name, staging / name)
        return Base(entries, elsewhere)
    except OSError as e:
        why = "another filesystem" if e.errno == errno.EXDEV else (e.strerror or str(e))
    except DatasetError as e:  # a symlink, a FIFO: not the old dataset's own file
        why = str(e)
    for name in files:
        (staging / name).unlink(missing_ok=True)
    say(f"cannot hard-link the data files of {old} into {staging} ({why}): rewriting every record", quiet)
    return None


def _link_regular(source: Path, target: Path) -> None:
    """Hard-link ``source`` as ``target`` (kept when it already is that file): a regular file of the
    old dataset's own, never a symlink or what one leads to (DatasetError), so that nothing the
    build writes into its staging folder can reach a file outside the dataset."""
    fd = open_regular(source)
    try:
        st = os.fstat(fd)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.lstat(target), st):
                return
        target.unlink(missing_ok=True)
        os.link(source, target)
        if not os.path.samestat(os.lstat(target), st):  # another file took its name meanwhile
            target.unlink()
            raise DatasetError(f"{source}: replaced while it was being linked")
    finally:
        os.close(fd)


def data_table(
    staging: Path, rows: np.ndarray, base: Optional[Base], written: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int, int, int]:
    """The manifest's ``shards``, ``bytes``, ``dead_bytes`` and ``segments`` for the rows of a dataset
    staged over ``base`` (None: written in one go) plus the data files ``written`` by this build (the
    next segment). Each data file's entry: ``file``, ``count`` (rows pointing into it), ``bytes`` (its
    size), ``segment`` and ``dead`` (its record bytes no row points to). A new LMDB segment that got
    no record is dropped."""
    old = base.entries if base is not None else []
    names = [str(e["file"]) for e in old] + [str(s["file"]) for s in written]
    number = rows["shard"].astype(np.int64)
    counts: list[int] = np.bincount(number, minlength=len(names)).tolist()
    live: list[int] = bytes_per_file(number, rows["length"], len(names)).tolist()
    segment = max((int(e["segment"]) for e in old), default=-1) + 1
    table: list[dict[str, Any]] = []
    for k, name in enumerate(names):
        if k >= len(old) and counts[k] == 0 and base is not None:  # LMDB's writer made the file up front
            (staging / name).unlink()
            continue
        dead = int(old[k]["stored"]) - live[k] if k < len(old) else 0
        size = int(old[k]["bytes"]) if base is not None and name in base.elsewhere else os.path.getsize(staging / name)
        table.append(
            {
                "file": name,
                "count": counts[k],
                "bytes": size,
                "segment": old[k]["segment"] if k < len(old) else segment,
                "dead": dead,
            }
        )
    total = sum(int(e["bytes"]) for e in table)
    return table, total, sum(int(e["dead"]) for e in table), len({int(e["segment"]) for e in table}) or 1
