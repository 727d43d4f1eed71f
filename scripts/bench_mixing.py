#!/usr/bin/env python3
"""How well ShardSampler's orders mix a batch's labels, against a global shuffle, in one run.

    python scripts/bench_mixing.py                  # class-sorted layouts from 4 to 1,000 classes
    python scripts/bench_mixing.py --batch-size 256

A build stores records class by class, so a block order's batch holds as many classes as the blocks
it draws from. For each layout (classes x records per class, stored class by class) and block size
(records per cache unit, say), this prints the window ShardSampler chooses by default (its
``MIX_TARGET`` of a global shuffle's label entropy) and, over ``--epochs`` epochs of each order, the
mean label entropy per batch (packer.read.sampler.label_entropy) as a fraction of a global
shuffle's: the default window's, a window of 1 block, and the old fixed default of 16. Also the
seconds the sampler took to choose its window (it measures candidate orders when it is made).

The sampler reads only the dataset's length, labels and index lengths here, so each layout is an
object with those (building a million-record dataset to read its labels back would measure the build).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from packer import ShardSampler
from packer.read.sampler import MIX_BATCH, MIX_TARGET, label_entropy

LAYOUTS = ((4, 1000), (4, 8000), (16, 500), (100, 320), (1000, 130), (1000, 1300))


class Layout:
    """A dataset's labels stored class by class: what ShardSampler reads of a dataset to order it."""

    def __init__(self, classes: int, per_class: int) -> None:
        self.labels = np.repeat(np.arange(classes), per_class)
        self.index = {"length": np.full(len(self.labels), 30_000)}
        self.seed = 0

    def __len__(self) -> int:
        return len(self.labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=MIX_BATCH)
    p.add_argument("--blocks", default="16,64,256", help="records per block, comma-separated")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    b = args.batch_size
    print(f"batch {b}; label entropy per batch / a global shuffle's, mean of {args.epochs} epochs; target {MIX_TARGET}")
    print("| classes x records | block | default window (s to choose) | default | window 1 | window 16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for classes, per in LAYOUTS:
        ds = Layout(classes, per)
        shuffled = float(
            np.mean([label_entropy(ds.labels, np.random.default_rng(e).permutation(len(ds)), b) for e in range(9)])
        )
        for block in map(int, args.blocks.split(",")):
            t0 = time.perf_counter()
            chosen = ShardSampler(ds, order="block", block_size=block)
            took = time.perf_counter() - t0

            def mixing(s: ShardSampler, labels: np.ndarray = ds.labels, whole: float = shuffled) -> float:
                return float(np.mean([label_entropy(labels, s.sequence(e), b) for e in range(args.epochs)]) / whole)

            one, sixteen = (ShardSampler(ds, order="block", block_size=block, window=w) for w in (1, 16))
            print(
                f"| {classes} x {per} | {block} | {chosen.window} ({took:.2f}) | {mixing(chosen):.3f} | "
                f"{mixing(one):.3f} | {mixing(sixteen):.3f} |"
            )


if __name__ == "__main__":
    main()
