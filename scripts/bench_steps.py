#!/usr/bin/env python3
"""Per-sample steps of packer.transform against the alternatives they replaced, in one process and one
thread, per 224x224 crop (median of interleaved repeats): why each step is written as it is.

  - crop draws: one vectorized hash for a batch of 256 vs a numpy Generator per sample;
  - normalization to float32: torch.sub from uint8 (dynamic casting), copy + sub_ + mul_ with the
    constants broadcast per channel, the same with them repeated along rows (packer's torch path),
    and packer's compiled one-pass normalize;
  - packing Pillow's RGBX result to RGB bytes: Image.tobytes vs one encoder call (_raw_bytes).

    python scripts/bench_steps.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packer.transform import DRAWS, Augment, norm_constants, normalize_into
from packer.transform.normalize import _native, _row_constants, normalize_hwc
from packer.transform.resize import _raw_bytes

SIZE, BATCH = 224, 256
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    heights, widths = np.full(BATCH, 320), np.full(BATCH, 427)
    augment = Augment(SIZE)
    x = torch.from_numpy(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    out = torch.empty(SIZE, SIZE, 3)
    big = torch.empty(BATCH, SIZE, SIZE, 3)  # a batch bigger than the caches, written slot by slot
    m3, inv3 = norm_constants(MEAN, STD, (3,))
    row_m, row_inv = _row_constants(MEAN, STD, SIZE)
    small = Image.fromarray(x.numpy()).convert("RGBX")
    slot = iter(range(10**9))

    def generators() -> None:
        for i in range(BATCH):
            np.random.default_rng([0, 0, i]).random(DRAWS)

    steps: dict[str, tuple[Callable[[], object], int, int]] = {  # name -> (fn, calls, samples per call)
        "draws: hash, batch of 256": (lambda: augment.crops(0, 0, range(BATCH), heights, widths), 20, BATCH),
        "draws: a Generator per sample": (generators, 2, BATCH),
        "normalize: torch.sub from uint8": (lambda: torch.sub(x, m3, out=out).mul_(inv3), 20, 1),
        "normalize: per-channel broadcast": (lambda: normalize_into(x, out, m3, inv3), 50, 1),
        "normalize: rows (packer, torch)": (
            lambda: normalize_into(x.reshape(SIZE, -1), out.view(SIZE, -1), row_m, row_inv),
            200,
            1,
        ),
        "pack RGB: Image.tobytes": (lambda: small.tobytes("raw", "RGB"), 500, 1),
        "pack RGB: _raw_bytes": (lambda: _raw_bytes(small, "RGB"), 500, 1),
    }
    if _native is not None:
        steps["normalize: packer's compiled, into a batch"] = (
            lambda: normalize_hwc(x, big[next(slot) % BATCH], MEAN, STD),
            BATCH,
            1,
        )
        steps["normalize: rows (torch), into a batch"] = (
            lambda: normalize_into(x.reshape(SIZE, -1), big[next(slot) % BATCH].view(SIZE, -1), row_m, row_inv),
            BATCH,
            1,
        )
    runs: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, (fn, calls, samples) in steps.items():
            fn()
            runs[name].append(per_call_us(fn, calls) / samples)
    print(f"us per {SIZE}x{SIZE} sample, median of {args.repeats} interleaved repeats (one thread):")
    for name, values in runs.items():
        print(f"  {name:<44} {statistics.median(values):>9.2f}")


if __name__ == "__main__":
    main()
