#!/usr/bin/env python3
"""Training from object storage: a cold first epoch from S3 against a warm local epoch, in one run.

Starts SeaweedFS on 127.0.0.1 (tests/store/seaweed.py), uploads each packed dataset as `aws s3 sync`
would, and puts the fault proxy (tests/store/proxy.py) in front of it with a first-byte delay and a
bandwidth cap of ``--cap`` times what the warm local epoch consumes, in a process of its own (as a
store is: its threads do not share this process's interpreter lock with the downloads). Then, with
the same DataLoader settings and ShardSampler order (by default, the one ``ShardSampler(ds)`` takes for
the dataset in the store: block order, blocks of one cache unit, a window sized to mix the labels;
``--order``/``--window`` set them), for each backend, the median of ``--runs`` runs of:

- the order's label mixing: its batches' mean label entropy / a global shuffle's (packer.read.sampler.label_entropy);
- warm local epoch (the dataset in the page cache): samples/s, and the MB/s of records it consumes;
- cold remote epoch (an empty cache each run): samples/s (and from the first batch on), time to
  the first batch, bytes fetched / data files (the cache fits), and (one more, untimed, cold epoch)
  whether every batch is bit-identical to the local run's;
- cached epoch: a warm local and a warm remote epoch in turn (the cache filled), ``--pairs`` pairs,
  both datasets opened once (as a training job does): the median of the pairs' ratios, their
  range, and what the remote dataset's open takes;
- the manifest, the index and one unit (the largest) fetched through the proxy: what the first
  batch waits for at least, besides what a warm local epoch's first batch takes (the DataLoader's
  start, the batch's decode), also reported;
- memmap, a cache of half the data files: one epoch read in this process and one with 2
  DataLoader workers (this process fetching the sampler's next blocks for them), bytes fetched
  against the offline furthest-future optimum for the same batches (tests/store/furthest.py) and
  against the data, and the most the cache held as ``du`` counts it, against the limit;
- 2 ranks x 2 workers reading one node cache: bytes fetched / data files and units downloaded twice.

    python scripts/bench_remote.py                       # 8,000 photos, memmap and LMDB JPEG, 3 runs
    python scripts/bench_remote.py --backends memmap --runs 5
    python scripts/bench_remote.py --format raw --images 2000 --backends memmap   # uint8 pixel records
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer import ShardDataset, ShardSampler, build  # noqa: E402
from packer.backends import data_files  # noqa: E402
from packer.format import INDEX, MANIFEST, DatasetError, Manifest  # noqa: E402
from packer.read.remote import eviction  # noqa: E402
from packer.read.remote import settings as knobs  # noqa: E402
from packer.read.sampler import label_entropy  # noqa: E402
from packer.store import open_store  # noqa: E402
from packer.tools.sample import make_folder  # noqa: E402
from tests.store.du import du_peak  # noqa: E402
from tests.store.furthest import furthest_future_bytes  # noqa: E402
from tests.store.proxy import Faults, start  # noqa: E402
from tests.store.seaweed import seaweed  # noqa: E402


def chosen_order(url_dataset: ShardDataset, args: argparse.Namespace) -> dict[str, Any]:
    """The order every epoch of the run uses, local or remote: what ShardSampler(ds) takes for the
    dataset in the store, but for what --order, --window and --prefetch set."""
    asked = {"order": None if args.order == "default" else args.order, "window": args.window or None}
    s = ShardSampler(url_dataset, seed=1, **asked, **({} if args.prefetch is None else {"prefetch": args.prefetch}))
    return {"order": s.order, "block_size": s.block_size, "window": s.window, "prefetch": s.prefetch}


def sampler(ds: ShardDataset, order: dict[str, Any], **more: int) -> ShardSampler:
    return ShardSampler(ds, seed=1, **order, **more)


def loader(
    ds: ShardDataset, args: argparse.Namespace, order: dict[str, Any], workers: int = -1, **more: int
) -> DataLoader:
    workers = args.workers if workers < 0 else workers
    return DataLoader(ds, batch_size=args.batch_size, sampler=sampler(ds, order, **more), num_workers=workers)


def epoch(make: Callable[[], DataLoader], keep: bool = False) -> tuple[float, float, list[str]]:
    """(seconds to the first batch, seconds for the epoch, the sha256 of each batch's images and
    labels when ``keep``): from the dataset's opening (``make()``) to its last batch."""
    t0 = time.perf_counter()
    first, batches = None, []
    for images, labels in make():
        first = first or time.perf_counter() - t0
        if keep:
            batches.append(hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest())
    return first or 0.0, time.perf_counter() - t0, batches


