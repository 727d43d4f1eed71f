"""Where a dataset's cache directory keeps things, and the small file helpers its parts share."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Optional

UNITS, PARTIAL, VERSIONS, LOCKS = "units", "partial", "versions", "locks"


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


def remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except FileNotFoundError:
        return 0


def file_mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
