"""Draw: a record index that carries the key of its augmentation, as ShardSampler yields it and
ShardDataset and MixDataset read it (its own module: the datasets need the type, the sampler needs the
datasets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Ranges = tuple[tuple[int, int], ...]  # record ranges (first, end)
#: A sampler's order of one rank's draws of an epoch, for the processes that read them but do not
#: iterate it (DataLoader workers): epoch -> (global draw positions ascending, the record of each).
Order = Callable[[int], tuple[np.ndarray, np.ndarray]]


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
