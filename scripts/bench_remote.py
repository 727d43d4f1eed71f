#!/usr/bin/env python3
"""Training from object storage: a cold first epoch from S3 against a warm local epoch, in one run.

Starts SeaweedFS on 127.0.0.1 (tests/store/seaweed.py), uploads a packed dataset as `aws s3 sync`
would, and puts the fault proxy (tests/store/proxy.py) in front of it with a first-byte delay and a
bandwidth cap of ``--cap`` times what the warm local epoch consumes. Then, with the same DataLoader
settings and ShardSampler order:

- warm local epoch (the dataset in the page cache): samples/s, and the MB/s of records it consumes;
- cold remote epoch (an empty cache): samples/s, time to the first batch, bytes fetched / dataset,
  and whether every batch is bit-identical to the local run's;
- warm remote epoch (the cache filled): samples/s;
- time to fetch the manifest, the index and one data file through the proxy (what the first batch
  waits for at least);
- 2 ranks x 2 workers reading one node cache: bytes fetched / dataset (1.0: no duplicate download).

    python scripts/bench_remote.py                    # 2,000 photos, memmap JPEG, block order, window 2
    python scripts/bench_remote.py --window 16        # batches mixed from every shard: the first waits for all
    python scripts/bench_remote.py --backend lmdb --order random
    python scripts/bench_remote.py --format raw --images 1000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer import ShardDataset, ShardSampler, build  # noqa: E402
from packer.backends import data_files  # noqa: E402
from packer.format import INDEX, MANIFEST, Manifest  # noqa: E402
from packer.sample import make_folder  # noqa: E402
from packer.store import open_store  # noqa: E402
from tests.store.proxy import Faults, start  # noqa: E402
from tests.store.seaweed import seaweed  # noqa: E402


def loader(ds: ShardDataset, args: argparse.Namespace, **sampler: int) -> DataLoader:
    blocks = {"block_size": args.shard_size, "window": args.window, "prefetch": args.prefetch}
    blocks = blocks if args.order == "block" else {}
    order = ShardSampler(ds, order=args.order, seed=1, **blocks, **sampler)
    return DataLoader(ds, batch_size=args.batch_size, sampler=order, num_workers=args.workers, persistent_workers=False)


def epoch(make: Callable[[], DataLoader], keep: bool = False) -> tuple[float, float, list]:
    """(seconds to the first batch, seconds for the epoch, the batches when ``keep``): from the
    dataset's opening (``make()``) to its last batch."""
    t0 = time.perf_counter()
    first, batches = None, []
    for batch in make():
        first = first or time.perf_counter() - t0
        if keep:
            batches.append(batch)
    return first or 0.0, time.perf_counter() - t0, batches