def cpu_seconds(*others: int) -> list[float]:
    """CPU seconds so far of processes ``others`` (the S3 server, the proxy), of this process (the
    DataLoader's loop, the cache's downloads) and of its children that ended (the DataLoader workers
    of finished epochs)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = []
    for pid in others:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds.append((int(fields[11]) + int(fields[12])) / ticks)
    mine = os.times()
    return [*seconds, mine.user + mine.system, mine.children_user + mine.children_system]


def rank_epoch(
    url: str, cache: str, rank: int, args: argparse.Namespace, order: dict[str, Any], env: dict[str, str]
) -> None:
    os.environ.update(env)
    set_knobs(args)
    ds = ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=cache)
    for _ in loader(ds, args, order, 2, num_replicas=2, rank=rank):
        pass


def set_knobs(args: argparse.Namespace) -> None:
    """The remote path's tunables the command line sets (packer.read.remote.settings)."""
    knobs.UNIT_BYTES, knobs.UNIT_STREAMS = args.unit_bytes, args.unit_streams
    knobs.MIN_UNITS, knobs.MIN_UNIT_BYTES = args.min_units, args.min_unit_bytes
    knobs.RANGE_GAP = args.range_gap


def serve_proxy(upstream: str, control: Any) -> None:
    """The fault proxy (tests/store/proxy.py) in a process of its own, told what to do over ``control``."""
    proxy, server = start(upstream)
    control.send(proxy.url)
    while True:
        command, arg = control.recv()
        if command == "stop":
            server.shutdown()
            return
        if command == "rule":  # the counts cleared and one rule for every response
            proxy.clear()
            proxy.faults.append(arg)
        control.send(proxy.fetched(arg) if command == "fetched" else None)


class ProxyProcess:
    """The fault proxy in its own process, as the store is in a real deployment: its threads take no
    turns at the interpreter lock of this process, where the cache's downloads run (the DataLoader's
    main process fetches the sampler's next blocks)."""

    def __init__(self, upstream: str) -> None:
        self._control, theirs = mp.Pipe()
        self.process = mp.get_context("spawn").Process(target=serve_proxy, args=(upstream, theirs), daemon=True)
        self.process.start()
        self.pid: int = self.process.pid or 0
        self.url = self._control.recv()

    def _ask(self, command: str, arg: Any = None) -> Any:
        self._control.send((command, arg))
        return self._control.recv()

    def rule(self, rule: Faults) -> None:
        self._ask("rule", rule)

    def fetched(self, name: str) -> int:
        return self._ask("fetched", name)

    def stop(self) -> None:
        self._control.send(("stop", None))
        self.process.join()


def fetched(proxy: ProxyProcess, names: list[str]) -> int:
    return sum(proxy.fetched(n) for n in names)


def units_of(ds: ShardDataset, records: list[int]) -> list[str]:
    units = ds._remote._units  # what the cache fetches of this version (packer.read.remote)
    return sorted({units.keys[int(u)] for u in units.of[np.asarray(records, dtype=np.int64)]})


