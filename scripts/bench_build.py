#!/usr/bin/env python3
"""Build speed side by side: packer build vs the naive Pillow loop vs the bare DCT-scaled decode floor.

All three run in one invocation on the same files with the same number of processes, interleaved
over several repeats; the figures are medians. Also prints peak memory of the whole build (PSS summed
over the build's process tree), output bytes per image, LMDB overhead, and PSNR of the packed images
against the naive full-resolution LANCZOS path.

    python scripts/bench_build.py                     # 200 generated 12 MP photos, all cores
    python scripts/bench_build.py --images 2000 --repeats 1 --skip-baselines   # memory at scale
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.builder.preprocess import target_size  # noqa: E402
from packer.codec import decode_jpeg, shrink_factor, turbojpeg  # noqa: E402
from packer.format import Manifest, load_index, source_path  # noqa: E402
from packer.read.reader import open_reader  # noqa: E402
from packer.tools.sample import make_folder  # noqa: E402

SHORT = 320


def replicate(raw: Path, files: list[str], k: int, dest: Path) -> Path:
    """A tree listing each file ``k`` times through symlinks (copy j in class folder ``<class>-j``)."""
    if not dest.is_dir():
        for j in range(k):
            for f in files:
                link = dest / f"{Path(f).parent.name}-{j}" / Path(f).name
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(Path(f).resolve())
    return dest


def floor_turbojpeg(path: str) -> int:
    """The unavoidable work: read the file and decode it at the DCT scale packer uses."""
    with open(path, "rb") as f:
        data = f.read()
    w, h = Image.open(io.BytesIO(data)).size
    return decode_jpeg(data, width=w, height=h, factor=shrink_factor(w, h, SHORT)).size


def floor_pillow_draft(path: str) -> int:
    with Image.open(path) as im:
        width, height = im.size
        im.draft("RGB", target_size(width, height, SHORT))
        im.load()
        return im.size[0]


def naive(path: str) -> int:
    """The loop most scripts run: full decode, exif_transpose, LANCZOS, save."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        im = im.resize(target_size(*im.size, SHORT), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        im.save(out, format="JPEG", quality=90)
        return out.tell()


def naive_pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        return np.asarray(im.resize(target_size(*im.size, SHORT), Image.Resampling.LANCZOS))


def children_cpu() -> float:
    """CPU seconds used by reaped child processes (and their reaped children): steady under load."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def time_pool(fn, files: list[str], workers: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the pool's processes) for mapping ``fn`` over ``files``."""
    t0, c0 = time.perf_counter(), children_cpu()
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(fn, files, chunksize=4)
    return time.perf_counter() - t0, children_cpu() - c0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def time_packer(raw: Path, out: Path, workers: int, backend: str, fmt: str) -> tuple[float, float]:
    """(wall, CPU seconds) of packer.build called in this process, like the baselines' pools: no
    interpreter start-up counted, and the CPU of this process plus its reaped workers."""
    import packer

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime + children_cpu()

    t0, c0 = time.perf_counter(), cpu()
    packer.build(raw, out, workers=workers, backend=backend, format=fmt, force=True, quiet=True)
    return time.perf_counter() - t0, cpu() - c0


def run_packer(raw: Path, out: Path, workers: int, backend: str, fmt: str) -> dict:
    """packer build in a subprocess; peak PSS summed over its whole process tree, polled every 50 ms."""
    code = (
        "import json, sys, dataclasses, packer; r = packer.build(sys.argv[1], sys.argv[2], "
        "workers=int(sys.argv[3]), backend=sys.argv[4], format=sys.argv[5], force=True, quiet=True); "
        "print(json.dumps(dataclasses.asdict(r)))"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(raw), str(out), str(workers), backend, fmt], stdout=subprocess.PIPE, cwd=ROOT
    )
    peak = 0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, sum(_pss_kib(p) for p in _descendants(proc.pid)))
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    if proc.returncode:
        raise SystemExit(f"packer build failed ({proc.returncode})")
    report = json.loads(stdout)
    return {"seconds": report["seconds"], "wall": wall, "peak_pss_mib": peak / 1024, "count": report["count"]}


