"""A process's view of when each unit is next needed (the sampler's plan and announcements, the
records read), which eviction ranks units by."""

from __future__ import annotations

import collections
import time
from typing import Optional

import numpy as np

from ..draw import Order
from . import settings
from .units import Units

NEVER = 1 << 62  # a rank after every known next use
_PACE = 8  # the sampler's last announcements its pace is measured over
_SCAN = 1024  # draws of the plan a horizon's search looks at first (doubled until it is found)


class NextUses:
    """When each unit of a version is next needed, as far as this process knows: the sampler's plan
    of the epoch (told when it is iterated here) and how far its readers are, else its
    announcements of its next blocks and the records read this epoch."""

    def __init__(self) -> None:
        # per unit number: [announcement, records of it still to read] of the sampler's next
        # blocks announced so far, oldest first; the announcements counted; this epoch's unread records
        self._soon: dict[int, collections.deque[list[int]]] = {}
        self._announced = 0
        self._first: Optional[np.ndarray] = None  # the units of the epoch's first batch
        self._unread = 0  # records of this epoch not read yet
        self.planned: Optional[tuple[int, list[np.ndarray]]] = None  # (epoch, per unit: its draws' places)
        self.at = 0  # draws of the planned epoch read so far
        self.reading = 0  # draws of the batch being read (from ``at`` on)
        self.reading_epoch: Optional[int] = None  # its epoch (None: not a ShardSampler's batch)
        self._pace: collections.deque[tuple[float, int]] = collections.deque(maxlen=_PACE)  # (when, at)
        self._left: tuple[Optional[int], np.ndarray] = (None, np.zeros(0, np.int64))
        # the planned epoch's unit of each draw, the draw before it of the same unit (-1: none),
        # records per unit; the plan's global draw positions (a followed Order's) and the epoch
        # last followed; the last horizon found: (at, units, end)
        self._numbers = self._prev = self._records = np.zeros(0, np.int64)
        self._positions: Optional[np.ndarray] = None
        self._followed: Optional[int] = None
        self._horizon: tuple[int, int, int] = (-1, 0, 0)

    def told_read(self, epoch: Optional[int], read: Optional[int]) -> Optional[float]:
        """``read`` draws of the planned ``epoch`` are read by now in other processes (the
        sampler's DataLoader workers): the draws per second they read at, once measured."""
        if read is None or self.reads_here or self.planned is None or epoch != self.planned[0]:
            return None
        self.at = max(self.at, read)
        self._pace.append((time.monotonic(), self.at))
        (t0, at0), (t1, at1) = self._pace[0], self._pace[-1]
        if len(self._pace) >= _PACE // 2 and t1 > t0:
            return (at1 - at0) / (t1 - t0)
        return None

    def after(self, k: int, fits: int) -> Optional[int]:
        """For a batch's download of unit ``k`` that may read past the cache instead (a cache that
        holds ``fits`` such units): the rank before which no unit is evicted for it, the next use
        of ``k`` after the batch (NEVER where there is none; Belady with bypass: a unit needed later
        than every cached one is not cached); -1, every unit, where this process has no plan of
        the epoch. None where no eviction pays for the whole download: fewer than
        :data:`settings.PAST_SHARE` of the unit's records are read before the cache would have
        turned over (:meth:`_turnover`). Then it takes free room only, else its records are read
        past the cache: a global shuffle through a cache smaller than what its batches touch keeps
        the units it has (for this epoch's draws of them and the next epoch's) and reads the
        others' records past it, rather than evicting a whole unit for a record or two."""
        if self.planned is None or not self._current():
            return -1
        uses = self.planned[1][k] if k < len(self.planned[1]) else np.zeros(0, np.int64)
        share = settings.PAST_SHARE * int(self._records[k]) if k < len(self._records) else 0
        if int(np.searchsorted(uses, self._turnover(fits)) - np.searchsorted(uses, self.at)) < share:
            return None
        j = int(np.searchsorted(uses, self.at + self.reading))
        return int(uses[j]) if j < len(uses) else NEVER

    def _current(self) -> bool:
        """Whether the plan is of the epoch being read: the batch's being read (a new epoch's first
        batch is not counted yet), else the last batch's read here (none: the plan's)."""
        epoch = self.reading_epoch if self.reading_epoch is not None else self._left[0]
        return self.planned is not None and epoch in (None, self.planned[0])

    def _turnover(self, fits: int) -> int:
        """The first draw from ``at`` on whose unit would not fit beside the units drawn before it (from
        ``at``): ``fits`` units are needed first. A unit fetched now stays about that long under
        eviction by next use, unless it is needed again before."""
        if self._horizon[:2] == (self.at, fits):
            return self._horizon[2]
        end, found, scan = self.at, 0, _SCAN
        while end < len(self._prev):
            firsts = np.flatnonzero(self._prev[end : end + scan] < self.at)
            if found + len(firsts) > fits:
                end += int(firsts[fits - found])
                break
            end, found, scan = end + scan, found + len(firsts), scan * 2
        end = min(end, len(self._prev))
        self._horizon = (self.at, fits, end)
        return end

    def soonest(self, k: int) -> int:
        """:meth:`rank` of unit ``k``, after every known next use when it has none: a sort key."""
        rank = self.rank(k)
        return NEVER if rank is None else rank

    @property
    def reads_here(self) -> bool:
        """Whether this process has read batches of a ShardSampler (else its DataLoader workers do)."""
        return self._left[0] is not None

    def plan(self, units: Units, epoch: int, records: np.ndarray) -> None:
        """The records this process will read in ``epoch``, in order (ShardSampler's, told when it
        is iterated in this process): eviction ranks units by their next use in it."""
        self._plan(units, epoch, np.asarray(records, dtype=np.int64))
        self._positions = None

    def _plan(self, units: Units, epoch: int, records: np.ndarray) -> None:
        numbers = units.of[records]
        count = len(units.keys)
        order = np.argsort(numbers, kind="stable")
        bounds = np.searchsorted(numbers[order], np.arange(count + 1))
        self.planned = (epoch, [order[bounds[u] : bounds[u + 1]] for u in range(count)])
        prev = np.full(len(numbers), -1, np.int64)
        same = numbers[order][1:] == numbers[order][:-1]
        prev[order[1:][same]] = order[:-1][same]
        self._numbers, self._prev = numbers, prev
        self._records = np.bincount(units.of, minlength=count)
        self._horizon = (-1, 0, 0)
        self.at = 0
        self._pace.clear()

    def follow(self, units: Units, epoch: int, first: int, records: np.ndarray, order: Order) -> None:
        """A batch of ``records`` from global draw ``first`` of ``epoch``, read in a process that does
        not iterate the sampler (a DataLoader worker): the sampler's ``order`` of the epoch, computed
        here once per epoch, is this process's plan, placed at the batch. Ignored where the process
        was told a plan of the epoch (it iterates the sampler), or where the batch is not the
        order's (another sampler's: the plan is dropped for the epoch)."""
        if self.planned is not None and self.planned[0] == epoch and self._positions is None:
            return
        if self._followed != epoch:
            self._followed = epoch
            positions, drawn = order(epoch)
            self._plan(units, epoch, np.asarray(drawn, dtype=np.int64))
            self._positions = np.asarray(positions, dtype=np.int64)
        if self.planned is None or self._positions is None or self.planned[0] != epoch:
            return
        at = int(np.searchsorted(self._positions, first))
        if not np.array_equal(self._numbers[at : at + len(records)], units.of[records]):
            self.planned = None  # not this order's batch: no plan rather than a wrong one
            return
        self.at = at

    def count(self, units: Units, files: np.ndarray, read: bool, epoch: Optional[int]) -> None:
        """Keep this process's view of the future: records of units ``files`` announced by the
        sampler (``read`` False), or read by a batch of ``epoch`` (None: not a ShardSampler's)."""
        count = len(units.keys)
        if not read:
            counts = np.bincount(files, minlength=count)
            if self._first is not None:  # the epoch's first announcement names its first batch, read already
                counts = np.maximum(counts - np.bincount(self._first, minlength=count), 0)
                self._first = None
            self._announced += 1
            for k in np.flatnonzero(counts).tolist():
                self._soon.setdefault(k, collections.deque()).append([self._announced, int(counts[k])])
            return
        numbers, counts = np.unique(files, return_counts=True)
        if epoch is not None and epoch != self._left[0]:
            self._left = (epoch, np.bincount(units.of, minlength=count))
            self._soon, self._first = {}, files
        if epoch is not None and self.planned is not None and epoch == self.planned[0]:
            self.at += len(files)
        if epoch is not None:
            np.subtract.at(self._left[1], files, 1)
            self._unread = int(np.clip(self._left[1], 0, None).sum())
        for k, n in zip(numbers.tolist(), counts.tolist()):
            queue = self._soon.get(k)
            while queue and n:
                taken = min(n, queue[0][1])
                queue[0][1] -= taken
                n -= taken
                if not queue[0][1]:
                    queue.popleft()
            if queue is not None and not queue:
                del self._soon[k]

    def rank(self, k: int) -> Optional[int]:
        """When unit ``k`` is next needed, as far as this process knows: the announcement of
        its next records; after all of them when records of it are still unread this epoch, the
        later the fewer (in an order not yet known, the first of m of R unread records comes after
        R / (m + 1) on average); None when it is not known to be needed."""
        epoch, left = self._left  # the epoch of the batches read here (None: none, DataLoader workers read them)
        if self.planned is not None and self._current():
            uses = self.planned[1][k] if k < len(self.planned[1]) else np.zeros(0, np.int64)
            j = int(np.searchsorted(uses, self.at))
            return int(uses[j]) if j < len(uses) else None
        queue = self._soon.get(k)
        if queue:
            return queue[0][0]
        if epoch is None or k >= len(left) or left[k] <= 0:
            return None
        return self._announced + 1 + self._unread // (int(left[k]) + 1)

    def needed_before(self, units: Optional[Units], name: str, there: set[str], need: int) -> int:
        """Bytes of the units this process knows are needed before unit ``name`` and are not
        ``there`` (cached or being fetched): the room a prefetch of ``name`` must leave them, or it
        would push out what they need sooner, or be pushed out itself before its use (an LMDB
        file's size is known from its HEAD only: ``need`` stands in for it)."""
        if units is None or name not in units.numbers:
            return need
        mine = self.rank(units.numbers[name])
        if mine is None:
            return need
        total = 0
        for u, key in enumerate(units.keys):
            if key != name and key not in there:
                rank = self.rank(u)
                if rank is not None and rank < mine:
                    total += int(units.sizes[u]) or need
        return total
