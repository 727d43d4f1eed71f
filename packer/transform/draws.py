"""Random draws as pure functions of (seed, epoch, index): a counter-based hash, splitmix64's.

Every draw for sample ``i`` in epoch ``e`` is a hash of (seed, e, i, draw number), so a sample's crop
does not depend on which worker fetches it, how many workers there are, or what was fetched before,
and a whole batch's draws are one vectorized numpy pass instead of a generator object per sample
(docs/PERFORMANCE.md, "Per-sample steps").
"""

from __future__ import annotations

import numpy as np

#: Random draws per train sample: 10 RandomResizedCrop tries x (area, aspect, top, left), then flip.
DRAWS = 41

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective avalanche on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def sample_keys(seed: int, epoch: int | np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One uint64 key per sample, a hash of (seed, epoch, index); ``epoch`` is one value or one per
    sample (draws from packer.read.sampler carry their own)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed & (2**64 - 1)], dtype=np.uint64) * _GOLDEN)
        key = _mix((key ^ np.asarray(epoch, dtype=np.int64).astype(np.uint64)) * _GOLDEN)
        return _mix((key ^ np.asarray(indices, dtype=np.int64).astype(np.uint64)) * _GOLDEN)


def uniforms(seed: int, epoch: int | np.ndarray, indices: np.ndarray, count: int) -> np.ndarray:
    """A ``len(indices) x count`` array of floats in [0, 1); entry (k, j) depends only on
    (seed, epoch, indices[k], j): the counter-based scheme of splitmix64 with a per-sample key
    (counters 1..count; counter 0 is packer.read.rng's per-sample seed)."""
    with np.errstate(over="ignore"):
        bits = _mix(sample_keys(seed, epoch, indices)[:, None] + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
    return (bits >> _U64(11)).astype(np.float64) * 2.0**-53
