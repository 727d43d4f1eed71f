"""The remote path's tunables, and the user's cache settings (its directory, its limit)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

#: Units a process prepares at once in the background (the cache's room, the download, the check);
#: their downloads take turns (:class:`Turns`).
PREFETCH_UNITS = 4
#: Ranged GETs a unit is downloaded in at once (parts of at most packer.store.base.PART_BYTES;
#: larger units, LMDB files, in more): one fills a node's bandwidth alone, and more cost the store
#: and this process CPU (docs/PERFORMANCE.md, "A cold first epoch from S3"); more are for a store
#: whose one stream is slower than the readers consume.
UNIT_STREAMS = 1
#: About the bytes of a memmap unit: a range of a shard of a power of two records (AWS advises
#: 8-16 MB ranges), whole shards when they are smaller.
UNIT_BYTES = 8 << 20
#: Downloads of a unit (or of a version's index) whose bytes do not match the manifest, before the
#: DatasetError: a transfer damaged on the way is fetched again, a damaged object fails.
VERIFY_ATTEMPTS = 3
#: Seconds a batch's download waits for other readers to let go of units when the cache is full.
ROOM_WAIT = 60.0
_UNITS_LIMIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def default_cache_dir() -> Path:
    """``$PACKER_CACHE_DIR``, else ``packer`` in the user's cache directory ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get("PACKER_CACHE_DIR"):
        return Path(os.environ["PACKER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packer"


def parse_limit(limit: int | str | None) -> Optional[int]:
    """Bytes from ``cache_limit``: an int, or text like "200GB" (powers of 1000) or "1.5GiB" (of 1024)."""
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool)):
        if limit is not None and limit <= 0:
            raise ValueError(f"cache_limit must be positive, not {limit}")
        return limit
    found = _UNITS_LIMIT.match(str(limit))
    if not found:
        raise ValueError(f"cache_limit must be bytes or a size like '200GB' or '1.5GiB', not {limit!r}")
    number, unit, binary = found.groups()
    scale = (1024 if binary else 1000) ** "KMGT".find(unit.upper()) * (1024 if binary else 1000) if unit else 1
    value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"cache_limit must be positive, not {limit!r}")
    return value
