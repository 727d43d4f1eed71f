"""The prefetches of a process: its background threads, and the turns their downloads take (in
the order the units are needed, as few receiving at once as keep up with the readers)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Optional

from ...errors import CacheWaitTimeout
from ...store.base import PerProcess
from . import settings
from .locks import waiting
from .settings import PREFETCH_UNITS

prefetcher = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(PREFETCH_UNITS, thread_name_prefix="packer-prefetch")
)


class Turns:
    """The downloads of a process's prefetches, in the order they are needed, as few receiving at once
    as keep up with the readers: one that waits for its turn (:meth:`turn`) starts once fewer
    than ``width`` are receiving and not finishing (a first-byte wait from their end at the rate
    they receive: :class:`Arrival`), so its first bytes come as their last do and the unit needed
    next does not share the bandwidth with those needed after it. ``width`` is 1 while one stream
    alone (its rate measured while it received alone) is faster than the readers consume; where
    it is not (a store whose GETs are capped, as S3's are), enough for their consumption, up to
    :data:`PREFETCH_UNITS`. A prefetch is entered when it is submitted to this process's threads
    (:meth:`enter`, with its rank: its next use); one waits for every one entered before it with a
    rank as low or lower (entered before, its thread has started: the threads take prefetches in
    the order submitted, so no wait is for one still queued behind it). A batch's own download
    (not entered) never waits."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: dict[tuple[str, str], tuple[int, int]] = {}  # (dataset, unit) -> (rank, order entered)
        self._entered = 0
        self._busy = 0  # downloads receiving and not finishing yet
        self.receiving = 0  # downloads between their turn and their end
        self._width = 1
        self._alone = 0.0  # bytes/s of one stream receiving alone (0.0: not measured yet)
        self._consumed = 0.0  # bytes/s the readers consume (0.0: not known yet)
        self._granted: dict[tuple[str, str], Arrival] = {}  # turns taken, their downloads not started

    def enter(
        self, key: tuple[str, str], rank: int, submit: Callable[[], concurrent.futures.Future]
    ) -> concurrent.futures.Future:
        """Prefetch ``key`` of ``rank``, entered and ``submit``-ted to the threads in one step (so
        the order entered is the order the threads take them, whatever thread submits)."""
        with self._changed:
            self._entered += 1
            self._waiting[key] = (rank, self._entered)
            return submit()

    def leave(self, key: tuple[str, str]) -> None:
        """``key``'s prefetch has ended (fetched, found cached, no room, failed): a turn it took and
        did not download in ends."""
        with self._changed:
            if self._waiting.pop(key, None) is not None:
                self._changed.notify_all()
            granted = self._granted.pop(key, None)
        if granted is not None:
            granted.end()

    def consumed(self, rate: float) -> None:
        """The readers consume ``rate`` bytes/s (the sampler's pace)."""
        with self._changed:
            self._consumed = rate
            self._widen()

    def alone(self, rate: float) -> None:
        """A stream received ``rate`` bytes/s alone."""
        with self._changed:
            self._alone = rate if not self._alone else (self._alone + rate) / 2
            self._widen()

    def _widen(self) -> None:
        if self._alone and self._consumed:
            need = math.ceil(_HEADROOM * self._consumed / self._alone)
            self._width = max(1, min(PREFETCH_UNITS, need))
            self._changed.notify_all()

    def turn(self, key: tuple[str, str], *, named: str) -> None:
        """Wait for prefetch ``key``'s turn (none for one not entered): taken before its unit's lock
        (packer.read.remote's lock discipline: no wait under a node lock), its download's
        :meth:`arrival`. ``named``: the unit's object, for the line a wait past the deadline raises."""
        limit = settings.wait_s()
        deadline = time.monotonic() + limit
        with self._changed:
            mine = self._waiting.get(key)
            if mine is None:
                return
            while self._busy >= self._width or any(w[1] < mine[1] and w[0] <= mine[0] for w in self._waiting.values()):
                waiting("a prefetch's turn")
                if not self._changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise CacheWaitTimeout(
                        f"{named}: its prefetch waited {limit:g} s for its turn behind this process's "
                        f"(pid {os.getpid()}) earlier ones ({settings.WAIT_ENV} sets the deadline)"
                    )
            del self._waiting[key]
            self._busy += 1
            self.receiving += 1
            self._granted[key] = Arrival(self, 0)

    def arrival(self, key: tuple[str, str], size: int) -> Arrival:
        """What the download of ``size`` bytes of ``key`` reports its progress to: the turn it took
        (:meth:`turn`), or none (a batch's own download, or one downloading again)."""
        with self._changed:
            granted = self._granted.pop(key, None)
        if granted is None:
            return Arrival(None, size)
        granted.start(size)
        return granted

    def finishing(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def ended(self) -> None:
        with self._changed:
            self.receiving -= 1


class Arrival:
    """A download's progress (called with each piece's bytes, from its parts' threads): it tells
    its :class:`Turns` when it is finishing (its bytes left would take no longer than its first
    byte did, at the rate it has received since) and has ended (:meth:`end`), and the rate it
    received at while no other download of the turns received."""

    def __init__(self, turns: Optional[Turns], size: int) -> None:
        self._turns, self._left = turns, size
        self._finished = turns is None
        self._asked = self._last = time.monotonic()
        self._first = 0.0
        self._since = 0  # bytes received after the first piece
        self._alone = [0, 0.0]  # bytes and seconds received alone, after the first piece
        self._lock = threading.Lock()

    def start(self, size: int) -> None:
        """The download of ``size`` bytes the turn was taken for starts now (its first-byte wait
        is counted from here, not from the turn: the unit's lock and its room came between)."""
        with self._lock:
            self._left = size
            self._asked = self._last = time.monotonic()

    def __call__(self, at: int, piece: bytes) -> None:
        now = time.monotonic()
        got = len(piece)
        with self._lock:
            self._left -= got
            last, self._last = self._last, now
            if self._turns is None:
                return
            if not self._first:
                self._first = now
                return
            self._since += got
            if self._turns.receiving == 1:
                self._alone[0] += got
                self._alone[1] += now - last
            # the rate over at least a first-byte wait: the pieces buffered while the first was read
            # come at once, and the rate of those few alone would call any download finishing
            wait = self._first - self._asked
            if not self._finished and self._left * max(now - self._first, wait) <= wait * self._since:
                self._finished = True
                self._turns.finishing()

    def end(self) -> None:
        with self._lock:
            turns, self._turns = self._turns, None
            if turns is None:
                return
            if not self._finished:
                turns.finishing()
            turns.ended()
            if self._alone[1] >= _ALONE_S:
                turns.alone(self._alone[0] / self._alone[1])


process_turns = PerProcess(Turns)
_PACE = 8  # the sampler's last announcements its pace is measured over
_HEADROOM = 1.1  # streams enough for this much more than the readers consume
_ALONE_S = 0.01  # the shortest time alone a stream's rate is measured over
