"""Resolution schedules: the training crop's side as a pure function of the epoch.

A schedule is given as ShardDataset's ``crop_size`` (:class:`Ramp`, :class:`Steps`, or any function
of the epoch returning a side). Each batch's side is the schedule's value for the batch's epoch: the
epoch a ShardSampler draw carries, or the dataset's shared-memory epoch that ``set_epoch`` sets
(which reaches persistent DataLoader workers). Nothing else is sent to the workers, so (seed,
epoch, draw) still fixes every sample, a resumed epoch gets its side back, and DDP ranks, each
computing it alone, agree.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

#: A side per epoch: a :class:`Ramp`, :class:`Steps` or a picklable function ``epoch -> side``.
Schedule = Callable[[int], int]
CropSize = Union[int, Schedule, None]


def _positive(name: str, value: Any) -> int:
    """``value`` as a positive int (a bool or a float is refused), else ValueError naming ``name``."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return n


@dataclass(frozen=True, kw_only=True)
class Ramp:
    """``sides[0]`` up to epoch ``epochs[0]``, ``sides[1]`` from epoch ``epochs[1]`` on, and in
    between the linear interpolation rounded to the nearest multiple of ``step`` (FFCV's
    ``min_res``/``max_res``/``start_ramp``/``end_ramp`` with its rounding to 32:
    ``Ramp(sides=(160, 192), epochs=(65, 76))``). Both sides must be multiples of ``step``, so every
    epoch's side lies between them."""

    sides: tuple[int, int]
    epochs: tuple[int, int]
    step: int = 32

    def __post_init__(self) -> None:
        step = _positive("Ramp step", self.step)
        sides = tuple(_positive("a Ramp side", s) for s in self.sides)
        if len(sides) != 2 or any(s % step for s in sides):
            raise ValueError(f"Ramp sides must be two multiples of step={step}, not {self.sides!r}")
        epochs = tuple(operator.index(e) for e in self.epochs)
        if len(epochs) != 2 or not 0 <= epochs[0] < epochs[1]:
            raise ValueError(
                f"Ramp epochs must be (start, end) with 0 <= start < end (a jump: Steps), not {self.epochs!r}"
            )
        object.__setattr__(self, "sides", sides)
        object.__setattr__(self, "epochs", epochs)

    def __call__(self, epoch: int) -> int:
        (low, high), (start, end) = self.sides, self.epochs
        if epoch <= start:
            return low
        if epoch >= end:
            return high
        # round half to even, as FFCV's np.round: one rule on every rank and machine
        return round((low + (high - low) * (epoch - start) / (end - start)) / self.step) * self.step


class Steps:
    """A side from each given epoch on: ``Steps({0: 128, 10: 160, 20: 192})`` (epoch 0 must be given)."""

    def __init__(self, sides: Mapping[int, int]) -> None:
        #: (first epoch, side) pairs in epoch order
        self.sides = tuple(sorted((operator.index(e), _positive("a Steps side", s)) for e, s in dict(sides).items()))
        if not self.sides or self.sides[0][0] != 0:
            raise ValueError(f"Steps needs the side of epoch 0 (and later epochs above it), not {sides!r}")

    def __call__(self, epoch: int) -> int:
        side = self.sides[0][1]
        for first, s in self.sides[1:]:
            if first > epoch:
                break
            side = s
        return side

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Steps) and other.sides == self.sides

    def __hash__(self) -> int:
        return hash(self.sides)

    def __repr__(self) -> str:
        return f"Steps({dict(self.sides)!r})"


def side(schedule: Schedule, epoch: int) -> int:
    """The schedule's side for ``epoch``; ValueError naming the epoch unless a positive integer."""
    value = schedule(epoch)
    try:
        return _positive("crop_size", value)
    except ValueError:
        raise ValueError(
            f"crop_size schedule {schedule!r} gave {value!r} for epoch {epoch}: a side is a positive integer"
        ) from None


def check_picklable(schedule: Schedule) -> None:
    """TypeError, saying why and what to do, when ``schedule`` cannot be pickled: a DataLoader worker
    started by spawn or forkserver gets a pickled copy of the dataset, its schedule included."""
    try:
        pickle.dumps(schedule)
    except Exception as e:  # pickle raises PicklingError, AttributeError or TypeError by case
        raise TypeError(
            f"crop_size schedule {schedule!r} cannot be pickled ({type(e).__name__}: {e}), which DataLoader "
            "workers started by spawn or forkserver need: define it as a module-level function (a lambda or a "
            "local function is not picklable), or use packer.read.resolution.Ramp or Steps"
        ) from None
