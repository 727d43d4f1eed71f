#!/usr/bin/env python3
"""Cost of the LMDB page check (packer/backends/lmdbguard.py) next to liblmdb's own lookup.

Builds two LMDB datasets (JPEG and raw records) of N generated 64x48 images, then per format, over
5 repeats (medians): the first check of every record by a fresh PageGuard (what a process pays once
per record), the check of a 256-record batch once every record is known, and ``txn.get`` alone.

    python scripts/bench_guard.py /tmp/guard 2000
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer import build  # noqa: E402
from packer.backends.lmdb import LmdbReader  # noqa: E402
from packer.backends.lmdbguard import P_LEAF, PageGuard  # noqa: E402
from packer.backends.pin import pin  # noqa: E402


def main(base: Path, n: int) -> None:
    raw = base / "raw"
    if not raw.exists():
        rng = np.random.default_rng(0)
        for i in range(n):
            path = raw / f"c{i % 10}" / f"{i:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path)
    for fmt in ("jpeg", "raw"):
        out = base / f"{fmt}.lmdb"
        if not out.exists():
            build(raw, out, format=fmt, quiet=True, workers=2)
        pinned = pin(str(out))
        reps = []
        for _ in range(5):
            guard = PageGuard(pinned.data_fds[0], n)  # an LMDB dataset of one segment
            t = time.perf_counter()
            for i in range(n):
                guard.length(i)
            first = (time.perf_counter() - t) / n
            reader = LmdbReader(pinned)
            batch = list(range(256))
            reader._check_pages(batch)
            t = time.perf_counter()
            for _ in range(50):
                reader._check_pages(batch)
            known = (time.perf_counter() - t) / 50 / len(batch)
            txn = reader.txn()
            t = time.perf_counter()
            for i in range(n):
                txn.get(b"%010d" % i)
            get = (time.perf_counter() - t) / n
            reps.append((first, known, get))
        first, known, get = np.median(np.array(reps), axis=0)
        leaves = sum(1 for page in guard.pages.values() if page[0] == P_LEAF)
        print(
            f"{fmt}: {n} records on {leaves} leaf pages: first check {first * 1e6:.2f} us/record, "
            f"once known {known * 1e6:.3f} us/record; txn.get {get * 1e6:.2f} us/record"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2000)