def cpu_seconds(server: int) -> list[float]:
    """CPU seconds so far of the S3 server, of this process (the proxy's threads, the loop) and of
    its children that ended (the DataLoader workers of finished epochs)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()
    mine = os.times()
    return [
        (int(fields[11]) + int(fields[12])) / ticks,
        mine.user + mine.system,
        mine.children_user + mine.children_system,
    ]


def rank_epoch(url: str, cache: str, rank: int, args: argparse.Namespace, env: dict[str, str]) -> None:
    os.environ.update(env)
    ds = ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=cache)
    for _ in loader(ds, args, num_replicas=2, rank=rank):
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--backend", choices=["memmap", "lmdb"], default="memmap")
    p.add_argument("--format", choices=["jpeg", "raw"], default="jpeg")
    p.add_argument("--order", choices=["block", "random"], default="block")
    p.add_argument("--shard-size", type=int, default=250, help="records per shard (and per sampler block)")
    p.add_argument("--window", type=int, default=2, help='order="block": blocks shuffled together (ShardSampler)')
    p.add_argument("--prefetch", type=int, default=2, help='order="block": windows fetched ahead (ShardSampler)')
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--crop-size", type=int, default=112)
    p.add_argument("--delay", type=float, default=0.02, help="first-byte delay per request, seconds")
    p.add_argument("--cap", type=float, default=1.25, help="bandwidth cap as a multiple of the warm consumption")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "packer-bench-remote")
    args = p.parse_args()

    raw = args.work / f"raw-{args.images}"
    make_folder(raw, args.images, size=(800, 600), workers=2)
    out = args.work / f"{args.format}-{args.images}-{args.shard_size}.{args.backend}"
    if not (out / MANIFEST).exists():
        build(raw, out, backend=args.backend, format=args.format, shard_size=args.shard_size, workers=2, quiet=True)
    manifest = Manifest.load(out)
    names = data_files(manifest)
    data_bytes = sum((out / n).stat().st_size for n in names)

    def local() -> DataLoader:
        return loader(ShardDataset(out, crop_size=args.crop_size, seed=1), args)

    epoch(local)  # into the page cache
    _, local_s, local_batches = epoch(local, keep=True)
    local_s = min(local_s, epoch(local)[1])  # the fastest: the cap below must cover the fastest consumption
    consumption = data_bytes / local_s
    print(
        f"dataset: {args.images} {args.format} records in {len(names)} {args.backend} data files, "
        f"{data_bytes / 1e6:.1f} MB"
    )
    print(f"warm local epoch: {args.images / local_s:,.0f} samples/s, consuming {consumption / 1e6:.1f} MB/s")

    with tempfile.TemporaryDirectory() as tmp, seaweed(Path(tmp)) as server:
        url = server.upload(out, "bench/train")
        proxy, proxy_server = start(server.endpoint)
        rule = Faults(delay=args.delay, rate=args.cap * consumption)
        proxy.faults.append(rule)
        env = server.env(proxy.url)
        os.environ.update(env)
        print(f"proxy: {args.delay * 1e3:.0f} ms first-byte delay, cap {rule.rate / 1e6:.1f} MB/s ({args.cap}x)")

        store = open_store(url)
        t0 = time.perf_counter()
        for name in (MANIFEST, INDEX, max(names, key=lambda n: (out / n).stat().st_size)):
            store.get(name)
        floor = time.perf_counter() - t0
        proxy.clear()
        proxy.faults.append(rule)

        cache = Path(tmp) / "cache"

        def remote() -> DataLoader:
            return loader(ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=cache), args)

        cpu = cpu_seconds(server.pid)
        first, cold_s, cold_batches = epoch(remote, keep=True)
        cpu = [b - a for a, b in zip(cpu, cpu_seconds(server.pid))]
        fetched = sum(proxy.sent.values())
        same = len(cold_batches) == len(local_batches) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(cold_batches, local_batches)
        )
        print(
            f"CPU during the cold epoch ({cold_s:.2f} s x {os.cpu_count()} cores): server {cpu[0]:.2f} s, proxy "
            f"and loop (this process) {cpu[1]:.2f} s, DataLoader workers {cpu[2]:.2f} s"
        )
        _, warm_s, _ = epoch(remote)
        # the local epoch again, adjacent to the remote ones (on a shared machine the load moves
        # both): the ratios are against the fastest local epoch of all
        local_s = min(local_s, epoch(local)[1])
        print(
            f"cold remote epoch: {args.images / cold_s:,.0f} samples/s = {local_s / cold_s:.2f}x the warm local epoch; "
            f"first batch after {first:.2f} s (manifest + index + the largest data file alone: {floor:.2f} s); "
            f"fetched {fetched / data_bytes:.3f}x the data files; batches bit-identical to local: {same}"
        )
        print(f"warm remote epoch: {args.images / warm_s:,.0f} samples/s = {local_s / warm_s:.2f}x")
        print(f"(the fastest warm local epoch, of two before and one after: {args.images / local_s:,.0f} samples/s)")

        proxy.clear()
        proxy.faults.append(Faults(delay=args.delay, rate=args.cap * consumption))
        ranks_cache = str(Path(tmp) / "ranks-cache")
        ctx = mp.get_context("spawn")
        ranks = [ctx.Process(target=rank_epoch, args=(url, ranks_cache, r, args, env)) for r in range(2)]
        for r in ranks:
            r.start()
        for r in ranks:
            r.join()
        per_file = [proxy.fetched(n) for n in names]
        print(
            f"2 ranks x {args.workers} workers, one node cache: fetched {sum(per_file) / data_bytes:.3f}x the data "
            f"files, {sum(1 for n, b in zip(names, per_file) if b > (out / n).stat().st_size)} downloaded twice"
        )
        proxy_server.shutdown()


if __name__ == "__main__":
    main()
