"""Cold vs warm reads: one epoch of ShardDataset with the dataset's pages evicted from the page cache
first, then one with them cached, through the same DataLoader settings.

A dataset that fits in RAM is read from disk only in its first epoch; one that does not is read from
disk every epoch, so its speed is the cold figure. Eviction uses posix_fadvise(DONTNEED) on the
dataset's files (what `vmtouch -e` does: no root needed, other files untouched); each measurement
gets fresh DataLoader workers, so no process still maps the evicted pages.

    python scripts/bench_cold.py                         # 2,000 generated photos, raw and JPEG, LMDB
    python scripts/bench_cold.py --backend memmap --repeats 5
    python scripts/bench_cold.py --formats raw --memory-limit 650                    # bigger than its page
    python scripts/bench_cold.py --images 8000 --noise --formats jpeg --memory-limit 650   # cache (root)
    python scripts/bench_cold.py --formats raw --memory-limit 650 --orders random,block --probe
    python scripts/bench_cold.py --images 8000 --noise --formats jpeg --memory-limit 650 --iops 1000 \
        --orders random,block:0,block       # a disk that pays per request (cgroup throttling)

Prints samples/s and MB/s of records per epoch (medians of the repeats, each epoch every record once,
in a new random order), and how much of the dataset was cached before each epoch (fincore-style,
through mincore). With --memory-limit the cold epoch runs in the memory cgroup and the reference
("cached") one outside it, after the dataset was read into the page cache; the ratio cold / cached
is taken per repeat (adjacent epochs: the machine's load moves both). --orders compares
ShardSampler's orders ("random"; "block": locality order with its block prefetch, "block:0"
without it, "block:2" two windows ahead) and prints each one's label mix per batch. --probe first measures
the physical limits: the disk's sequential bandwidth on the dataset's files and the decode rate.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagecache import cached_fraction, evict, files

from packer.backends.lmdb import close_lmdb
from packer.read.dataset import ShardDataset
from packer.read.sampler import ShardSampler
from packer.tools.bench import cores, disk_bytes
from packer.tools.sample import make_folder

CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "packer-bench"


def limit(mib: int, iops: int, dataset: Path) -> list[tuple[Path, Path]]:
    """(cgroup, its hierarchy's root) pairs for :func:`enter`, set up so that inside them the page
    cache left beside the processes' own memory is ``mib`` MiB less their memory (smaller than the
    dataset: every epoch reads from disk, as with a dataset bigger than RAM), and, with ``iops``,
    the disk holding ``dataset`` serves that many read requests a second (a disk that pays per
    request: a cloud volume's IOPS budget, an HDD's seeks). Needs root; cgroup v2, or v1's memory
    and blkio controllers."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    device = _disk(dataset)
    if unified.exists():  # one group with both limits (the io controller enabled for children)
        group = Path("/sys/fs/cgroup/packer-bench-cold")
        settings = [(group, "memory.max", str(mib * 2**20))]
        settings += [(group, "io.max", f"{device} riops={iops}")] if iops else []
    elif Path("/sys/fs/cgroup/memory").is_dir():
        settings = [(Path("/sys/fs/cgroup/memory/packer-bench-cold"), "memory.limit_in_bytes", str(mib * 2**20))]
        blkio = Path("/sys/fs/cgroup/blkio/packer-bench-cold")  # also counts the reads (disk_reads)
        settings += (
            [(blkio, "blkio.throttle.read_iops_device", f"{device} {iops or 0}")] if blkio.parent.is_dir() else []
        )
    else:
        sys.exit("--memory-limit needs a cgroup memory controller (v2, or v1 at /sys/fs/cgroup/memory)")
    try:
        for group, name, value in settings:
            group.mkdir(exist_ok=True)
            (group / name).write_text(value)
    except OSError as e:
        sys.exit(f"--memory-limit/--iops: cannot set up {group}/{name} ({e}); run as root")
    return list(dict.fromkeys((group, group.parent) for group, _, _ in settings))


def disk_reads(groups: list[tuple[Path, Path]]) -> tuple[int, int]:
    """(read requests, bytes read) from disk by the processes of the limited cgroups so far (cgroup
    v1 blkio's counters, v2 io.stat); (0, 0) where neither is there."""
    for group, _ in groups:
        v1, v2 = group / "blkio.throttle.io_serviced", group / "io.stat"
        if v1.exists():
            requests = sum(int(line.split()[2]) for line in v1.read_text().splitlines() if " Read " in line)
            service = (group / "blkio.throttle.io_service_bytes").read_text().splitlines()
            return requests, sum(int(line.split()[2]) for line in service if " Read " in line)
        if v2.exists():
            fields = [f.split("=") for line in v2.read_text().splitlines() for f in line.split()[1:]]
            return sum(int(v) for k, v in fields if k == "rios"), sum(int(v) for k, v in fields if k == "rbytes")
    return 0, 0


