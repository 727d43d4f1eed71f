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
#: The fewest units a memmap dataset is cut into where units of at least :data:`MIN_UNIT_BYTES`
#: allow: ShardSampler's default order waits, before its first batch, for a window of units (the
#: 16 or more its labels need to mix), which in 8 MB units is all of a small dataset
#: (docs/PERFORMANCE.md, "A cold first epoch from S3").
MIN_UNITS = 64
#: The least bytes of a unit cut smaller for :data:`MIN_UNITS`: a GET that moves for at least as
#: long as it waits for its first byte (~20 ms from S3, at ~100 MB/s), so one stream at a time
#: still keeps the readers fed.
MIN_UNIT_BYTES = 2 << 20
#: Downloads of a unit (or of a version's index) whose bytes do not match the manifest, before the
#: DatasetError: a transfer damaged on the way is fetched again, a damaged object fails.
VERIFY_ATTEMPTS = 3
#: The least share of a unit's records a batch's download must see read before the cache would
#: have turned over for it to evict a cached unit (packer.read.remote.nextuse.NextUses.after):
#: below it, the batch reads its records of the unit past the cache.
PAST_SHARE = 0.5
#: Bytes between two records of a shard below which one GET takes both: about what a request costs
#: in money at S3's list prices (~4 KB of transfer out) to a few times that. Not the bytes a link
#: moves in a first-byte wait (~2 MB at 100 MB/s and 20 ms): the GETs of a batch run
#: packer.read.remote.ranges.RANGE_STREAMS at once, so their waits overlap, and the records read
#: past the cache are those of a cache too small for them, where bytes are what a gap costs
#: (docs/PERFORMANCE.md, "Random order through half a cache"). Read when used:
#: scripts/bench_remote.py's ``--range-gap`` sets it.
RANGE_GAP = 16 << 10
#: Seconds any wait of the cache lasts at most (a lock another process holds: its download of a
#: unit, room in the cache, a prefetch's turn, a download in flight) before the batch fails in one
#: line naming the unit, its object and the pid holding it: a stuck reader is said, never a silent
#: hang. ``$PACKER_CACHE_WAIT`` sets it (seconds), for the DataLoader workers and ranks too: :func:`wait_s`.
WAIT_S = 300.0
WAIT_ENV = "PACKER_CACHE_WAIT"
_UNITS_LIMIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def unit_records(data_bytes: int, records: int) -> int:
    """Records per memmap unit of a dataset of ``records`` records in ``data_bytes``: a power of
    two of about :data:`UNIT_BYTES`, less for a dataset of fewer than :data:`MIN_UNITS` such units
    (down to :data:`MIN_UNIT_BYTES`). A function of the dataset alone: every rank and worker of a
    node names the same units."""
    mean = data_bytes / max(1, records)
    target = min(UNIT_BYTES, max(MIN_UNIT_BYTES, data_bytes // MIN_UNITS))
    return 1 << max(0, int(target / max(mean, 1.0)).bit_length() - 1)


def wait_s() -> float:
    """:data:`WAIT_S`, or what ``$PACKER_CACHE_WAIT`` says."""
    told = os.environ.get(WAIT_ENV, "").strip()
    if not told:
        return WAIT_S
    try:
        return max(0.0, float(told))
    except ValueError:
        raise ValueError(f"{WAIT_ENV} must be seconds, not {told!r}") from None


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
