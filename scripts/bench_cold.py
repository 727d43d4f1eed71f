"""Cold vs warm reads: one epoch of ShardDataset with the dataset's pages evicted from the page cache
first, then one with them cached, through the same DataLoader settings.

A dataset that fits in RAM is read from disk only in its first epoch; one that does not is read from
disk every epoch, so its speed is the cold figure. Eviction uses posix_fadvise(DONTNEED) on the
dataset's files (what `vmtouch -e` does: no root needed, other files untouched); each measurement
gets fresh DataLoader workers, so no process still maps the evicted pages.

    python scripts/bench_cold.py                         # 2,000 generated photos, raw and JPEG, LMDB
    python scripts/bench_cold.py --backend memmap --repeats 5
    python scripts/bench_cold.py --formats raw --memory-limit 650                    # bigger than its page
    python scripts/bench_cold.py --images 20000 --formats jpeg --memory-limit 650    # cache (needs root)
    python scripts/bench_cold.py --formats raw --memory-limit 650 --orders random,block   # ShardSampler orders

Prints samples/s and MB/s of records per epoch (medians of the repeats, each epoch every record once,
in a new random order), and how much of the dataset was cached before each epoch (fincore-style,
through mincore). With --memory-limit the "warm" epoch is one more read from disk. --orders compares
ShardSampler's orders ("random", "block": locality order) and prints each one's label mix per batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagecache import cached_fraction, evict

from packer.bench import cores, disk_bytes
from packer.dataset import ShardDataset
from packer.sample import make_folder
from packer.sampler import ShardSampler

CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "packer-bench"


def limit_memory(mib: int) -> str:
    """Move this process (and so its DataLoader workers) into a memory cgroup of ``mib`` MiB, so that
    the page cache left beside the processes' own memory is smaller than the dataset: every epoch then
    reads from disk, as with a dataset bigger than RAM. Needs root; cgroup v2 or v1's memory controller."""
    v2, v1 = Path("/sys/fs/cgroup/cgroup.controllers"), Path("/sys/fs/cgroup/memory")
    if v2.exists() and "memory" in v2.read_text().split():
        group, limit_file = Path("/sys/fs/cgroup/packer-bench-cold"), "memory.max"
    elif v1.is_dir():
        group, limit_file = v1 / "packer-bench-cold", "memory.limit_in_bytes"
    else:
        sys.exit("--memory-limit needs a cgroup memory controller (v2, or v1 at /sys/fs/cgroup/memory)")
    try:
        group.mkdir(exist_ok=True)
        (group / limit_file).write_text(str(mib * 2**20))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        sys.exit(f"--memory-limit: cannot set up {group} ({e}); run as root")
    return str(group)


def epoch(dataset: Path, workers: int, batch_size: int, seed: int, order: str) -> float:
    """Seconds for one epoch (every record once, in ShardSampler's ``order``) with fresh workers."""
    ds = ShardDataset(dataset, dtype=torch.uint8)
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=ShardSampler(ds, seed=seed, order=order),
        num_workers=workers,
        drop_last=False,
    )
    t0 = time.perf_counter()
    n = sum(len(labels) for _, labels in loader)
    assert n == len(ds)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "memmap"])
    ap.add_argument("--workers", type=int, default=cores())
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", dest="images", type=int, default=2000)
    ap.add_argument(
        "--memory-limit",
        type=int,
        metavar="MIB",
        help="run in a memory cgroup this big (root): a dataset bigger than what it leaves for the "
        "page cache is read from disk every epoch",
    )
    ap.add_argument("--formats", default="raw,jpeg", help="record formats to build and read")
    ap.add_argument("--orders", default="random", help="ShardSampler orders to compare: random, block")
    args = ap.parse_args()
    from packer import build

    raw = CACHE / f"raw-{args.images}-480x360"
    make_folder(raw, args.images, (480, 360), args.workers)
    suffix = ".lmdb" if args.backend == "lmdb" else ""
    datasets = {}
    for fmt in args.formats.split(","):
        out = CACHE / f"cold-{args.images}-{fmt}-{args.backend}{suffix}"
        if not out.exists():
            build(raw, out, format=fmt, backend=args.backend, workers=args.workers, quiet=True)
        datasets[fmt] = out
    if args.memory_limit:  # after the builds: only the reads run in the cgroup
        print(f"in memory cgroup {limit_memory(args.memory_limit)} ({args.memory_limit} MiB)")
    print(
        f"{args.images} records (427x320 stored), {args.backend}, {args.workers} workers, batch {args.batch_size}, "
        f"RandomResizedCrop 224 + flip, uint8, {args.repeats} repeats; a cold epoch reads every record from disk"
    )
    orders = args.orders.split(",")
    for fmt, path in datasets.items():
        size = disk_bytes(path)
        rates: dict[tuple[str, str], list[float]] = {(o, kind): [] for o in orders for kind in ("cold", "warm")}
        cached: dict[tuple[str, str], list[float]] = {key: [] for key in rates}
        for r in range(args.repeats):
            for order in orders:  # interleaved
                evict(path)
                for kind in ("cold", "warm"):  # the warm epoch reads what the cold one brought in
                    cached[order, kind].append(cached_fraction(path))
                    rates[order, kind].append(args.images / epoch(path, args.workers, args.batch_size, r, order))
        for (order, kind), v in rates.items():
            med = statistics.median(v)
            print(
                f"  {fmt:<5} {order:<6} {kind}: {med:>8,.0f} samples/s, {med * size / args.images / 1e6:>7,.0f} MB/s "
                f"of records (runs {', '.join(f'{x:,.0f}' for x in v)}; cached before: "
                f"{statistics.median(cached[order, kind]):.0%}); dataset {size / 1e6:,.0f} MB"
            )
        if len(orders) > 1 or orders != ["random"]:
            for order in orders:
                print(f"  {fmt:<5} {order:<6} label mix: {label_mix(path, order, args.batch_size)}")


def label_mix(dataset: Path, order: str, batch_size: int) -> str:
    """How far a batch's labels are from the dataset's label distribution, over an epoch's batches:
    the mean total variation distance (0: every batch mixed like the dataset; 1: one class only the
    dataset does not have) and the mean number of classes per batch."""
    ds = ShardDataset(dataset)
    labels = ds.labels[ShardSampler(ds, order=order).sequence(0)]
    classes = len(ds.classes)
    overall = np.bincount(labels, minlength=classes) / len(labels)
    tv, present = [], []
    for k in range(0, len(labels) - batch_size + 1, batch_size):
        counts = np.bincount(labels[k : k + batch_size], minlength=classes)
        tv.append(0.5 * np.abs(counts / batch_size - overall).sum())
        present.append((counts > 0).sum())
    return (
        f"distance to the dataset's label mix {np.mean(tv):.3f} per batch, {np.mean(present):.1f} of "
        f"{classes} classes per batch"
    )


if __name__ == "__main__":
    main()
