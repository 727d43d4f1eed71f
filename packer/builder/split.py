"""``build --split val=0.05``: a deterministic train/val/... assignment that never moves an existing file.

Each file draws ``u`` = the first 8 bytes of ``sha256(f"{seed}:{rel}")`` (big-endian) / 2**64 and lands
in the first named split whose cumulative fraction exceeds ``u`` (in the order given), else in ``train``.
``u`` depends on nothing but the seed and the file's own path, so adding or deleting other files never
moves it. Each class is cut at the same fractions, so every split holds each class in the requested
proportion in expectation (a class of a few files can deviate; exact per-class counts would need ranks,
which shift when files are added). Ignored and missing entries are assigned the same way, so the
per-split ``scanned`` counts add up to the whole scan.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..backends import BACKENDS
from .scan import Scan

TRAIN = "train"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SUFFIXES = tuple(b.suffix for b in BACKENDS.values() if b.suffix)  # a split named val.lmdb would clash


def check_splits(splits: dict[str, float]) -> None:
    """Raise ValueError unless the names are usable folder names and the fractions leave room for train."""
    for name, fraction in splits.items():
        if not _NAME.fullmatch(name) or name == TRAIN or name.endswith(_SUFFIXES):
            raise ValueError(
                f"--split name {name!r} must be a plain name other than {TRAIN!r} "
                f"(letters, digits, '_', '-', '.'); {TRAIN} is the remainder"
            )
        if not 0 < fraction < 1:
            raise ValueError(f"--split {name}={fraction:g}: the fraction must be between 0 and 1")
    if sum(splits.values()) >= 1:
        raise ValueError(f"--split fractions add up to {sum(splits.values()):g}; they must leave some for {TRAIN}")


def split_of(rel: str, splits: dict[str, float], seed: int) -> str:
    """The split of the file at ``rel`` (relative to raw/); see the module docstring."""
    digest = hashlib.sha256(f"{seed}:{rel}".encode("utf-8", "surrogateescape")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    upper = 0.0
    for name, fraction in splits.items():
        upper += fraction
        if u < upper:
            return name
    return TRAIN


def split_scan(found: Scan, splits: dict[str, float], seed: int) -> dict[str, Scan]:
    """One sub-scan per split, ``train`` first; all share ``found.classes`` (the same label ids)."""
    names = [TRAIN, *splits]
    number = {name: k for k, name in enumerate(names)}
    of = np.fromiter((number[split_of(rel, splits, seed)] for rel in found.sources.paths), np.int16, len(found.sources))
    where = {rel: split_of(rel.rstrip("/"), splits, seed) for rel, _ in found.ignored + found.missing}

    def member(name: str) -> Callable[[str], bool]:
        return lambda rel: where[rel] == name

    return {name: found.subset(of == k, member(name)) for k, name in enumerate(names)}


def split_path(out: str | os.PathLike, name: str, backend: str) -> Path:
    """Where split ``name`` goes inside OUT: ``OUT/val.lmdb`` for LMDB, ``OUT/val/`` for memmap."""
    return Path(out) / (name + BACKENDS[backend].suffix)
