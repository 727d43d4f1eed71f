#!/usr/bin/env python3
"""User transforms and ShardSampler: what they cost, and the no-transform path against another checkout.

Side by side, interleaved over the repeats, each measurement in a fresh process with
``packer.tools.bench.measure`` (what scripts/bench_read.py measures with: DataLoader, RandomResizedCrop 224
+ flip, uint8, batch 256, num_workers = cores, warm-up excluded; and, less exposed to the machine's
other load, the CPU time of ``__getitems__`` in one process), over 2,000 generated photos stored at
427x320 (JPEG and raw records, LMDB):

  - no transform, this checkout and (``--baseline DIR``) another one, e.g. the commit before
    (``mkdir /tmp/packer-base && git archive COMMIT | tar -x -C /tmp/packer-base``; its C extension
    is taken from this checkout's build when it has none: same C sources);
  - no transform, drawn by ShardSampler (Draw indices: augmentation keyed by draw);
  - an identity ``transform`` (the transform path itself: a scratch crop, the per-sample seeding of
    torch's, numpy's and Python's generators, one copy into the batch);
  - a transform drawing from the three global generators (brightness shift + noise), as
    third-party augmentation does.

    python scripts/bench_transform.py --baseline /tmp/packer-base --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "packer-bench"
RUNS = {  # name -> (format, tree, transform, packer sampler)
    "jpeg": ("jpeg", "this", None, False),
    "jpeg, baseline": ("jpeg", "baseline", None, False),
    "jpeg, ShardSampler": ("jpeg", "this", None, True),
    "jpeg + identity": ("jpeg", "this", "identity", False),
    "jpeg + global-RNG jitter": ("jpeg", "this", "jitter", False),
    "raw": ("raw", "this", None, False),
    "raw, baseline": ("raw", "baseline", None, False),
    "raw, ShardSampler": ("raw", "this", None, True),
    "raw + identity": ("raw", "this", "identity", False),
    "raw + global-RNG jitter": ("raw", "this", "jitter", False),
}


def identity(x):
    return x


def jitter(x):
    import numpy as np
    import torch

    shift = int(torch.randint(0, 30, (1,))) + int(np.random.randint(0, 30)) + random.randint(0, 30)
    return x.add(shift)


def one(dataset: str, transform: str, packer_sampler: bool, workers: int, samples: int) -> None:
    """Child process: one measurement, printed as JSON."""
    import torch

    from packer.read.dataset import ShardDataset
    from packer.tools.bench import measure

    extra: dict[str, Any] = {"transform": {"identity": identity, "jitter": jitter}[transform]} if transform else {}
    ds = ShardDataset(dataset, dtype=torch.uint8, **extra)
    point = measure(ds, workers, 256, samples, **({"packer_sampler": True} if packer_sampler else {}))
    print(json.dumps({"rate": point.samples_per_s, "us": point.cpu_us_per_sample, "inproc": inprocess_us(ds)}))


def inprocess_us(ds, batches: int = 12, passes: int = 3) -> float:
    """CPU us per sample of ``ds.__getitems__`` in this process, one torch thread as in a DataLoader
    worker (the best of ``passes`` over the same random batches): the dataset's own cost, less exposed
    to the machine's other load than a DataLoader's timing."""
    import time

    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker
    indices = np.random.default_rng(0).integers(0, len(ds), (batches, 256)).tolist()
    ds.__getitems__(indices[0])  # warm: handles, buffers
    best = float("inf")
    for _ in range(passes):
        t0 = time.process_time()
        for batch in indices:
            ds.__getitems__(batch)
        best = min(best, time.process_time() - t0)
    return best / (batches * 256) * 1e6


def rng_cost(batches: int = 200, batch: int = 256) -> tuple[float, float]:
    """(us per batch to save and restore the global generators, us per sample to seed them), in-process."""
    import time

    from packer.read import rng

    seeds = rng.sample_seeds(0, 0, np.arange(batch))
    t0 = time.perf_counter()
    for _ in range(batches):
        with rng.seeded_samples():
            pass
    t1 = time.perf_counter()
    for _ in range(batches):
        with rng.seeded_samples() as seed:
            for s in seeds:
                seed(s)
    t2 = time.perf_counter()
    per_batch = (t1 - t0) / batches * 1e6
    return per_batch, ((t2 - t1) / batches * 1e6 - per_batch) / batch


def baseline_tree(path: Path) -> Path:
    """The baseline checkout, with this checkout's compiled extension copied in if it has none."""
    for so in (ROOT / "packer").glob("_native*.so"):
        if not (path / "packer" / so.name).exists():
            shutil.copy(so, path / "packer" / so.name)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another packer checkout to compare the no-transform path with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=5120)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--one", nargs=3, metavar=("DATASET", "TRANSFORM", "SAMPLER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        dataset, transform, sampler = args.one
        one(dataset, "" if transform == "-" else transform, sampler == "1", args.workers, args.samples)
        return

    sys.path.insert(0, str(ROOT))
    from packer import build
    from packer.tools.sample import make_folder

    raw = CACHE / "raw-2000-480x360"
    make_folder(raw, 2000, (480, 360), args.workers)
    datasets = {}
    for fmt in ("jpeg", "raw"):
        datasets[fmt] = CACHE / f"transform-2000-{fmt}.lmdb"
        build(raw, datasets[fmt], format=fmt, workers=args.workers, quiet=True, update=True)
    per_batch, per_sample = rng_cost()
    print(
        f"seeding the global generators: {per_batch:.0f} us per batch (save + restore), {per_sample:.1f} us per "
        "sample (torch + numpy + random)",
        flush=True,
    )
    trees = {"this": ROOT, "baseline": baseline_tree(args.baseline) if args.baseline else None}
    runs = {k: v for k, v in RUNS.items() if trees[v[1]] is not None}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # workers x 1e6 / CPU us per sample
    inproc: dict[str, list[float]] = {k: [] for k in runs}  # us per sample, __getitems__ in one process
    names = list(runs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated: no run is always first
            fmt, tree, transform, sampler = runs[name]
            env = {**os.environ, "PYTHONPATH": str(trees[tree])}
            out = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "bench_transform.py"),
                    "--workers",
                    str(args.workers),
                    "--samples",
                    str(args.samples),
                    "--one",
                    str(datasets[fmt]),
                    transform or "-",
                    "1" if sampler else "0",
                ],
                env=env,
                cwd=trees[tree],
                capture_output=True,
                text=True,
                check=True,
            )
            point = json.loads(out.stdout.strip().splitlines()[-1])
            rates[name].append(point["rate"])
            cpu[name].append(args.workers * 1e6 / point["us"])
            inproc[name].append(point["inproc"])
            print(
                f"  repeat {r + 1}: {name:<26} {rates[name][-1]:>9,.0f} samples/s, CPU-based {cpu[name][-1]:>9,.0f}, "
                f"in-process {inproc[name][-1]:6.1f} us/sample",
                flush=True,
            )
    print(
        f"\nmedians of {args.repeats} ({args.workers} workers, uint8, RandomResizedCrop 224 + flip, batch 256); "
        f"CPU-based = {args.workers} x 1e6 / (CPU us per sample, main process + workers); ratios to the same "
        "format's no-transform run of this checkout:"
    )
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_in = {k: statistics.median(v) for k, v in inproc.items()}
    for name, v in rates.items():
        ref = "jpeg" if name.startswith("jpeg") else "raw"
        print(
            f"  {name:<26} {med[name]:>9,.0f} samples/s {med[name] / med[ref]:6.3f}x   "
            f"CPU-based {med_cpu[name]:>9,.0f} "
            f"{med_cpu[name] / med_cpu[ref]:6.3f}x   in-process {med_in[name]:6.1f} us/sample "
            f"{med_in[ref] / med_in[name]:6.3f}x  (runs {', '.join(f'{x:,.0f}' for x in v)})"
        )


if __name__ == "__main__":
    main()
