"""``packer gc URL``: delete the objects of a published dataset's old versions that no kept version
needs (docs/OBJECT-STORAGE.md, "Old versions and gc").

Kept: the current version (the pointer's) and the versions it replaced, ``keep_versions`` in all
(each ``files.json`` names the version it was published over, its ``parent``: the order needs no
clocks), and every version folder younger than ``keep_age_s`` (by the store's clock), so that a
reader that opened an older version a while ago keeps reading it. Deleted: every object under
``versions/<id>/`` of a version not kept that no kept version's ``files.json`` names (a data file
reused by a kept version stays, wherever it lies), and the folders of failed publishes (no
``files.json``, or one the pointer never named) once older than the age. Nothing
outside ``versions/`` is ever deleted: a dataset synced as it is keeps all of its files.

A dropped version's ``files.json`` goes first: an interrupted gc leaves a folder without one, which
the next gc takes for an abandoned publish, never a half-deleted version it would keep.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

from ..errors import BuildError, ObjectNotFound, is_url
from ..store import open_store
from ..store.base import Listed, Store
from ..store.published import FILES, POINTER, VERSIONS, Lease, VersionFiles, read_version, version_id

__all__ = ["KEEP_AGE_S", "KEEP_VERSIONS", "GcReport", "collect", "gc", "parse_age"]

#: Versions kept by count, the current one included.
KEEP_VERSIONS = 3
#: Any version younger than this is kept, however many newer ones there are: a training run that
#: opened it up to this long ago keeps reading its files.
KEEP_AGE_S = 3 * 86400.0

_ID = re.compile(r"[0-9a-f]{32}")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class GcReport:
    """What gc kept and deleted (or, ``dry_run``, would delete)."""

    url: str
    current: str  # the pointer's version id ("" when nothing is published)
    kept: list[str] = field(default_factory=list)  # version ids: the current one and those it replaced, then young ones
    dropped: list[str] = field(default_factory=list)  # version folders no longer kept (whole or abandoned)
    deleted: list[Listed] = field(default_factory=list)
    dry_run: bool = False

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.deleted)

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        return (
            f"{self.url}: kept {len(self.kept)} versions (current {self.current or 'none'}), {verb} "
            f"{len(self.deleted)} objects, {self.bytes:,} bytes, of {len(self.dropped)} old or abandoned versions"
        )


@dataclass
class _Version:
    id: str
    objects: list[Listed] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return any(o.key.endswith("/" + FILES) for o in self.objects)

    @property
    def written(self) -> float:
        """When it was published (its files.json written), else its newest object: by the store's clock."""
        done = [o.modified for o in self.objects if o.key.endswith("/" + FILES)]
        return done[0] if done else max(o.modified for o in self.objects)


def parse_age(text: str) -> float:
    """``3d``, ``12h``, ``30m``, ``90s`` or plain seconds, as seconds (ValueError otherwise)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*", text)
    if not found:
        raise ValueError(f"{text!r} is not an age like 3d, 12h, 30m or 90s")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def gc(
    store: Store, *, keep_versions: int = KEEP_VERSIONS, keep_age_s: float = KEEP_AGE_S, dry_run: bool = False
) -> GcReport:
    """Delete what no kept version of the dataset at ``store`` needs (see the module); the caller
    holds the dataset's :class:`~packer.store.published.Lease` (a publish calls this in its own)."""
    if keep_versions < 1:
        raise BuildError(f"keep_versions must be at least 1 (the current version), not {keep_versions}")
    try:
        pointer, info = store.read(POINTER)
        now, current = info.served or time.time(), version_id(pointer)
    except ObjectNotFound:
        now, current = time.time(), ""
    versions: dict[str, _Version] = {}
    for o in store.list(f"{VERSIONS}/"):
        folder = o.key.split("/")[1]
        if _ID.fullmatch(folder):  # anything else under versions/ is not packer's: left alone
            versions.setdefault(folder, _Version(folder)).objects.append(o)
    report = GcReport(store.url, current, dry_run=dry_run)
    newest_first = sorted(versions.values(), key=lambda v: (v.written, v.id), reverse=True)
    # every published version's files.json (a damaged one raises: nothing is deleted then)
    read = {v.id: read_version(store, v.id) for v in newest_first if v.complete}
    history = _history(current, newest_first, read)
    kept = set(history[:keep_versions])
    if not current:  # no pointer (deleted, or never written): no history to go by, so every whole version stays
        kept |= set(read)
    kept |= {v.id for v in newest_first if now - v.written < keep_age_s}
    needed: set[str] = set()
    for v in newest_first:
        if v.id in kept:
            listed = read.get(v.id)
            needed |= {o.key for o in v.objects} | {e.key for e in (listed.files.values() if listed else ())}
    report.kept = [i for i in history if i in kept] + [v.id for v in newest_first if v.id in kept - set(history)]
    report.dropped = [v.id for v in newest_first if v.id not in kept]
    doomed = [o for v in newest_first if v.id not in kept for o in v.objects if o.key not in needed]
    doomed.sort(key=lambda o: not o.key.endswith("/" + FILES))  # files.json first (see the module)
    report.deleted = doomed
    if not dry_run:
        for o in doomed:
            store.delete(o.key)
    return report


def _history(current: str, newest_first: list[_Version], read: dict[str, Optional[VersionFiles]]) -> list[str]:
    """The versions the pointer named, newest first: from the current one back through each
    files.json's ``parent``; where one does not say (an older writer), on by time. A complete version
    not on it was never committed (a publish that failed before its pointer), or was rolled back."""
    order: list[str] = []
    at = current
    while read.get(at) is not None and at not in order:
        order.append(at)
        parent = read[at].parent  # type: ignore[union-attr]
        if parent is None:
            written = {v.id: v.written for v in newest_first}
            order += [v.id for v in newest_first if v.id in read and v.id not in order and v.written <= written[at]]
            break
        at = parent
    return order


def collect(
    url: str,
    *,
    keep_versions: int = KEEP_VERSIONS,
    keep_age_s: float = KEEP_AGE_S,
    dry_run: bool = False,
    wait: bool = False,
    quiet: bool = False,
) -> GcReport:
    """``packer gc URL``: :func:`gc` under the dataset's lease (a dry run too: what it lists must
    not change under it)."""
    if not is_url(url):
        raise BuildError(
            f"{url}: packer gc collects a published dataset's old versions in object storage; a local "
            "dataset keeps no old versions (a build replaces it whole)"
        )
    store = open_store(url)
    with Lease(store, wait=wait, quiet=quiet):
        return gc(store, keep_versions=keep_versions, keep_age_s=keep_age_s, dry_run=dry_run)