def half_cache(
    url: str, args: argparse.Namespace, proxy: ProxyProcess, rule: Faults, names: list[str], data: int, tmp: Path
) -> tuple[list[tuple[float, float, float, float]], int]:
    """A cache of half the data, in the order ShardSampler takes for the dataset with that limit: read
    in this process, then by 2 DataLoader workers (both evict by the sampler's order); for each,
    bytes fetched / the offline optimum (where one batch's units alone exceed the limit, as a global
    shuffle's do, no order of whole-unit fetches fits and batches read records past the cache: the
    optimum is then the data itself, every record fetched once, which no schedule can go below from
    an empty cache), bytes fetched / the data, the most the cache held as ``du`` counts it (sampled
    every 2 ms) / the limit, and the epoch's seconds. Also the window that order has."""
    ratios: list[tuple[float, float, float, float]] = []
    window = 0
    for workers in (0, 2):
        proxy.rule(rule)
        limit = data // 2
        cache = tmp / f"half-{workers}"
        with du_peak(cache) as peak:
            ds = ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=cache, cache_limit=limit)
            order = chosen_order(ds, args)
            draws = sampler(ds, order).sequence(0).tolist()
            batches = [draws[b : b + args.batch_size] for b in range(0, len(draws), args.batch_size)]
            t0 = time.perf_counter()
            try:
                for _ in loader(ds, args, order, workers):
                    pass
            except DatasetError as e:  # what a user of this order and limit meets
                print(f"half cache, {workers} workers, order {order['order']}: {e}", file=sys.stderr)
                ratios.append((float("nan"),) * 4)
                continue
            seconds = time.perf_counter() - t0
        got, held = fetched(proxy, names), max(peak) / limit
        units = ds._remote._units
        sizes = {key: int(units.sizes[u]) for u, key in enumerate(units.keys)}
        needs = [units_of(ds, b) for b in batches]
        # the optimum for the room the units have as the cache counts it (du's measure): the limit
        # less what it keeps of the version and one download's log; a unit in whole blocks, with
        # its sidecar (a block for a unit of up to ~200 records)
        room = {key: eviction.footprint(size) + eviction.BLOCK for key, size in sizes.items()}
        units_limit = limit - eviction.fixed_room(tmp / f"half-{workers}") - eviction.BLOCK
        fits = max(sum(room[u] for u in n) for n in needs) <= units_limit  # else one batch's units exceed it
        best = furthest_future_bytes(needs, sizes, units_limit, room) if fits else data
        ratios.append((got / best, got / data, held, seconds))
        window = order["window"]
    return ratios, window


