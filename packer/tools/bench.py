"""``packer bench``: measure the input pipeline alone, before training, and say where the time goes.

Three measurements, each answering one tuning question:

- samples/s through a real DataLoader (no model) for a sweep of ``num_workers``, each value timed
  several times: how many workers the machine needs, and where adding more stops paying (the knee),
  told apart from the noise of a shared machine by the runs' spread;
- a stage profile in-process: time per sample in each stage of ``ShardDataset``'s own code path
  (the dataset calls a clock between stages, so nothing here re-implements a stage): whether to
  add workers, store raw pixels, or move float conversion to the GPU;
- dataset bytes against available memory: whether repeated epochs read from the page cache or disk.

Timings are wall-clock; each sweep point also reports CPU time per sample (main process plus
workers), which stays meaningful when other jobs share the cores.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..backends import BACKENDS
from ..errors import is_url
from ..format import disk_bytes
from ..format.records import FORMATS

#: Sweep points within this fraction of the best throughput count as "not growing any more".
KNEE_FRACTION = 0.9
#: Samples per measurement when --epochs is not given (one epoch of a big dataset takes too long).
DEFAULT_MAX_SAMPLES = 3_000
#: ... and at least this many batches (a small dataset's records are then read more than once),
#: so that a measurement is not a handful of batches timed against the warm-up's noise.
DEFAULT_MIN_BATCHES = 4
#: Timed runs per num_workers value: their spread tells a real difference from a busy machine's noise.
REPEATS = 3
#: Records drawn for the stage profile (it runs in one process, so it is kept short).
PROFILE_SAMPLES = 1024

COLD_READ_HINT = (
    "to measure a cold read, evict the dataset from the page cache first: "
    "`sync; echo 3 > /proc/sys/vm/drop_caches` as root (all files), or `vmtouch -e OUT` (just this dataset)"
)


def cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes: what the page cache can hold without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one process from /proc (0.0 where /proc is unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def proc_rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of a process in bytes (/proc/PID/status)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def worker_pids(iterator: Any) -> list[int]:
    """PIDs of a DataLoader iterator's worker processes (empty for num_workers=0)."""
    return [w.pid for w in getattr(iterator, "_workers", [])]


@dataclass
class Point:
    """One sweep point: throughput with ``workers`` DataLoader workers; of several measurements
    (:func:`combine`), the median samples/s and CPU time, and each measurement's samples/s in ``runs``."""

    workers: int
    samples: int
    seconds: float
    samples_per_s: float
    cpu_us_per_sample: float
    runs: list[float] = field(default_factory=list)

    @property
    def low(self) -> float:
        return min(self.runs, default=self.samples_per_s)

    @property
    def high(self) -> float:
        return max(self.runs, default=self.samples_per_s)


def combine(runs: Sequence[Point]) -> Point:
    """Measurements of one ``workers`` value as one Point (medians: one slow run does not move it)."""
    return Point(
        runs[0].workers,
        sum(p.samples for p in runs),
        sum(p.seconds for p in runs),
        statistics.median(p.samples_per_s for p in runs),
        statistics.median(p.cpu_us_per_sample for p in runs),
        [p.samples_per_s for p in runs],
    )


