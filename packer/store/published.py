"""A dataset published to an object store at URL ``U`` (docs/OBJECT-STORAGE.md, "Layout"):
``U/manifest.json``, the pointer, holds the current version's manifest and is written last, in one
PUT conditional on the previous pointer; each version's metadata lives, immutable, under
``U/versions/<id>/``, whose ``files.json`` (written last inside it) says where each data file's
bytes are. No object is ever overwritten but the pointer, so a reader pinned to an older version
keeps reading it until gc deletes what no kept version names.

This module holds the names and the ``files.json`` format, read and written the same way by the
publish, the read side, gc and verify.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ..errors import DatasetError, ObjectNotFound
from ..format import MANIFEST
from .base import Store

__all__ = [
    "FILES",
    "LEASE",
    "POINTER",
    "VERSIONS",
    "FileEntry",
    "files_json",
    "parse_files",
    "read_files",
    "version_id",
    "version_key",
]

POINTER = MANIFEST  # the current version's manifest: a synced copy (aws s3 sync) opens the same way
VERSIONS = "versions"
FILES = "files.json"
LEASE = ".packer-lease"
FILES_FORMAT = 1

_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """Where data file NAME's bytes live (``key``, relative to U), their size and sha256 ("" where
    not recorded)."""

    key: str
    size: int
    sha256: str = ""


def version_id(manifest_bytes: bytes) -> str:
    """A version's id: the first 32 hex digits of its manifest's sha256, as the read cache keys it."""
    return hashlib.sha256(manifest_bytes).hexdigest()[:32]


def version_key(version: str, name: str) -> str:
    """``versions/<id>/<name>``: an object of that version's folder."""
    return f"{VERSIONS}/{version}/{name}"


def files_json(entries: Mapping[str, FileEntry]) -> bytes:
    """The bytes of a version's ``files.json`` (sorted, so one set of entries has one form)."""
    files = {
        name: {"key": e.key, "size": e.size, **({"sha256": e.sha256} if e.sha256 else {})}
        for name, e in sorted(entries.items())
    }
    return json.dumps({"format": FILES_FORMAT, "files": files}, indent=1, sort_keys=True).encode("utf-8")


def parse_files(data: bytes, *, where: str) -> dict[str, FileEntry]:
    """``files.json``'s entries; DatasetError (naming ``where``) for one packer did not write: a key
    outside U (absolute, or with ``..``) would point a reader anywhere in the bucket."""
    try:
        doc = json.loads(data)
        if doc.get("format") != FILES_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this packer reads {FILES_FORMAT}")
        found: dict[str, FileEntry] = {}
        for name, e in doc["files"].items():
            key, size, sha = e["key"], e["size"], e.get("sha256", "")
            if not isinstance(key, str) or not key or key.startswith("/") or ".." in key.split("/"):
                raise ValueError(f"{name}: key {key!r} is not inside the dataset")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"{name}: size {size!r}")
            if sha and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
                raise ValueError(f"{name}: sha256 {sha!r}")
            found[name] = FileEntry(key, size, sha)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DatasetError(f"{where}: not a files.json packer wrote ({e})") from None
    return found


def read_files(store: Store, version: str) -> Optional[dict[str, FileEntry]]:
    """Version ``version``'s data files as its ``files.json`` lists them; None where it has none (a
    dataset copied as it is, whose data files sit at U/NAME)."""
    if not _ID.fullmatch(version):
        raise DatasetError(f"{store.url}: {version!r} is not a version id")
    key = version_key(version, FILES)
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None
    return parse_files(data, where=store.name(key))
