"""The label arrays of a dataset as stored and read (the labels CSV and class list: packer.builder.labels):
a "multi" dataset's multi-hot rows bit-packed in labels.npy, the per-kind counts and sampler weights
computed from them, and the manifest's ``labels_digest`` over labels.npy and targets.npy."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Optional

import numpy as np

SEPARATOR = ";"  # between the labels of one image in --multi-label mode (a CSV cell, a shown label)


def pack(ids: Sequence[Sequence[int]], n_classes: int) -> np.ndarray:
    """Multi-hot rows, bit-packed little-endian: bit ``c % 8`` of byte ``c // 8`` is class ``c``."""
    out = np.zeros((len(ids), (n_classes + 7) // 8), dtype=np.uint8)
    rows = np.repeat(np.arange(len(ids)), [len(x) for x in ids])
    flat = np.fromiter((c for x in ids for c in x), dtype=np.int64, count=len(rows))
    np.bitwise_or.at(out, (rows, flat >> 3), (1 << (flat & 7)).astype(np.uint8))
    return out


def unpack(packed: np.ndarray, n_classes: int) -> np.ndarray:
    """Bit-packed multi-hot rows -> a uint8 0/1 array of ``n_classes`` columns."""
    return np.unpackbits(np.asarray(packed), axis=1, count=n_classes, bitorder="little")


def class_counts(kind: str, labels: np.ndarray, multi: Optional[np.ndarray], n_classes: int) -> np.ndarray:
    """Records per class ("class"), per label ("multi": an image counts once for each of its labels),
    none ("none")."""
    if kind == "multi":
        assert multi is not None, "multi-label datasets carry their label rows"
        counts = np.zeros(n_classes, dtype=np.int64)
        for start in range(0, len(multi), 1 << 16):  # bounded memory for big datasets
            counts += unpack(multi[start : start + (1 << 16)], n_classes).sum(axis=0, dtype=np.int64)
        return counts
    if kind == "none":
        return np.zeros(0, dtype=np.int64)
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=n_classes)


def sample_weights(kind: str, labels: np.ndarray, multi: Optional[np.ndarray], n_classes: int) -> np.ndarray:
    """Per-record weights that balance the classes under ``WeightedRandomSampler``.

    "class": 1 / (records of its class), so every class carries the same total weight. "multi":
    1 / (the mean count of its labels), the same rule averaged over an image's labels; images with no
    label count as one more class (1 / their number). "none": uniform (nothing to balance).
    """
    if kind == "none":
        return np.ones(len(labels), dtype=np.float64)
    counts = class_counts(kind, labels, multi, n_classes).astype(np.float64)
    if kind == "class":
        return 1.0 / counts[labels]
    assert multi is not None, "multi-label datasets carry their label rows"
    weights = np.empty(len(multi), dtype=np.float64)
    for start in range(0, len(multi), 1 << 16):
        hot = unpack(multi[start : start + (1 << 16)], n_classes)
        k = hot.sum(axis=1)
        total = hot @ counts
        weights[start : start + len(hot)] = np.divide(k, total, out=np.zeros(len(hot)), where=k > 0)
    empty = weights == 0
    weights[empty] = 1.0 / max(int(empty.sum()), 1)
    return weights


def arrays_digest(multi: Optional[np.ndarray], targets: Optional[np.ndarray]) -> str:
    """manifest ``labels_digest``: sha256 of labels.npy's then targets.npy's data ("" with neither)."""
    if multi is None and targets is None:
        return ""
    h = hashlib.sha256()
    for a in (multi, targets):
        if a is not None:
            h.update(np.ascontiguousarray(a).view(np.uint8).data)
    return "sha256:" + h.hexdigest()
