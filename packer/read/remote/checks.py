"""What a download is checked against before any decoder sees a byte: the manifest's digests for
the index and label arrays, each record's length and CRC-32 for a unit (computed as its bytes
arrive where they can be), and the sidecar listing the records a cached unit was checked for."""

from __future__ import annotations

import io
import os
import threading
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from ...backends import Backend
from ...format import (
    INDEX,
    LABELS,
    SOURCES,
    TARGETS,
    DatasetError,
    Manifest,
    index_digest,
    logical_digest,
    map_npy,
    open_regular,
)
from ...format.label_arrays import arrays_digest
from .paths import sidecar_of

ROWS_DTYPE = np.dtype([("position", "<i8"), ("length", "<u8"), ("crc32", "<u4")])
#: A unit's backend, the index rows it holds, and their (position, length, crc32) sorted by position.
Expected = tuple[Backend, np.ndarray, np.ndarray]


def rows_of(index: np.ndarray, positions: np.ndarray, records: np.ndarray, base: int = 0) -> np.ndarray:
    """The (position, length, crc32) of ``records`` (their ``positions`` in their data file, less
    ``base``: the start of the unit they are in) from the version's ``index``."""
    rows = np.empty(len(records), ROWS_DTYPE)
    rows["position"] = positions[records] - base
    rows["length"], rows["crc32"] = index["length"][records], index["crc32"][records]
    return rows


def sidecar_bytes(rows: np.ndarray) -> bytes:
    """The sidecar of a unit checked for ``rows`` (ROWS_DTYPE), as written beside it."""
    out = io.BytesIO()
    np.save(out, rows)
    return out.getvalue()


def metadata_problem(manifest: Manifest, arrays: dict[str, np.ndarray]) -> str:
    """What in the index and label arrays does not match the manifest's digests ("" when all do)."""
    if manifest.index_digest and index_digest(arrays[INDEX]) != manifest.index_digest:
        return f"{INDEX} does not match the manifest's index_digest"
    if manifest.sources_digest and index_digest(arrays[SOURCES]) != manifest.sources_digest:
        return f"{SOURCES} does not match the manifest's sources_digest"
    labels = arrays_digest(arrays.get(LABELS), arrays.get(TARGETS))
    if manifest.labels_digest and labels != manifest.labels_digest:
        return f"{LABELS}/{TARGETS} do not match the manifest's labels_digest"
    v3 = manifest.format_version >= 3 and len(arrays[INDEX]) == manifest.count
    if v3 and logical_digest(arrays[INDEX], labels) != manifest.digest:
        return f"{INDEX} does not match the manifest's digest"
    return ""


def checked_for(unit: Path, rows: np.ndarray) -> bool:
    """Whether ``unit`` is in the cache and was checked for every record of ``rows`` (a version
    that keeps an old segment names the same records, or fewer, of it)."""
    sidecar = sidecar_of(unit)
    try:
        fd = open_regular(sidecar)
    except (OSError, DatasetError):
        return False
    try:
        known = map_npy(fd, sidecar)  # its header parsed under map_npy's lock (threads fetch at once)
    except DatasetError:
        return False
    finally:
        os.close(fd)
    if not unit.exists() or known.dtype != ROWS_DTYPE:
        return False
    if not len(rows):
        return True
    at = np.searchsorted(known["position"], rows["position"])
    if (at >= len(known)).any():
        return False
    return bool((known[at] == rows).all())


class Received:
    """The CRC-32s of a concatenated backend's records (``rows``: their positions in the unit's
    file, sorted) computed from the bytes a download writes, as it writes them (called with each
    piece and its offset, from the parts' threads): the check after the download then reads back
    only the records whose bytes did not all come in order in one stream (cut by two parts, or in
    a part a resumed download already had, or written twice)."""

    def __init__(self, rows: np.ndarray) -> None:
        self._starts = rows["position"].astype(np.int64)
        self._ends = self._starts + rows["length"]
        self._at = self._starts.tolist()  # each record's next byte expected
        self._crcs = [0] * len(rows)
        self._spliced = [False] * len(rows)  # bytes came out of order: read back
        self._lock = threading.Lock()

    def __call__(self, at: int, piece: bytes) -> None:
        end = at + len(piece)
        view = memoryview(piece)
        first = int(np.searchsorted(self._ends, at, "right"))  # records ending after ``at``
        last = int(np.searchsorted(self._starts, end, "left"))  # and starting before ``end``
        with self._lock:
            for r in range(first, last):
                a, b = max(at, int(self._starts[r])), min(end, int(self._ends[r]))
                if a != self._at[r]:
                    self._spliced[r] = True
                else:
                    self._crcs[r] = zlib.crc32(view[a - at : b - at], self._crcs[r])
                    self._at[r] = b

    def checked(self) -> tuple[np.ndarray, np.ndarray]:
        """Which records came whole, in order (the others are to be read back), and their CRC-32s."""
        whole = (np.array(self._at, np.int64) == self._ends) & ~np.array(self._spliced, bool)
        return whole, np.array(self._crcs, np.uint32)


def _crc_differs(record: int) -> str:
    return f"record {record}: CRC-32 differs from the index's (damaged bytes)"


def unit_problem(path: Path, expected: Expected, received: Optional[Received] = None) -> str:
    """What in the downloaded data file ``path`` does not match its records' index rows ("" if
    nothing): the records ``received`` saw arrive whole by the CRC-32s it computed, the others read back."""
    backend, mine, rows = expected
    todo = np.arange(len(rows))
    if received is not None:
        whole, crcs = received.checked()
        damaged = np.flatnonzero(whole & (crcs != rows["crc32"]))
        if len(damaged):
            return _crc_differs(int(mine[damaged[0]]))
        todo = np.flatnonzero(~whole)
    try:
        backend.check_walkable(path)
        walked = backend.walk_file(path, mine[todo], rows["position"][todo], rows["length"][todo], None)
        for j, (i, data) in zip(todo.tolist(), walked):
            if data is None:
                return f"record {i} is missing"
            if len(data) != int(rows["length"][j]):
                return f"record {i} is {len(data)} bytes, the index says {int(rows['length'][j])}"
            if zlib.crc32(data) != int(rows["crc32"][j]):
                return _crc_differs(i)
    except DatasetError as e:
        return str(e).removeprefix(f"{path}: ")
    return ""
