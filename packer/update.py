"""``--update``: what a dataset was built from, and which of its records a refresh can copy.

OUT itself is the build cache: its index records each source's identity (size, mtime, optional content
hash) and its manifest an ``inputs`` digest over everything the bytes depend on, so a refresh decodes
only added or changed files and still writes what a full rebuild would.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from . import __version__
from .format import MANIFEST, DatasetError, Manifest, load_index
from .preprocess import Options, Record, Result, process_chunk
from .read import check_lmdb_tree
from .scan import Scan, Source
from .walk import walk
from .workers import results


def inputs_digest(found: Scan, settings: dict[str, Any]) -> str:
    """What a dataset's bytes depend on: the scanned inputs with their identities, every setting, the
    packer version. Equal digests mean a rebuild would write the same dataset (manifest ``inputs``)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
    h.update(f"\0{__version__}\0{found.fingerprint(identity=True)}".encode())
    return "sha256:" + h.hexdigest()


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"packer: {message}", file=sys.stderr, flush=True)


def previous_dataset(out: Path, quiet: bool) -> Optional[tuple[Manifest, np.ndarray, np.ndarray]]:
    """The dataset already at ``out`` (manifest, index, source paths), or None when there is none or it
    cannot be read (then it is rebuilt in full)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        manifest = Manifest.load(out)
        return (manifest, *load_index(out, manifest))
    except DatasetError as e:
        _say(f"cannot reuse {out} ({e}); rebuilding every record", quiet)
        return None


@dataclass
class Cache:
    """The records of the dataset being replaced that --update copies instead of decoding again."""

    root: Path
    manifest: Manifest
    index: np.ndarray
    old_of: np.ndarray  # per source in scan order: its record number in the old dataset, or -1


class _OldRecords:
    """The old dataset's records by number, read in one sequential walk (packer.walk: readahead, the
    disk's speed) while the numbers asked for go up, as they do when the old and new scans list files
    in the same order; a number behind the walk starts a new one."""

    def __init__(self, cache: Cache) -> None:
        self._cache = cache
        self._walk: Optional[Generator[tuple[int, Optional[bytes], int], None, None]] = None
        self._at = -1  # the record the walk read last
        self._broken = False

    def record(self, j: int) -> Optional[Record]:
        """Old record ``j`` as its index row describes it, or None when its bytes are missing or differ
        from the row (damaged since they were written: the file is decoded again)."""
        row = self._cache.index[j]
        data, crc = self._get(j)
        if data is None or len(data) != int(row["length"]) or crc != int(row["crc32"]):
            return None
        return Record(data, int(row["height"]), int(row["width"]), crc)

    def _get(self, j: int) -> tuple[Optional[bytes], int]:
        """Record ``j``'s bytes and their CRC-32; None when missing or unreadable (a damaged old
        dataset: then every later record is decoded again too)."""
        if self._broken:
            return None, 0
        try:
            if self._walk is None or j <= self._at:
                self.close()
                c = self._cache
                if c.manifest.backend == "lmdb":
                    check_lmdb_tree(c.root)  # liblmdb must not walk a damaged file
                shard_files = [str(s["file"]) for s in c.manifest.shards]
                self._walk, self._at = walk(c.root, c.manifest.backend, c.index, shard_files=shard_files), -1
            for i, data, crc in self._walk:
                self._at = i
                if i == j:
                    return data, crc
        except (DatasetError, OSError):
            self.close()
            self._broken = True
        return None, 0

    def close(self) -> None:
        if self._walk is not None:
            self._walk.close()
            self._walk = None


def _stale_reason(manifest: Manifest, settings: dict[str, Any]) -> Optional[str]:
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
        changed.append("built without --checksum, so no content hashes to compare")
    return ", ".join(changed) or None


def reuse_plan(
    out: Path, previous: tuple[Manifest, np.ndarray, np.ndarray], found: Scan, settings: dict[str, Any], quiet: bool
) -> Optional[Cache]:
    """Match each source to an old record by path and identity (size and mtime, or size and content
    hash with --checksum); None when the old records were built differently."""
    manifest, index, paths = previous
    why = _stale_reason(manifest, settings)
    if why:
        _say(f"{out}: cannot reuse its records ({why}): rebuilding every record", quiet)
        return None
    blob = bytes(paths)
    old = {
        blob[o : o + n].decode("utf-8", "surrogateescape"): j
        for j, (o, n) in enumerate(zip(index["src_offset"].tolist(), index["src_length"].tolist()))
    }
    candidate = np.array([old.get(s.rel, -1) for s in found.sources], dtype=np.int64)
    known = np.flatnonzero(candidate >= 0)
    same = np.ones(len(known), dtype=bool)
    for name in ("src_size", "src_hash") if settings["checksum"] else ("src_size", "src_mtime_ns"):
        same &= index[name][candidate[known]] == found.identities()[name][known]
    old_of = np.full(len(found.sources), -1, dtype=np.int64)
    old_of[known[same]] = candidate[known[same]]
    return Cache(out, manifest, index, old_of)


def ordered_results(
    raw: Path,
    todo: list[Source],
    old_of: np.ndarray,
    cache: Optional[Cache],
    opts: Options,
    workers: int,
    fresh: Optional[Generator[Result, None, None]] = None,
) -> Generator[tuple[Result, bool], None, None]:
    """Each source's result in scan order, and whether it was reused: copied from the old dataset when
    ``old_of`` names a record, else from ``fresh``: the results of the files to decode, in order (by
    default this machine's worker pool, which sees only those files; a --dask build passes its own)."""
    if fresh is None:
        rels = [s.rel for s, j in zip(todo, old_of) if j < 0]  # the scan's own strings: no copies
        fresh = results(str(raw), rels, opts, workers if rels else 1, chunk=2)  # nothing to decode: start no pool
    old = _OldRecords(cache) if cache is not None else None
    try:
        for source, j in zip(todo, old_of.tolist()):
            if j < 0 or old is None:
                yield next(fresh), False
            elif (record := old.record(j)) is not None:
                yield record, True
            else:
                yield process_chunk([str(raw / source.rel)], opts)[0], False  # damaged since: decode again
    finally:
        fresh.close()
        if old is not None:
            old.close()