def measure(backend: str, raw: Path, args: argparse.Namespace, tmp: Path, server: Any) -> dict[str, Any]:
    out = args.work / f"{args.format}-{args.images}-{args.shard_size}.{backend}"
    if not (out / MANIFEST).exists():
        build(raw, out, backend=backend, format=args.format, shard_size=args.shard_size, workers=2, quiet=True)
    names = data_files(Manifest.load(out))
    data = sum((out / n).stat().st_size for n in names)
    url = server.upload(out, f"bench/{backend}")
    proxy = ProxyProcess(server.endpoint)
    env = server.env(proxy.url)
    os.environ.update(env)
    probe = ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=tmp / "probe")
    per_unit = probe._remote.per_unit
    order = chosen_order(probe, args)
    labels = probe.labels
    sequence = sampler(probe, order).sequence(0)
    mixing = label_entropy(labels, sequence, args.batch_size) / label_entropy(
        labels, np.random.default_rng(0).permutation(len(labels)), args.batch_size
    )

    def local() -> DataLoader:
        return loader(ShardDataset(out, crop_size=args.crop_size, seed=1), args, order)

    epoch(local)  # into the page cache
    _, _, local_batches = epoch(local, keep=True)
    locals_ = [epoch(local)[:2] for _ in range(args.runs)]
    local_s = [t for _, t in locals_]
    consumption = data / min(local_s)  # the cap must cover the fastest consumption
    rule = Faults(delay=args.delay, rate=args.cap * consumption, stream_rate=args.stream_cap * consumption)
    proxy.rule(rule)

    store = open_store(url)
    units = probe._remote._units
    if per_unit:  # the largest unit: a range of a shard
        u = int(np.argmax(units.sizes))
        file, span = names[int(units.shard[u])], (int(units.starts[u]), int(units.stops[u]))
    else:
        file = max(names, key=lambda n: (out / n).stat().st_size)
        span = (0, (out / file).stat().st_size)
    floors = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        store.get(MANIFEST)
        store.get(INDEX)
        store.get(file, *span)
        floors.append(time.perf_counter() - t0)

    def cold_remote(cache: Path) -> DataLoader:
        return loader(ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=cache), args, order)

    cold, firsts, ratios, cpu = [], [], [], [0.0, 0.0, 0.0, 0.0]
    for run in range(args.runs):
        proxy.rule(rule)
        before = cpu_seconds(server.pid, proxy.pid)
        first, seconds, _ = epoch(functools.partial(cold_remote, tmp / f"cache-{backend}-{run}"))
        cpu = [c + b - a for c, a, b in zip(cpu, before, cpu_seconds(server.pid, proxy.pid))]
        cold.append(seconds)
        firsts.append(first)
        ratios.append(fetched(proxy, names) / data)
    # the cached epoch: a local and a remote one in turn, both datasets opened once (as a training
    # job does), per pair; a warm epoch lasts ~1.3 s here, so more pairs than --runs
    kept_local = ShardDataset(out, crop_size=args.crop_size, seed=1)
    kept_remote = ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=tmp / f"cache-{backend}-0")
    warm: list[float] = []
    warm_cpu = [0.0, 0.0, 0.0, 0.0]  # CPU seconds: this process, workers; local, then remote
    for _ in range(args.pairs):
        pair: list[float] = []
        for k, ds in enumerate((kept_local, kept_remote)):
            before = cpu_seconds()
            pair.append(epoch(functools.partial(loader, ds, args, order))[1])
            for j, (a, b) in enumerate(zip(before, cpu_seconds())):
                warm_cpu[2 * k + j] += b - a
        warm.append(pair[0] / pair[1])
    opens = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        ShardDataset(url, crop_size=args.crop_size, seed=1, cache_dir=tmp / f"cache-{backend}-0")
        opens.append(time.perf_counter() - t0)
    proxy.rule(rule)
    # bit-identical: one more cold epoch, untimed (the hashing takes this process's CPU)
    same = epoch(lambda: cold_remote(tmp / f"cache-{backend}-same"), keep=True)[2] == local_batches
    before = cpu_seconds(server.pid, proxy.pid)
    locals_ += [epoch(local)[:2] for _ in range(args.runs)]
    local_s = [t for _, t in locals_]
    local_cpu = [b - a for a, b in zip(before, cpu_seconds(server.pid, proxy.pid))]
    # the local epochs just above are adjacent to the remote ones too (a shared machine)

    skip = set(args.skip.split(",")) - {""}
    half: list[tuple[float, float, float, float]] = []
    half_window = 0
    if per_unit and "half" not in skip:
        half, half_window = half_cache(url, args, proxy, rule, names, data, tmp)

    proxy.rule(rule)
    ctx = mp.get_context("spawn")
    ranks = [
        ctx.Process(target=rank_epoch, args=(url, str(tmp / f"ranks-{backend}"), r, args, order, env)) for r in range(2)
    ]
    for r in ranks if "ranks" not in skip else ():
        r.start()
    for r in ranks if "ranks" not in skip else ():
        r.join()
    twice = sum(1 for n in names if proxy.fetched(n) > (out / n).stat().st_size)
    ranks_ratio = fetched(proxy, names) / data if "ranks" not in skip else float("nan")
    proxy.stop()
    med = statistics.median
    return {
        "backend": backend,
        "files": f"{len(names)} x {data / len(names) / 1e6:.1f} MB",
        "units": f"{len(units.keys)} of {per_unit} records" if per_unit else f"{len(names)} whole files",
        "order": f"{order['order']}"
        + (f", {order['block_size']} x {order['window']}" if order["order"] == "block" else ""),
        "mixing": mixing,
        "local": args.images / med(local_s),
        "consumption": consumption,
        "cold": med(local_s) / med(cold),
        # samples/s from the first batch on (what a longer epoch tends to), cold remote / warm local
        "steady": med([t - f for f, t in locals_]) / med([t - f for f, t in zip(firsts, cold)]),
        "warm": med(warm),  # per pair, the datasets opened once
        "warm_range": (min(warm), max(warm)),
        "warm_cpu": [c / args.pairs for c in warm_cpu],
        "open": med(opens),
        "first": med(firsts),
        "floor": med(floors),
        "local_first": med([f for f, _ in locals_]),
        "fetched": med(ratios),
        "same": same,
        "half": half,
        "half_window": half_window,
        "ranks": ranks_ratio,
        "twice": twice,
        "cpu": (sum(cold), *cpu),  # summed over the cold runs: wall seconds, server, proxy, this process, workers
        "local_cpu": local_cpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=8000)
    p.add_argument("--backends", default="memmap,lmdb")
    p.add_argument("--format", choices=("jpeg", "raw"), default="jpeg", help="the records: JPEG or uint8 pixels")
    p.add_argument("--runs", type=int, default=3, help="runs of each measurement (medians reported)")
    p.add_argument("--pairs", type=int, default=9, help="pairs of cached epochs, local then remote")
    p.add_argument("--shard-size", type=int, default=1024, help="records per shard (a multiple of a unit's)")
    p.add_argument("--unit-bytes", type=int, default=knobs.UNIT_BYTES, help="about the bytes of a memmap unit")
    p.add_argument("--min-units", type=int, default=knobs.MIN_UNITS, help="the fewest units a dataset is cut into")
    p.add_argument("--min-unit-bytes", type=int, default=knobs.MIN_UNIT_BYTES, help="down to units of this many bytes")
    p.add_argument("--unit-streams", type=int, default=knobs.UNIT_STREAMS, help="ranged GETs a unit is fetched in")
    p.add_argument(
        "--range-gap", type=int, default=knobs.RANGE_GAP, help="bytes between records read past the cache in one GET"
    )
    p.add_argument("--order", choices=("default", "random", "block"), default="default", help="ShardSampler's order")
    p.add_argument("--window", type=int, default=0, help="ShardSampler's window (0: its default)")
    p.add_argument("--prefetch", type=int, default=None, help="windows fetched ahead (default: ShardSampler's)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--crop-size", type=int, default=112)
    p.add_argument("--delay", type=float, default=0.02, help="first-byte delay per request, seconds")
    p.add_argument("--cap", type=float, default=1.25, help="bandwidth cap as a multiple of the warm consumption")
    p.add_argument("--stream-cap", type=float, default=0.0, help="the same, per GET (0: none)")
    p.add_argument("--skip", default="", help="parts left out, comma-separated: half (the half cache), ranks")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "packer-bench-remote")
    args = p.parse_args()
    set_knobs(args)

    raw = args.work / f"raw-{args.images}"
    make_folder(raw, args.images, size=(480, 360), workers=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as s3, seaweed(Path(s3)) as server:
        for backend in args.backends.split(","):
            rows.append(measure(backend, raw, args, Path(tmp), server))
    print(
        f"{args.images} {args.format} records, batch {args.batch_size}, {args.workers} workers, "
        f"{args.runs} runs (medians); "
        f"proxy {args.delay * 1e3:.0f} ms first byte, cap {args.cap}x the warm local consumption"
        + (f", {args.stream_cap}x per GET" if args.stream_cap else "")
    )
    print(
        "| backend | data files | units | order (block size x window), label mixing | warm local, samples/s (MB/s) "
        "| cold remote / warm local (from the first "
        "batch on) | first batch (manifest + index + one unit; warm local's) "
        "| bytes fetched / data (cache fits) | half cache / optimum (in process, 2 workers) "
        "| 2 ranks x 2 workers: fetched / data, downloaded twice "
        "| warm remote / warm local (per pair, opened once: median, range; the remote's open) | "
        "bit-identical |"
    )
    print("|---|---|---|---|---:|---:|---|---:|---|---|---:|---|")
    for r in rows:
        half = "; ".join(
            f"{o:.3f}x ({d:.2f}x data, du peak {h:.2f} of the limit, "
            f"{args.images / t / r['local']:.2f}x the warm local speed)"
            for o, d, h, t in r["half"]
        )
        half = half + f" (window {r['half_window']})" if r["half"] else "-"
        low, high = r["warm_range"]
        print(
            f"| {r['backend']} | {r['files']} | {r['units']} | {r['order']}, {r['mixing']:.3f} | "
            f"{r['local']:,.0f} ({r['consumption'] / 1e6:.0f}) | "
            f"{r['cold']:.2f}x ({r['steady']:.2f}x) | "
            f"{r['first']:.2f} s ({r['floor']:.2f} s; {r['local_first']:.2f} s) | "
            f"{r['fetched']:.3f}x | {half} | "
            f"{r['ranks']:.3f}x, {r['twice']} | {r['warm']:.3f}x ({low:.2f}-{high:.2f}x; {r['open']:.2f} s) | "
            f"{r['same']} |"
        )
    for r in rows:
        wall, server_cpu, proxy_cpu, mine, workers = (c / args.runs for c in r["cpu"])
        total = server_cpu + proxy_cpu + mine + workers
        print(
            f"{r['backend']}: CPU per cold epoch ({wall:.2f} s x {os.cpu_count()} cores, {total / wall:.2f} busy; "
            f"the store side's share {(server_cpu + proxy_cpu) / total:.0%}): server "
            f"{server_cpu:.2f} s, proxy {proxy_cpu:.2f} s, this process (the loop, the downloads) {mine:.2f} s, "
            f"DataLoader workers {workers:.2f} s; per warm local epoch: this process "
            f"{r['local_cpu'][2] / args.runs:.2f} s, workers {r['local_cpu'][3] / args.runs:.2f} s; per cached epoch "
            "(the pairs), local against remote: this process {:.2f} s against {:.2f} s, workers {:.2f} s against "
            "{:.2f} s".format(*(r["warm_cpu"][k] for k in (0, 2, 1, 3)))
        )


if __name__ == "__main__":
    main()
