"""What is fetched of a version (its units: LMDB files, ranges of memmap shards) and a memmap
shard as its reader slices it, each unit mapped as it is first read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from ...backends import BACKENDS, data_files, record_places
from ...format import Manifest


class Units:
    """What is fetched of one version: for memmap, each shard cut into ranges of ``per_unit``
    records (global record numbers ``u * per_unit`` and up: a power of two, so that ShardSampler
    blocks of a power of two records up to ``per_unit`` never straddle two units) at record
    boundaries; for LMDB (``per_unit`` 0) the data files. ``of``: each record's unit; ``keys``:
    each unit's name (a whole shard is named as its file, so it is the file ``packer verify``
    fetches); ``ranged``: memmap's (a record can be read alone); ``sizes``: its bytes (0 for an LMDB
    data.mdb of format 1 or 2, whose manifest does not list it); ``numbers``: name -> unit;
    ``record_bytes``: the mean bytes of a record, as the units hold them."""

    def __init__(self, manifest: Manifest, index: np.ndarray, per_unit: int) -> None:
        names = data_files(manifest)
        files, positions = record_places(manifest, index)
        if not per_unit:
            self.of = files.astype(np.int64)
            self.keys = list(names)
            # as the manifest lists them (LMDB format 3); an older one's data.mdb is known from its HEAD only: 0
            listed = BACKENDS[manifest.backend].lists_files(manifest)
            sizes = [int(f["bytes"]) for f in manifest.shards] if listed else [0] * len(names)
            self.sizes = np.array(sizes, np.int64)
        else:
            group = files.astype(np.int64) * (len(index) // per_unit + 1) + np.arange(len(index)) // per_unit
            unique, self.of = np.unique(group, return_inverse=True)
            self.of = self.of.astype(np.int64)
            ends = positions + index["length"].astype(np.int64)
            starts = np.full(len(unique), np.iinfo(np.int64).max, np.int64)
            stops = np.zeros(len(unique), np.int64)
            np.minimum.at(starts, self.of, positions)
            np.maximum.at(stops, self.of, ends)
            shard_of = files[np.unique(self.of, return_index=True)[1]]
            self.keys = []
            for u, k in enumerate(shard_of.tolist()):
                whole = starts[u] == 0 and stops[u] == int(manifest.shards[k]["bytes"])
                self.keys.append(names[k] if whole else f"{names[k]}@{starts[u]}-{stops[u]}")
            self.sizes = stops - starts
            self.shard, self.starts, self.stops = shard_of, starts, stops
        self.ranged = bool(per_unit)
        self.numbers = {key: u for u, key in enumerate(self.keys)}
        self.record_bytes = float(self.sizes.sum()) / max(1, len(index))


class RangedShard:
    """Memmap shard ``k`` as its reader slices it (``array[start:end]``), each unit mapped when a
    record of it is first read: ``open_unit(name)`` fetches it into the cache first, or gives None
    where the cache has no room for it. The mappings are kept in ``opened`` until
    :meth:`Remote.release` drops them. A record read past the cache (packer.read.remote.ranges) is
    in ``past()``, keyed by (shard, position), or read now by ``read_past(k, position)``."""

    def __init__(
        self,
        size: int,
        units: Units,
        k: int,
        open_unit: Callable[[str], Optional[np.ndarray]],
        past: Callable[[], dict[tuple[int, int], bytes]],
        read_past: Callable[[int, int], bytes],
    ) -> None:
        self.size, self.k, self._open_unit, self._past, self._read_past = size, k, open_unit, past, read_past
        mine = np.flatnonzero(units.shard == k)
        order = np.argsort(units.starts[mine], kind="stable")
        self._units = mine[order]
        self._starts = units.starts[self._units]
        self._keys = units.keys
        self.opened: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, where: slice) -> np.ndarray:
        j = max(0, int(np.searchsorted(self._starts, where.start, side="right")) - 1)
        array = self.opened.get(j)
        if array is None:
            record = self._past().get((self.k, where.start))
            if record is not None and len(record) == where.stop - where.start:
                return np.frombuffer(record, np.uint8)
            opened = self._open_unit(self._keys[int(self._units[j])])
            if opened is None:
                return np.frombuffer(self._read_past(self.k, where.start), np.uint8)[: where.stop - where.start]
            array = self.opened[j] = opened
        base = int(self._starts[j])
        return array[where.start - base : where.stop - base]