def make_loader(
    ds: Any, workers: int, batch_size: int, samples: int, seed: int = 0, packer_sampler: bool = False, **kw: Any
) -> Any:
    """A DataLoader drawing ``samples`` indices at random (wrapping around small datasets), with
    torch's RandomSampler or, if ``packer_sampler``, a ShardSampler (draw-keyed augmentation)."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler, Sampler

    sampler: Sampler[Any]
    if packer_sampler:
        from ..read.sampler import ShardSampler

        sampler = ShardSampler(ds, seed=seed, num_samples=samples)
    else:
        sampler = RandomSampler(ds, num_samples=samples, generator=torch.Generator().manual_seed(seed))
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, **kw)


def measure(
    ds: Any,
    workers: int,
    batch_size: int,
    samples: int,
    prefetch_factor: int = 2,
    packer_sampler: bool = False,
    *,
    repeats: int = 1,
) -> Point:
    """samples/s of ``samples`` samples (whole batches), timed ``repeats`` times back to back (:func:`combine`), after
    one warm-up: each worker's first ``prefetch_factor + 1`` batches, which pay its start-up and the
    first use of each batch segment it will reuse for the rest of the epoch (packer.read.batchpool: one per
    batch in flight, 256 x 3 x 224 x 224 float32 is 154 MB, whose pages fault in once: counted in,
    they would weigh on a short run; docs/PERFORMANCE.md, "What changed"). One warm-up for all the
    runs: repeating it would cost more than the runs themselves at many workers."""
    warm = max(1, workers * (prefetch_factor + 1))
    # persistent: the workers outlive the last batch, so their CPU time can still be read
    extra = {"prefetch_factor": prefetch_factor, "persistent_workers": True} if workers else {}
    per_run = -(-samples // batch_size)  # whole batches, at least one a run
    loader = make_loader(
        ds, workers, batch_size, (warm + repeats * per_run) * batch_size, packer_sampler=packer_sampler, **extra
    )
    it = iter(loader)
    for _ in range(warm):
        next(it)
    pids = worker_pids(it)
    runs = []
    for _ in range(repeats):
        cpu0 = time.process_time() + sum(_proc_cpu_seconds(p) for p in pids)
        t0, n = time.perf_counter(), 0
        for _ in range(per_run):
            batch = next(it)
            n += len(batch["image"] if isinstance(batch, dict) else batch[0])  # a dataset with fields: dicts
        seconds = time.perf_counter() - t0
        cpu = time.process_time() + sum(_proc_cpu_seconds(p) for p in pids) - cpu0
        runs.append(Point(workers, n, seconds, n / seconds if seconds > 0 else 0.0, cpu / max(n, 1) * 1e6))
    del it, loader
    return combine(runs)


class StageClock:
    """Accumulates the time between successive stage ticks (``clock("decode")``), per stage name."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.last = time.perf_counter()

    def restart(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.totals[stage] = self.totals.get(stage, 0.0) + now - self.last
        self.last = now


#: Stage names in pipeline order, as the dataset ticks them.
STAGES = ("collate", "draw crop", "read", "decode", "resize", "flip", "write to batch", "to float")


def profile(ds: Any, batch_size: int, samples: int = PROFILE_SAMPLES, seed: int = 0) -> dict[str, Any]:
    """Per-sample time in each stage, in this process, with batches built as a worker builds them
    (in shared memory, collated by default_collate), so page faults and copies are included."""
    import numpy as np
    import torch
    from torch.utils.data import default_collate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        return _profile(ds, batch_size, samples, np.random.default_rng(seed), default_collate)
    finally:
        torch.set_num_threads(threads)


def _profile(ds: Any, batch_size: int, samples: int, rng: Any, collate: Any) -> dict[str, Any]:
    """The body of :func:`profile`, run with one intra-op thread."""
    clock = StageClock()
    batch = min(batch_size, samples)
    ds._batch(rng.integers(0, len(ds), batch).tolist(), 0, shared=True)  # warm: open handles, caches
    done = 0
    while done < samples:
        indices = rng.integers(0, len(ds), min(batch, samples - done)).tolist()
        clock.restart()
        result = collate(ds._batch(indices, 0, shared=True, clock=clock))
        clock("collate")
        del result
        done += len(indices)
    total = sum(clock.totals.values())
    order = [s for s in STAGES if s in clock.totals] + [s for s in clock.totals if s not in STAGES]
    stages = [
        {"stage": s, "us_per_sample": clock.totals[s] / done * 1e6, "percent": 100 * clock.totals[s] / total}
        for s in order
    ]
    return {"samples": done, "us_per_sample": total / done * 1e6, "stages": stages}


def knee(points: Sequence[Point]) -> Point:
    """The fewest workers that the measurements cannot tell from the best: within ``KNEE_FRACTION``
    of its median, or with a run as fast as its slowest one. More workers are advised only for a
    difference larger than the noise. ``num_workers=0`` only when nothing else was measured: it
    loads each batch between training steps instead of during them, which no benchmark without a
    model sees."""
    candidates = [p for p in points if p.workers > 0] or list(points)
    best = max(candidates, key=lambda p: p.samples_per_s)
    close = [p for p in candidates if p.samples_per_s >= KNEE_FRACTION * best.samples_per_s or p.high >= best.low]
    return min(close, key=lambda p: p.workers)


def _resize_advice(resize: str) -> str:
    """What would make the resize step faster, given the backend in use (see transform.resize_backend);
    the ratios are docs/PERFORMANCE.md's ("The resize kernels")."""
    from ..transform import resize as kernels

    used = "Pillow-SIMD" if resize == "pillow" else "torch's kernel"
    if kernels._native is None:
        return (
            f"crops are resized by {used}: packer's C extension was not built (installing packer needs a C "
            "compiler and libjpeg62-turbo-dev for it); its AVX2 resize kernel is ~2x faster than Pillow-SIMD "
            'and ~4x faster than torch\'s (docs/PERFORMANCE.md, "The resize kernels")'
        )
    if resize == "torch":
        return (
            "crops are resized by torch's kernel (this CPU has no AVX2 for packer's): installing Pillow-SIMD "
            '(`make setup SIMD=1`) makes that step ~2x faster (docs/PERFORMANCE.md, "The resize kernels")'
        )
    return f"crops are resized by {used} (PACKER_RESIZE={resize}): unset PACKER_RESIZE to use packer's faster kernel"


def advice(
    points: Sequence[Point],
    stages: Sequence[dict[str, Any]],
    fmt: str,
    dtype: str,
    resize: str,
    fits_in_page_cache: Optional[bool] = None,
    backend: str = "lmdb",
    *,
    count: int,
    batch_size: int,
    train: bool,
) -> dict[str, Any]:
    """The training setup docs/DATASET.md recommends (ShardSampler, uint8 batches normalized on the GPU) with the
    settings and notes that follow from the sweep, the profile and the dataset's size: ``count``
    records, batches of ``batch_size``, ``train`` or eval crops."""
    k = knee(points)
    top = max(p.workers for p in points)
    share = {s["stage"]: s["percent"] for s in stages}
    notes = []
    if k.workers == top and top < cores():
        notes.append(f"throughput still grows at {top} workers: try up to {cores()} (--workers)")
    zero = next((p for p in points if p.workers == 0), None)
    if zero is not None and k.workers > 0 and zero.low > k.high:
        notes.append(
            f"num_workers=0 was faster here, without a model: it loads each batch between training steps "
            f"instead of during them, so {k.workers} is advised"
        )
    drop_last = train and count >= batch_size  # never a setting that yields no batch at all
    if train and not drop_last:
        notes.append(
            f"{count} records are fewer than a batch of {batch_size}: drop_last=True would give no batch; "
            f"drop_last=False gives one batch of {count} an epoch (or measure a smaller --batch-size)"
        )
    if share.get("decode", 0) > 40:
        notes.extend(FORMATS[fmt].decode_advice)
    if dtype != "uint8":
        notes.append(
            f"measured with {dtype} batches ({share.get('to float', 0):.0f}% of a sample's time converts them, "
            "and they are 4x bigger): the advice is uint8, normalized on the GPU by to_device; "
            "`--dtype uint8` measures it"
        )
    if share.get("read", 0) > 30:
        notes.append(
            "reading bytes is a large share: check that the dataset fits in the page cache or is on fast local storage"
        )
    if share.get("resize", 0) > 25 and resize != "packer":
        notes.append(_resize_advice(resize))
    better = [*FORMATS[fmt].cold_advice, *BACKENDS[backend].cold_advice]
    if fits_in_page_cache is False and better:
        notes.append(
            "the dataset does not fit in the page cache, so every epoch reads it from disk: "
            + "; ".join(better)
            + ' (docs/PERFORMANCE.md, "Cold reads")'
        )
    if share.get("resize", 0) > 40:
        notes.append(
            "the resize dominates: a smaller --short-edge at build time (closer to the crop size) makes it cheaper"
        )
    settings = {
        "batch_size": batch_size,
        "num_workers": k.workers,
        "persistent_workers": k.workers > 0,
        "prefetch_factor": 4 if k.workers else None,
        "pin_memory": "True when training on CUDA",
        "drop_last": drop_last,
    }
    sampler = "ShardSampler(ds)" if train else "ShardSampler(ds, shuffle=False)"
    return {"dtype": "uint8", "sampler": sampler, "dataloader": settings, "notes": notes}


@dataclass
class BenchResult:
    path: str
    count: int
    format: str
    backend: str
    dtype: str
    resize: str
    batch_size: int
    crop_size: int
    train: bool
    cores: int
    repeats: int
    dataset_bytes: int
    mem_available: Optional[int]
    fits_in_page_cache: Optional[bool]
    cold_read: str
    throughput: list[Point]
    knee: Point
    profile: dict[str, Any]
    recommendation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """The human-readable report (the table and sentences `packer bench` prints)."""
        lines = [
            (
                f"{self.path}: {self.count} records, {self.format} in {self.backend}; "
                f"{'train' if self.train else 'eval'} crop {self.crop_size}, {self.dtype}, batch {self.batch_size}, "
                f"{self.cores} cores, resize by {self.resize}"
            ),
            "",
            f"DataLoader throughput (no model, warm-up excluded; median and range of {self.repeats} runs each):",
            "  workers   samples/s         min-max   cpu us/sample",
        ]
        best = max(p.samples_per_s for p in self.throughput)
        for p in self.throughput:
            bar = "#" * max(1, round(30 * p.samples_per_s / best)) if best else ""
            spread = f"{p.low:,.0f}-{p.high:,.0f}"
            lines.append(
                f"  {p.workers:>7}   {p.samples_per_s:>9,.0f}   {spread:>13}   {p.cpu_us_per_sample:>13,.0f}  {bar}"
            )
        lines.append(
            f"throughput stops growing at {self.knee.workers} workers ({self.knee.samples_per_s:,.0f} samples/s; "
            f"more add < {100 - 100 * KNEE_FRACTION:.0f}% or less than the runs' spread)"
        )
        prof = self.profile
        lines += [
            "",
            f"Where a sample's time goes (one process, {prof['samples']} samples):",
            "  stage           us/sample       %",
        ]
        for s in prof["stages"]:
            lines.append(f"  {s['stage']:<14} {s['us_per_sample']:>10,.1f}   {s['percent']:>5.1f}")
        lines.append(
            f"  {'total':<14} {prof['us_per_sample']:>10,.1f}   100.0  "
            f"(= {1e6 / prof['us_per_sample']:,.0f} samples/s per process)"
        )
        lines.append("")
        gib = 1 << 30
        if self.fits_in_page_cache is None or self.mem_available is None:
            lines.append(f"dataset {self.dataset_bytes / gib:.2f} GiB (available memory unknown)")
        else:
            lines.append(
                f"dataset {self.dataset_bytes / gib:.2f} GiB, available memory {self.mem_available / gib:.1f} GiB: "
                + (
                    "fits in the page cache (epochs after the first read from memory)"
                    if self.fits_in_page_cache
                    else "does NOT fit in the page cache: every epoch reads from disk"
                )
            )
        lines.append(self.cold_read)
        rec = self.recommendation
        kw = ", ".join(f"{k}={v}" for k, v in rec["dataloader"].items() if v is not None and k != "pin_memory")
        lines += [
            "",
            'recommended (docs/DATASET.md, "Recommended DataLoader settings, and why"):',
            f"  ds = ShardDataset({self.path!r}, crop_size={self.crop_size}, train={self.train}, dtype=torch.uint8)",
            f"  sampler = {rec['sampler']}  # sampler.set_epoch(epoch) before each epoch",
            f"  loader = DataLoader(ds, sampler=sampler, {kw}, pin_memory=True)  # pin_memory on CUDA",
            '  for images, labels in loader: x = packer.transform.to_device(images, "cuda")  # float, normalized',
        ]
        lines += [f"  - {n}" for n in rec["notes"]]
        return "\n".join(lines)


def run_bench(
    path: str | os.PathLike,
    workers: Optional[Sequence[int]] = None,
    batch_size: int = 256,
    crop_size: int = 224,
    train: bool = True,
    epochs: Optional[int] = None,
    dtype: str = "uint8",
    profile_samples: int = PROFILE_SAMPLES,
    *,
    repeats: int = REPEATS,
    progress: Callable[[str], object] = lambda line: None,
) -> BenchResult:
    """Run the sweep (``repeats`` timed runs for each of ``workers``) and the profile on the dataset at
    ``path``; see ``packer bench --help``. ``progress`` is told of each step as it ends (a sweep of
    many worker counts takes minutes)."""
    import torch

    from ..read.dataset import ShardDataset
    from ..transform import resize_backend

    ds = ShardDataset(path, crop_size=crop_size, train=train, dtype=getattr(torch, dtype))
    workers = sorted(set(workers)) if workers else list(range(cores() + 1))
    samples = len(ds) * epochs if epochs else max(min(len(ds), DEFAULT_MAX_SAMPLES), DEFAULT_MIN_BATCHES * batch_size)
    points = []
    for w in workers:
        points.append(measure(ds, w, batch_size, samples, packer_sampler=True, repeats=repeats))
        progress(f"num_workers={w}: {points[-1].samples_per_s:,.0f} samples/s (median of {repeats})")
    prof = profile(ds, batch_size, profile_samples)
    progress("profile of the stages: done")
    size, avail = disk_bytes(path) if not is_url(path) else ds.manifest.bytes, mem_available()
    fits, resize = None if avail is None else size < avail, resize_backend()
    return BenchResult(
        path=str(path),
        count=len(ds),
        format=ds.manifest.format,
        backend=ds.manifest.backend,
        dtype=dtype,
        resize=resize,
        batch_size=batch_size,
        crop_size=crop_size,
        train=train,
        cores=cores(),
        repeats=repeats,
        dataset_bytes=size,
        mem_available=avail,
        fits_in_page_cache=fits,
        cold_read=COLD_READ_HINT,
        throughput=points,
        knee=knee(points),
        profile=prof,
        recommendation=advice(
            points,
            prof["stages"],
            ds.manifest.format,
            dtype,
            resize,
            fits,
            ds.manifest.backend,
            count=len(ds),
            batch_size=batch_size,
            train=train,
        ),
    )


def plot(result: BenchResult, path: str | os.PathLike) -> None:
    """samples/s against num_workers as a PNG (needs matplotlib: the ``[plot]`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.workers for p in result.throughput]
    ys = [p.samples_per_s for p in result.throughput]
    spread = [
        [p.samples_per_s - p.low for p in result.throughput],
        [p.high - p.samples_per_s for p in result.throughput],
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(xs, ys, yerr=spread, marker="o", capsize=3)  # median, and the runs' min to max
    ax.axvline(result.knee.workers, linestyle="--", color="grey", label=f"knee: {result.knee.workers} workers")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{Path(result.path).name}: {result.format}, crop {result.crop_size}, {result.dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
