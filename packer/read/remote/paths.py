"""Where a dataset's cache directory keeps things, and the small file helpers its parts share."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Optional

UNITS, PARTIAL, VERSIONS, LOCKS = "units", "partial", "versions", "locks"
SIDECAR = ".rows.npy"  # per unit: (position, length, crc32) of the records it was checked for
LOG = ".parts"  # per download in partial/: the parts it has written
RECHECK = "files.json.failed"  # in a version's folder: its files.json is read from the bucket again at the next open


def digest(data: str | bytes) -> str:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:16]


def unit_span(unit: str) -> tuple[str, Optional[tuple[int, int]]]:
    """A unit's data file and byte range (None: the whole file), from its name ``FILE[@START-END]``."""
    file, _, span = unit.partition("@")
    if not span:
        return file, None
    start, _, end = span.partition("-")
    return file, (int(start), int(end))


def sidecar_of(path: Path) -> Path:
    """The sidecar of unit (or download) ``path``: the records it was checked for."""
    return path.with_name(path.name + SIDECAR)


def log_of(part: Path) -> Path:
    """The log of download ``part``: the parts it has written."""
    return part.with_name(part.name + LOG)


def remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def file_mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
