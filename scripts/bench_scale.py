"""How packer's whole-dataset steps scale with the number of files: build, --update with nothing, one and
1% of the files changed, verify cold and warm, and the main process's peak memory in each.

Trees are ImageNet-shaped (1,000 class folders) of hard links to a few distinct JPEGs, so that 1M files
cost no disk. Every step runs as its own `packer` process (what cron runs), timed from outside. Memory,
in MB: that process's peak RSS (VmHWM, read as it exits; ru_maxrss would also count the process that
forked it before exec) / its peak anonymous memory (RssAnon, sampled: RSS also counts the dataset's
pages it maps, which the kernel reclaims at will), and the peak PSS of its whole process tree, workers
included (sampled). "Cold" evicts the dataset's pages first (scripts/pagecache.py); the disk's own
sequential bandwidth is measured the same way (a cold read of the data files in 8 MiB blocks), so a
pass can be stated as a share of it.

    python scripts/bench_scale.py --sizes 10000 100000 [--backend lmdb|memmap] [--keep]
    python scripts/bench_scale.py --sizes 1000000 --source-size 64x48   # tiny images for the 1M tree

Figures and the commands used are in docs/PERFORMANCE.md ("Whole-dataset passes at scale", "A million files").
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_build import _descendants, _pss_kib
from pagecache import evict, files

WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "packer-scale"
CLASSES = 1000
DISTINCT = 50  # distinct source JPEGs; the rest of the tree is hard links to them


def distinct_jpegs(dest: Path, size: tuple[int, int]) -> list[Path]:
    """A few varied photos-like JPEGs (gradients plus noise), each a different file."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = size
    out = []
    for k in range(DISTINCT):
        base = np.linspace(0, 255, w)[None, :, None] * rng.random(3) + np.linspace(0, 120, h)[:, None, None]
        pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        path = dest / f"src{k:03d}.jpg"
        path.write_bytes(buf.getvalue())
        out.append(path)
    return out


def make_tree(n: int, size: tuple[int, int]) -> Path:
    """raw/ with ``n`` files in CLASSES folders, hard-linked to DISTINCT sources (made once, then reused)."""
    raw = WORK / f"raw-{n}-{size[0]}x{size[1]}"
    if (raw / ".complete").exists():
        return raw
    shutil.rmtree(raw, ignore_errors=True)
    sources = distinct_jpegs(WORK / f"sources-{size[0]}x{size[1]}", size)
    for c in range(CLASSES):
        (raw / f"n{c:08d}").mkdir(parents=True)
    for i in range(n):
        os.link(sources[i % DISTINCT], raw / f"n{i % CLASSES:08d}" / f"img{i:08d}.jpg")
    (raw / ".complete").touch()
    return raw


# Runs the CLI and, as the process exits, writes its peak RSS (VmHWM, kB) and the peak of its anonymous
# memory (RssAnon sampled every 20 ms: VmHWM also counts the dataset's file pages it has mapped, which
# the kernel reclaims at will) to the file named by argv[1].
_STEP = """
import atexit, sys, threading, time
def status(field):
    with open("/proc/self/status") as f:
        return int(next(l.split()[1] for l in f if l.startswith(field)))
anon = [0]
def sample():
    while True:
        anon[0] = max(anon[0], status("RssAnon:"))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
def peak(path=sys.argv[1]):
    with open(path, "w") as out:
        out.write(f"{status('VmHWM:')} {max(anon[0], status('RssAnon:'))}")
atexit.register(peak)
sys.argv = ["packer"] + sys.argv[2:]
from packer.cli import main
main()
"""


def run(args: list[str]) -> tuple[float, str]:
    """Run ``packer ARGS``; (wall seconds, "peak RSS / peak anonymous memory of that process, peak PSS
    of its whole process tree" in MB; the tree's PSS sampled every 0.1 s, as bench_build.py does)."""
    peak = WORK / "peak-rss"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _STEP, str(peak), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    tree = 0
    while proc.poll() is None:
        tree = max(tree, sum(_pss_kib(p) for p in _descendants(proc.pid)))
        time.sleep(0.1)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"packer {' '.join(args)} failed:\n{proc.stderr.read() if proc.stderr else ''}")
    hwm, anon = (int(v) / 1024 for v in peak.read_text().split())
    return wall, f"{hwm:.0f}/{anon:.0f}, tree {tree / 1024:.0f} MB"


def touch(raw: Path, paths: list[Path]) -> None:
    """Change files' content identity (a new mtime) without writing: hard links share the inode, so
    replace each with a fresh copy, as an edit would."""
    for p in paths:
        data = p.read_bytes()
        p.unlink()
        p.write_bytes(data)


def disk_mb_s(dataset: Path) -> float:
    """Cold sequential read of the dataset's data files, 8 MiB blocks (what the disk gives one reader)."""
    evict(dataset)
    total, start = 0, time.perf_counter()
    for f in files(dataset):
        if f.suffix in (".npy", ".json", ".jsonl"):
            continue
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(8 << 20):
                total += len(chunk)
    return total / 1e6 / (time.perf_counter() - start)


def measure(n: int, size: tuple[int, int], backend: str, workers: int) -> dict[str, str]:
    raw = make_tree(n, size)
    out = WORK / f"out-{n}.{backend}"
    shutil.rmtree(out, ignore_errors=True)
    common = ["--backend", backend, "--workers", str(workers), "--quiet"]
    row: dict[str, str] = {"files": f"{n:,}"}
    t, rss = run(["build", str(raw), str(out), *common])
    row["build"] = f"{t:.1f} s ({rss})"
    t, rss = run(["build", str(raw), str(out), "--update", *common])
    row["update, nothing"] = f"{t:.1f} s ({rss})"
    every = sorted(raw.rglob("*.jpg"))
    touch(raw, every[n // 2 : n // 2 + 1])
    t, rss = run(["build", str(raw), str(out), "--update", *common])
    row["update, 1 file"] = f"{t:.1f} s ({rss})"
    evict(out)
    touch(raw, every[n // 2 + 1 :: 100])
    t, rss = run(["build", str(raw), str(out), "--update", *common])
    row["update, 1% cold"] = f"{t:.1f} s ({rss})"
    data_mb = sum(f.stat().st_size for f in files(out)) / 1e6
    disk = disk_mb_s(out)
    evict(out)
    t, rss = run(["verify", str(out)])
    row["verify cold"] = f"{t:.1f} s, {data_mb / t:.0f} MB/s = {data_mb / t / disk:.0%} of disk ({rss})"
    t, rss = run(["verify", str(out)])
    row["verify warm"] = f"{t:.1f} s ({rss})"
    row["dataset"] = f"{data_mb:,.0f} MB; disk {disk:.0f} MB/s"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--source-size", default="500x375", help="WxH of the source JPEGs")
    parser.add_argument("--backend", choices=["lmdb", "memmap"], default="lmdb")
    parser.add_argument("--workers", type=int, default=0, help="build workers (0: all cores)")
    parser.add_argument("--keep", action="store_true", help="keep the datasets (trees are always kept)")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.source_size.split("x"))
    rows = [measure(n, size, args.backend, args.workers) for n in args.sizes]  # type: ignore[arg-type]
    keys = list(rows[0])
    print(f"backend {args.backend}, sources {args.source_size}, {os.cpu_count()} cores")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(r[k] for k in keys) + " |")
    if not args.keep:
        for n in args.sizes:
            shutil.rmtree(WORK / f"out-{n}.{args.backend}", ignore_errors=True)


if __name__ == "__main__":
    main()