def quality(out: Path, raw: Path, sample: int) -> dict:
    """PSNR of packed images vs the naive LANCZOS pixels; naive's own q90 JPEG for comparison."""
    manifest = Manifest.load(out)
    index, sources = load_index(out, manifest)
    reader = open_reader(out, manifest, index)
    ours, theirs = [], []
    for i in np.linspace(0, len(index) - 1, sample).astype(int):
        ref = naive_pixels(raw / source_path(sources, index[i])).astype(np.float64)
        row = index[i]
        mine = decode_jpeg(reader.get(int(i)), width=int(row["width"]), height=int(row["height"])).astype(np.float64)
        buf = io.BytesIO()
        Image.fromarray(ref.astype(np.uint8)).save(buf, format="JPEG", quality=90)
        naive_jpeg = np.asarray(Image.open(buf)).astype(np.float64)
        ours.append(10 * np.log10(255**2 / np.mean((mine - ref) ** 2)))
        theirs.append(10 * np.log10(255**2 / np.mean((naive_jpeg - ref) ** 2)))
    record_bytes = int(index["length"].sum())
    disk = sum(p.stat().st_size for p in out.iterdir() if p.name.endswith((".mdb", ".bin")))
    return {
        "psnr_db": statistics.mean(ours),
        "naive_q90_psnr_db": statistics.mean(theirs),
        "bytes_per_image": record_bytes / len(index),
        "data_file_over_records": disk / record_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", type=Path, help="folder of JPEGs (default: generate camera-like ones)")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--size", default="4000x3000")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "memmap"])
    ap.add_argument("--format", default="jpeg", choices=["jpeg", "raw"])
    ap.add_argument("--skip-baselines", action="store_true", help="only packer (e.g. memory at scale)")
    ap.add_argument("--repeats-memory", type=int, default=1, help="builds run only to measure memory")
    ap.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="list every image K times (symlinks): memory at K x the images without K x the disk",
    )
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "packer-bench")
    args = ap.parse_args()

    width, height = (int(v) for v in args.size.split("x"))
    size = (width, height)
    raw = args.raw or args.work / f"raw-{args.images}-{args.size}"
    files = [
        str(f) for f in (sorted(raw.rglob("*.jpg")) if args.raw else make_folder(raw, args.images, size, args.workers))
    ]
    if args.replicate > 1:
        raw = replicate(raw, files, args.replicate, args.work / f"replicated-{len(files)}x{args.replicate}")
        files = [str(f) for f in sorted(raw.rglob("*.jpg"))]
    out = args.work / f"out.{args.backend}"
    import PIL

    simd = ".post" in PIL.__version__
    print(
        f"{len(files)} images from {raw}; {args.workers} processes; Pillow {PIL.__version__}"
        f"{' (pillow-simd)' if simd else ''}; turbojpeg {'yes' if turbojpeg() else 'no'}; "
        f"{args.backend}/{args.format}; {args.repeats} repeats (medians)"
    )
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: list[float] = []

    def record(name: str, wall: float, cpu: float) -> None:
        walls.setdefault(name, []).append(wall)
        cpus.setdefault(name, []).append(cpu)

    for _ in range(args.repeats):
        if not args.skip_baselines:
            record("floor: turbojpeg scaled decode", *time_pool(floor_turbojpeg, files, args.workers))
            record("floor: Pillow draft decode", *time_pool(floor_pillow_draft, files, args.workers))
            record("naive Pillow loop", *time_pool(naive, files, args.workers))
        record("packer build", *time_packer(raw, out, args.workers, args.backend, args.format))
    for _ in range(args.repeats_memory):
        peaks.append(run_packer(raw, out, args.workers, args.backend, args.format)["peak_pss_mib"])
    n = len(files)
    # wall: median images/s as measured; cpu: what the processes would do on idle cores
    # (images per CPU-second x processes), far steadier on a shared machine.
    rate = {k: n / statistics.median(v) for k, v in walls.items()}
    cpu_rate = {k: n * args.workers / statistics.median(v) for k, v in cpus.items()}
    print(f"  {'':<32} {'wall img/s':>10} {'CPU-based':>10} {'CPU ms/img':>10}")
    for k in walls:
        print(
            f"  {k:<32} {rate[k]:10.1f} {cpu_rate[k]:10.1f} {1000 * statistics.median(cpus[k]) / n:10.1f}"
            f"   (wall runs: {', '.join(f'{t:.2f}s' for t in walls[k])})"
        )
    result = {
        "images": n,
        "workers": args.workers,
        "pillow": PIL.__version__,
        "rates": rate,
        "cpu_rates": cpu_rate,
        "peak_pss_mib": max(peaks),
    }
    if not args.skip_baselines:
        for kind, r in (("wall", rate), ("cpu", cpu_rate)):
            floor = max(r["floor: turbojpeg scaled decode"], r["floor: Pillow draft decode"])
            result[f"{kind}_vs_floor"] = r["packer build"] / floor
            result[f"{kind}_vs_naive"] = r["packer build"] / r["naive Pillow loop"]
            print(
                f"  {kind:>4}: packer / decode floor = {result[f'{kind}_vs_floor']:.2f}x   "
                f"packer / naive = {result[f'{kind}_vs_naive']:.2f}x"
            )
    print(f"  peak memory of the build (PSS, all processes): {max(peaks):.0f} MiB")
    if args.format == "jpeg":
        q = quality(out, raw, sample=min(20, len(files)))
        result.update(q)
        print(
            f"  {q['bytes_per_image']:,.0f} bytes/image; data file / sum of records = "
            f"{q['data_file_over_records']:.3f}; PSNR vs naive LANCZOS {q['psnr_db']:.2f} dB "
            f"(naive's own q90 JPEG: {q['naive_q90_psnr_db']:.2f} dB)"
        )
    print("JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
