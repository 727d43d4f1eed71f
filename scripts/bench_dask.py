#!/usr/bin/env python3
"""Overhead of ``build --dask`` against a local build on the same machine, same number of workers.

Times three builds of the same generated 12 MP camera-like photos, interleaved over several repeats
(medians): the local pipeline, ``--dask local`` (including the LocalCluster start a user waits for),
and a build on an already running LocalCluster (the steady-state cost of tasks and fragments). Checks
that all three give the same digest and prints the ratios to the local build.

    python scripts/bench_dask.py                          # 201 photos, 2 workers, 25 files per task
    python scripts/bench_dask.py --workers 8 --per-class 300 --task-size 100
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer import build  # noqa: E402
from packer.builder.dask import build_dask  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402


def timed(fn: Callable[[Path], str], out: Path) -> tuple[float, str]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    digest = fn(out)
    return time.perf_counter() - t0, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=67, help="photos per class, 3 classes [67 -> 201]")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--task-size", type=int, default=25, help="files per Dask task (--shard-size)")
    ap.add_argument("--backend", choices=["lmdb", "memmap"], default="lmdb")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--raw", type=Path, default=ROOT / "data" / "bench-dask" / "raw", help="where the generated photos are cached"
    )
    args = ap.parse_args()

    import distributed

    expected = args.per_class * 3
    if sum(1 for _ in args.raw.glob("*/*.jpg")) != expected:
        shutil.rmtree(args.raw, ignore_errors=True)
        t0 = time.perf_counter()
        make_sample(args.raw, per_class=args.per_class, size=(4000, 3000))
        print(f"generated {expected} 12 MP photos in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    suffix = ".lmdb" if args.backend == "lmdb" else ""
    common = {"backend": args.backend, "quiet": True}
    with distributed.LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
    ) as cluster:
        runs: dict[str, Callable[[Path], str]] = {
            "local": lambda out: build(args.raw, out, workers=args.workers, **common).digest,
            "dask local (with cluster start)": lambda out: (
                build_dask(
                    args.raw, out, address="local", workers=args.workers, shard_size=args.task_size, **common
                ).digest
            ),
            "dask, running cluster": lambda out: (
                build_dask(args.raw, out, address=cluster.scheduler_address, shard_size=args.task_size, **common).digest
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        digests: set[str] = set()
        for _ in range(args.repeats):
            for i, (name, fn) in enumerate(runs.items()):
                seconds, digest = timed(fn, work / f"out{i}{suffix}")
                times[name].append(seconds)
                digests.add(digest)
    shutil.rmtree(work)
    if len(digests) != 1:
        sys.exit(f"digests differ between builds: {sorted(digests)}")
    base, best = statistics.median(times["local"]), min(times["local"])
    print(
        f"{expected} photos (12 MP), {args.workers} workers, {args.backend}, task size {args.task_size}, "
        f"{args.repeats} repeats; digest {digests.pop()[:19]}..."
    )
    for name, ts in times.items():  # min too: a busy machine only ever adds time
        med = statistics.median(ts)
        print(
            f"  {name:<32} median {med:6.2f} s ({expected / med:5.1f} images/s, ratio {med / base:.2f})"
            f"   min {min(ts):6.2f} s (ratio {min(ts) / best:.2f})"
        )


if __name__ == "__main__":
    main()
