"""Draw: a record index that carries the key of its augmentation, as ShardSampler yields it and
ShardDataset and MixDataset read it; Planned: the seam through which ShardSampler tells a dataset
its plan (its own module: the datasets need the types, the sampler needs the datasets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

Ranges = tuple[tuple[int, int], ...]  # record ranges (first, end)
#: A sampler's order of one rank's draws of an epoch, for the processes that read them but do not
#: iterate it (DataLoader workers): epoch -> (global draw positions ascending, the record of each).
Order = Callable[[int], tuple[np.ndarray, np.ndarray]]


@runtime_checkable
class Planned(Protocol):
    """What ShardSampler tells a dataset that has these methods of the order it will be read in
    (ShardDataset and MixDataset have them: a dataset in object storage evicts and prefetches its
    node cache by it, packer.read.remote; any Dataset may). The sampler calls, in the process that
    iterates it:

    - :meth:`ordered_by` once, as it is made: ``order`` gives this rank's draws of an epoch, for
      the dataset's copies in DataLoader workers, which do not iterate the sampler;
    - :meth:`will_read` as each epoch's iteration starts: the records this rank reads, in order;
    - :meth:`fetch_ahead` as it announces blocks it will yield soon (``order="block"``): their
      record ``ranges``, and how many of the epoch's draws were yielded before the previous
      announcement (``read``); True where the dataset fetched them in this process (the draw then
      carries no ``ahead`` for the worker that reads it)."""

    def ordered_by(self, order: Order) -> None: ...

    def will_read(self, epoch: int, records: np.ndarray) -> None: ...

    def fetch_ahead(self, epoch: int, read: int, ranges: Ranges) -> bool: ...


class Draw(int):
    """A record index drawn by :class:`~packer.read.sampler.ShardSampler`, carrying the key of its
    augmentation: the epoch and its position ``draw`` in the epoch's global sequence. ``int(d)`` is
    the record.
    ``ahead``: record ranges ``(first, end)`` that will be read soon (``order="block"``: the blocks
    of the next window, on the window's first draw), for the dataset to ask of the disk at once."""

    epoch: int
    draw: int
    ahead: Ranges

    def __new__(cls, record: int, epoch: int, draw: int, ahead: Ranges = ()) -> Draw:
        self = int.__new__(cls, record)
        self.epoch, self.draw, self.ahead = epoch, draw, ahead
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return Draw, (int(self), self.epoch, self.draw, *((self.ahead,) if self.ahead else ()))

    def __repr__(self) -> str:
        more = f", ahead={self.ahead}" if self.ahead else ""
        return f"Draw(record={int(self)}, epoch={self.epoch}, draw={self.draw}{more})"
