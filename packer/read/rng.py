"""Per-sample random state for user transforms, so that third-party augmentation is as reproducible as
packer's own crops.

A ``transform`` given to :class:`~packer.read.dataset.ShardDataset` usually draws from a global random
number generator: torchvision's from torch's, albumentations-style numpy code from numpy's, older
code from Python's ``random``. In a DataLoader worker those streams depend on the worker and on what
it fetched before, so the same sample would be augmented differently with another ``num_workers``
or after a resume. packer therefore runs each sample's transform with all three global generators
seeded from the sample's key - (seed, epoch, draw), the same key as its crop - and restores the
process's own states afterwards: saved and restored once per batch, seeded per sample (what that
costs: docs/PERFORMANCE.md, "User transforms").

Code that takes a generator instead of using the global one gets the sample's own
:func:`generator`; :func:`sample_seed` gives the seed itself (for a library with its own generator).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Optional

import numpy as np
import torch

from ..transform.draws import _mix, sample_keys

_MASK63 = (1 << 63) - 1
_MASK32 = (1 << 32) - 1

#: One batch's transforms at a time per process: the global generators are process-wide, so two
#: threads transforming at once would draw from each other's seeds.
_LOCK = threading.RLock()
_current = threading.local()  # seed: this sample's; generator: this thread's, reseeded lazily


def sample_seeds(seed: int, epoch: int | np.ndarray, keys: np.ndarray) -> list[int]:
    """A 63-bit seed per sample from (seed, epoch, key): counter 0 of packer.transform's per-sample
    hash (the crop uses counters 1-41), so the seed is independent of the crop's draws."""
    with np.errstate(over="ignore"):
        bits = _mix(sample_keys(seed, epoch, keys))
    return [int(b) & _MASK63 for b in bits.tolist()]


@contextlib.contextmanager
def seeded_samples() -> Iterator[Callable[[int], None]]:
    """Save torch's, numpy's and Python's global random states, yield ``seed(s)`` that seeds all
    three (and this sample's :func:`generator`) for one sample, and restore the states on exit."""
    with _LOCK:
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            yield _seed
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])
            _current.seed = None


def _seed(s: int) -> None:
    torch.default_generator.manual_seed(s)  # the CPU generator only: workers do not touch CUDA's
    np.random.seed(s & _MASK32)  # numpy's legacy global generator takes 32-bit seeds
    random.seed(s)
    _current.seed = s
    _current.fresh = False


def sample_seed() -> Optional[int]:
    """The seed of the sample whose transform is running (None outside one)."""
    return getattr(_current, "seed", None)


def generator() -> torch.Generator:
    """A torch.Generator seeded for the sample whose transform is running, for code that takes one
    (``torch.rand(..., generator=packer.read.rng.generator())``). One object per thread, reseeded on the
    first call for each sample. Outside a transform: RuntimeError."""
    s = sample_seed()
    if s is None:
        raise RuntimeError("packer.read.rng.generator() is only defined inside a ShardDataset transform")
    g = getattr(_current, "generator", None)
    if g is None:
        g = _current.generator = torch.Generator()
    if not _current.fresh:
        g.manual_seed(s)
        _current.fresh = True
    return g
