"""Records read straight from the store, past the cache: what a batch reads of a memmap unit the
cache has no room for (its limit taken by the units the batches in flight hold, or a unit no
eviction would pay for: packer.read.remote.nextuse.NextUses.after). Just the batch's records of
it, as byte ranges of the shard, records closer than settings.RANGE_GAP taken in one GET, up to
:data:`RANGE_STREAMS` GETs at once; each record checked against its index row (length, CRC-32)
before any decoder sees it, a damaged one read again up to ``VERIFY_ATTEMPTS`` times. Nothing is
written under the cache directory, so the limit holds whatever the order asks."""

from __future__ import annotations

import concurrent.futures
import zlib
from collections.abc import Callable
from typing import Optional

import numpy as np

from ...format import DatasetError
from ...store import ObjectChanged, Store
from ...store.base import ObjectInfo, PerProcess
from . import settings
from .download import replaced
from .settings import VERIFY_ATTEMPTS

#: Range GETs of records a process has in flight at once (S3 serves thousands a second a prefix).
RANGE_STREAMS = 8

_pool = PerProcess(lambda: concurrent.futures.ThreadPoolExecutor(RANGE_STREAMS, thread_name_prefix="packer-ranges"))


def runs(positions: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Records (``positions``, ``lengths`` in one file) grouped into the byte ranges one GET each
    fetches: (start, end, the records' numbers in the arguments), records closer than
    settings.RANGE_GAP merged."""
    gap = settings.RANGE_GAP
    order = np.argsort(positions, kind="stable")
    starts, ends = positions[order], positions[order] + lengths[order]
    out: list[tuple[int, int, np.ndarray]] = []
    first = 0
    for j in range(1, len(order) + 1):
        if j == len(order) or starts[j] > int(ends[first:j].max()) + gap:
            out.append((int(starts[first]), int(ends[first:j].max()), order[first:j]))
            first = j
    return out


def read_records(
    store: Store,
    key: str,
    info: Optional[ObjectInfo],
    rows: np.ndarray,
    records: np.ndarray,
    *,
    seen: Callable[[ObjectInfo], object],
    named: str,
) -> list[bytes]:
    """The bytes of ``records`` (numbers, for messages) of object ``key`` at ``rows`` (their
    ``position``, ``length``, ``crc32`` in it), each checked; ``info``: its version where known
    (asked If-Match), else learned from the first response (told to ``seen``)."""
    out: list[bytes] = [b""] * len(rows)
    etag = [info.etag if info is not None else ""]

    def learned(found: ObjectInfo) -> None:
        etag[0] = etag[0] or found.etag
        seen(found)

    def one(start: int, end: int, members: np.ndarray) -> None:
        for attempt in range(VERIFY_ATTEMPTS):
            pieces: list[bytes] = []
            try:
                store.fetch(key, start, end, etag[0], pieces.append, seen=learned)
            except ObjectChanged:
                raise replaced(store.name(key)) from None
            data = b"".join(pieces)
            bad = None
            for m in members.tolist():
                a = int(rows["position"][m]) - start
                record = data[a : a + int(rows["length"][m])]
                if len(record) != int(rows["length"][m]) or zlib.crc32(record) != int(rows["crc32"][m]):
                    bad = m
                    break
                out[m] = record
            if bad is None:
                return
            if attempt == VERIFY_ATTEMPTS - 1:
                raise DatasetError(
                    f"{named}: record {int(records[bad])}: CRC-32 differs from the index's (damaged bytes) "
                    f"after {VERIFY_ATTEMPTS} reads"
                )

    groups = runs(rows["position"].astype(np.int64), rows["length"].astype(np.int64))
    if not etag[0] and groups:  # the version from the first response, pinned for the others
        one(*groups.pop(0))
    for future in [_pool.get().submit(one, *g) for g in groups]:
        future.result()
    return out