def _disk(path: Path) -> str:
    """ "major:minor" of the whole disk holding ``path`` (a partition's parent): what I/O limits name."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (sysfs / "partition").exists():
        return (sysfs.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def make_noise_folder(out: Path, count: int, size: tuple[int, int], classes: int = 4) -> None:
    """``count`` JPEGs of seeded uniform noise (q95) in ``classes`` class folders, once: they
    compress poorly (~110 KB a record at 427x320, q90; the photos' are ~25 KB), so a JPEG dataset
    bigger than a cgroup's page cache takes few records to build. Decoding them costs more too."""
    if (out / "done").exists():
        return
    rng = np.random.default_rng(0)
    w, h = size
    for k in range(count):
        folder = out / f"class{k % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"{k:06d}.jpg", quality=95)
    (out / "done").touch()


def enter(groups: list[tuple[Path, Path]], limited: bool) -> None:
    """Move this process into the limited cgroups, or back to their roots; DataLoader workers
    started later are born there."""
    for group, root in groups:
        ((group if limited else root) / "cgroup.procs").write_text(str(os.getpid()))


def warm(dataset: Path) -> None:
    """Read the dataset's files whole, so that the next epoch finds every page cached."""
    for f in files(dataset):
        with open(f, "rb") as fh:
            while fh.read(1 << 22):
                pass


def sampler(ds: ShardDataset, seed: int, order: str) -> ShardSampler:
    """ShardSampler in ``order``; "block:N": block order prefetching N windows ahead (0: none)."""
    name, _, ahead = order.partition(":")
    return ShardSampler(ds, seed=seed, order=name, prefetch=int(ahead or 1))


def epoch(dataset: Path, workers: int, batch_size: int, seed: int, order: str) -> float:
    """Seconds for one epoch (every record once, in ShardSampler's ``order``) with fresh workers."""
    ds = ShardDataset(dataset, dtype=torch.uint8)
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler(ds, seed, order),
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
    ap.add_argument(
        "--iops",
        type=int,
        default=0,
        help="with --memory-limit: the disk serves the cold epochs this many read requests a second "
        "(cgroup I/O throttling: a disk that pays per request)",
    )
    ap.add_argument("--formats", default="raw,jpeg", help="record formats to build and read")
    ap.add_argument(
        "--orders",
        default="random",
        help="ShardSampler orders to compare: random, block, block:N (block order asking for the "
        "blocks N windows ahead; block:0 asks for none; block is block:1)",
    )
    ap.add_argument(
        "--noise",
        action="store_true",
        help="generate noise images (JPEG records ~8x bigger than the photos': a JPEG dataset bigger "
        "than the cgroup's page cache from few records)",
    )
    ap.add_argument("--probe", action="store_true", help="first measure disk bandwidth and decode speed")
    args = ap.parse_args()
    from packer import build

    if args.noise:
        raw = CACHE / f"noise-{args.images}-480x360"
        make_noise_folder(raw, args.images, (480, 360))
    else:
        raw = CACHE / f"raw-{args.images}-480x360"
        make_folder(raw, args.images, (480, 360), args.workers)
    suffix = ".lmdb" if args.backend == "lmdb" else ""
    datasets = {}
    for fmt in args.formats.split(","):
        out = CACHE / f"cold-{args.images}{'-noise' if args.noise else ''}-{fmt}-{args.backend}{suffix}"
        if not out.exists():
            build(raw, out, format=fmt, backend=args.backend, workers=args.workers, quiet=True)
        datasets[fmt] = out
    if args.iops and not args.memory_limit:
        sys.exit("--iops goes with --memory-limit")
    groups = limit(args.memory_limit, args.iops, CACHE) if args.memory_limit else []  # after the builds
    if groups:
        iops = f", {args.iops} read requests/s" if args.iops else ""
        print(f"cold epochs in cgroups {[str(g) for g, _ in groups]} ({args.memory_limit} MiB{iops}); cached outside")
    print(
        f"{args.images} records ({'noise' if args.noise else 'photos'}, 427x320 stored), {args.backend}, "
        f"{args.workers} workers, batch {args.batch_size}, RandomResizedCrop 224 + flip, uint8, "
        f"{args.repeats} repeats; a cold epoch reads every record from disk"
    )
    orders = args.orders.split(",")
    second = "cached" if groups else "warm"
    for fmt, path in datasets.items():
        size = disk_bytes(path)
        if args.probe:
            probe(path, args.workers)
        rates: dict[tuple[str, str], list[float]] = {(o, kind): [] for o in orders for kind in ("cold", second)}
        cached: dict[tuple[str, str], list[float]] = {key: [] for key in rates}
        reads: dict[str, list[tuple[int, ...]]] = {o: [] for o in orders}
        for r in range(args.repeats):
            for order in orders:  # interleaved
                evict(path)
                for kind in ("cold", second):
                    if groups:  # cold: in the cgroup, every page from disk; cached: outside, all in RAM
                        enter(groups, kind == "cold")
                        if kind == "cached":
                            warm(path)
                    cached[order, kind].append(cached_fraction(path))
                    before = disk_reads(groups)
                    rates[order, kind].append(args.images / epoch(path, args.workers, args.batch_size, r, order))
                    if kind == "cold":
                        reads[order].append(tuple(b - a for a, b in zip(before, disk_reads(groups))))
        for (order, kind), v in rates.items():
            med = statistics.median(v)
            print(
                f"  {fmt:<5} {order:<6} {kind}: {med:>8,.0f} samples/s, {med * size / args.images / 1e6:>7,.0f} MB/s "
                f"of records (runs {', '.join(f'{x:,.0f}' for x in v)}; cached before: "
                f"{statistics.median(cached[order, kind]):.0%}); dataset {size / 1e6:,.0f} MB"
            )
        for order in orders:
            ratios = [c / w for c, w in zip(rates[order, "cold"], rates[order, second])]
            print(
                f"  {fmt:<5} {order:<6} cold / {second}: {statistics.median(ratios):.2f}x (per repeat: "
                f"{', '.join(f'{x:.2f}' for x in ratios)})"
            )
            if any(n for n, _ in reads[order]):
                requests, nbytes = (statistics.median(x) for x in zip(*reads[order]))
                print(
                    f"  {fmt:<5} {order:<6} cold epoch's disk reads: {requests:,.0f} requests, "
                    f"{nbytes / 1e6:,.0f} MB ({nbytes / max(requests, 1) / 1024:,.0f} KiB a request)"
                )
        if len(orders) > 1 or orders != ["random"]:
            for order in dict.fromkeys(o.partition(":")[0] for o in orders):
                print(f"  {fmt:<5} {order:<6} label mix: {label_mix(path, order, args.batch_size)}")


def probe(dataset: Path, workers: int) -> None:
    """The physical limits of a cold epoch here: how fast the dataset's files read from disk (whole,
    in order, 4 MiB at a time: buffered, and O_DIRECT past the page cache), what a buffered read
    costs in CPU (the kernel's page-cache fill, on the cores the epoch also needs), and how fast
    one process decodes and crops the cached records (no DataLoader): the CPU-bound rate."""
    names = files(dataset)
    size = sum(f.stat().st_size for f in names)
    evict(dataset)
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    warm(dataset)
    t1, cpu1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    sys_s = cpu1.ru_stime - cpu0.ru_stime
    buf = mmap.mmap(-1, 1 << 22)  # page-aligned, as O_DIRECT wants
    t2 = time.perf_counter()
    for f in names:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            while os.readv(fd, [buf]) == len(buf):
                pass
        finally:
            os.close(fd)
    t3 = time.perf_counter()
    ds = ShardDataset(dataset, dtype=torch.uint8)
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    t4 = time.perf_counter()
    for k in range(0, len(order), 256):
        ds.__getitems__(order[k : k + 256])
    count = len(ds)
    per_core = count / (time.perf_counter() - t4)
    del ds
    close_lmdb(dataset)  # else this process's map keeps data.mdb's pages from being evicted
    print(
        f"  probe {dataset.name}: {size / 1e6:,.0f} MB; sequential from disk: buffered "
        f"{size / (t1 - t0) / 1e6:,.0f} MB/s ({sys_s / size * 1e9:.2f} CPU s per GB), O_DIRECT "
        f"{size / (t3 - t2) / 1e6:,.0f} MB/s; decode + crop, cached, one process: {per_core:,.0f} samples/s "
        f"({per_core * size / count / 1e6:,.0f} MB/s of records), x {workers} workers: "
        f"{per_core * workers:,.0f}"
    )


def label_mix(dataset: Path, order: str, batch_size: int) -> str:
    """How far a batch's labels are from the dataset's label distribution, over an epoch's batches:
    the mean total variation distance (0: every batch mixed like the dataset; 1: one class only the
    dataset does not have) and the mean number of classes per batch."""
    ds = ShardDataset(dataset)
    labels = ds.labels[sampler(ds, 0, order).sequence(0)]
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
