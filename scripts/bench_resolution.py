#!/usr/bin/env python3
"""Read speed at each training resolution, on the same records: what a resolution schedule's epochs cost.

ShardDataset (RandomResizedCrop + flip, uint8, a DataLoader with num_workers = cores) at sides 128,
160, 192, 224 and 288 over one JPEG dataset of generated photos stored at 427x320 (bench_read.py's
small dataset: packer.tools.sample's 480x360 photos, built with the defaults), in interleaved
rounds (each side once per round, so drifting machine load hits all alike); figures are medians,
ratios against 224 from the same run. "CPU us/sample" counts the main process and the workers,
so it holds on a loaded machine where samples/s does not.

    python scripts/bench_resolution.py                 # ~5 minutes on 2 cores
    python scripts/bench_resolution.py --rounds 3 --samples 1024
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

# bench_read.py (beside this file) puts the repository on sys.path: packer comes from this tree
from bench_read import small_dataset

from packer.read.dataset import ShardDataset
from packer.tools.bench import cores, measure
from packer.transform import resize_backend

SIDES = (128, 160, 192, 224, 288)
BASE = 224


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1000, help="records in the dataset (generated once, cached)")
    ap.add_argument("--samples", type=int, default=2048, help="samples per measurement")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=cores())
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    w, bs = args.workers, args.batch_size
    path = small_dataset(args.images, w)
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: {args.images} records (427x320 JPEG), "
        f"{w} workers, batch {bs}, {args.samples} samples a run, {args.rounds} rounds; resize by {resize_backend()}",
        flush=True,
    )
    rates: dict[int, list[float]] = {s: [] for s in SIDES}
    cpu: dict[int, list[float]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES:
            point = measure(ShardDataset(path, crop_size=side, dtype=torch.uint8), w, bs, args.samples)
            rates[side].append(point.samples_per_s)
            cpu[side].append(point.cpu_us_per_sample)
            print(
                f"  round {r + 1}: {side:>3} px {point.samples_per_s:>8,.0f} samples/s "
                f"{point.cpu_us_per_sample:>6,.0f} CPU us/sample",
                flush=True,
            )
    rate = {s: statistics.median(v) for s, v in rates.items()}
    us = {s: statistics.median(v) for s, v in cpu.items()}
    print(f"\nmedians of {args.rounds} rounds; ratios against {BASE} px (CPU: {BASE}'s CPU us / this side's)")
    print("| side | samples/s | CPU us/sample | samples/s vs 224 | CPU vs 224 |")
    print("|---:|---:|---:|---:|---:|")
    for s in SIDES:
        print(f"| {s} | {rate[s]:,.0f} | {us[s]:,.0f} | {rate[s] / rate[BASE]:.2f}x | {us[BASE] / us[s]:.2f}x |")


if __name__ == "__main__":
    main()
