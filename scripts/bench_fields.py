"""Read speed with fields against the same images without: JPEG (and raw) records with 10 boxes each,
and with a mask (the boxes filled with their labels, a segmentation map), stored run-length encoded
and as raw pixels (the first layout), train crops moving them, ratios measured in one run; and with ``--pack``, the
write side: ``packer.pack`` from paths and from in-memory arrays against ``packer build`` of the
same photos (docs/PERFORMANCE.md, "Fields").

    .venv/bin/python scripts/bench_fields.py [--records 1024] [--repeats 5] [--workers 0] [--formats jpeg,raw] [--pack]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

import packer

PHOTOS = Path(__file__).resolve().parents[1] / "tests" / "data" / "exif-orientation"


def samples(n: int, with_mask: bool) -> list[dict]:
    """``n`` samples over the real test photos, each with 10 seeded boxes (and a mask: the boxes
    filled with their labels, later over earlier, as a COCO image's map of its objects)."""
    photos = [ImageOps.exif_transpose(Image.open(p)).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        im = photos[i % len(photos)]
        w, h = im.size
        x0, y0 = rng.uniform(0, w * 0.7, 10), rng.uniform(0, h * 0.7, 10)
        boxes = np.stack([x0, y0, x0 + rng.uniform(10, w * 0.3, 10), y0 + rng.uniform(10, h * 0.3, 10)], 1)
        labels = rng.integers(1, 80, 10)
        sample = {"image": im, "boxes": boxes, "box_labels": labels}
        if with_mask:
            mask = np.zeros((h, w), np.uint8)
            for (a, b, c, d), label in zip(boxes.astype(int), labels):
                mask[b:d, a:c] = label
            sample["mask"] = mask
        out.append(sample)
    return out


def cpu_seconds() -> float:
    """CPU seconds used so far by this process (all its threads) and its child processes: those it
    has reaped (``os.times``), and each live one, read from /proc/<pid>/stat, with what it reaped in
    turn (utime + stime + cutime + cstime): the DataLoader workers (persistent: alive from the
    warm-up round on), and the forkserver whose children are ``packer.build``'s and ``packer.pack``'s
    workers. A child's CPU moves from one sum to the other when it is reaped, so none is lost."""
    tick = os.sysconf("SC_CLK_TCK")
    times = os.times()
    total = time.process_time() + times.children_user + times.children_system
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # a process that exited meanwhile
            continue
        if fields[1] == me:  # ppid (field 4 of stat; fields[0] is field 3, the state)
            total += sum(int(f) for f in fields[11:15]) / tick  # utime, stime, cutime, cstime (14-17)
    return total


def rates(paths: dict[str, Path], repeats: int, workers: int) -> dict[str, tuple[list[float], list[float]]]:
    """Samples/s of train crops (224, uint8) over every record of each dataset, one epoch each in
    turn, ``repeats`` rounds after a warm-up round (interleaved: a busy host slows them alike), by
    wall time and by CPU time (this process and its DataLoader workers: :func:`cpu_seconds`)."""
    # torch imported here, not by the module: a script that imports it makes every worker process of
    # packer.build and packer.pack import it again (2 s of CPU each here), which --pack would time
    import torch
    from torch.utils.data import DataLoader

    from packer import ShardDataset, ShardSampler

    loaders = {}
    for name, path in paths.items():
        ds = ShardDataset(path, crop_size=224, train=True, dtype=torch.uint8)
        sampler = ShardSampler(ds)
        loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
        loaders[name] = (sampler, loader)
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in paths}
    for epoch in range(repeats + 1):
        for name, (sampler, loader) in loaders.items():
            sampler.set_epoch(epoch)
            t0, c0 = time.perf_counter(), cpu_seconds()
            n = sum(len(b["image"] if isinstance(b, dict) else b[0]) for b in loader)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            if epoch:
                out[name][0].append(n / wall)
                out[name][1].append(n / cpu)
    return out


def pack_against_build(root: Path, records: int, repeats: int, workers: Optional[int]) -> None:
    """Seconds to pack ``records`` photos (the test photos, copied): ``packer build`` of their
    folder, ``packer.pack`` of their paths, and of their pixels decoded beforehand (and so again
    with update=True, into a new OUT: the digests' cost); ``repeats`` rounds of the four, by wall and
    CPU time (:func:`cpu_seconds`: the workers' included), and each round's own ratio to the build."""
    raw = root / "raw" / "photos"
    raw.mkdir(parents=True)
    photos = sorted(PHOTOS.glob("*.jpg"))
    for i in range(records):
        (raw / f"{i:05d}.jpg").write_bytes(photos[i % len(photos)].read_bytes())
    paths = sorted(raw.iterdir())
    pixels = [np.asarray(ImageOps.exif_transpose(Image.open(p)).convert("RGB")) for p in paths]
    names = ("packer build", "packer.pack, paths", "packer.pack, arrays", "arrays, update=True")
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        # each round in another order (rotated): none always runs first, after the others' files
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out = root / f"out-{r}-{name.replace(' ', '').replace(',', '-')}"
            t0, c0 = time.perf_counter(), cpu_seconds()
            if name == "packer build":
                packer.build(raw.parent, out, workers=workers, quiet=True)
            elif name.endswith("paths"):
                packer.pack([{"image": p} for p in paths], out, fields={}, workers=workers)
            elif name.endswith("arrays"):
                packer.pack([{"image": a} for a in pixels], out, fields={}, workers=workers)
            else:  # a digest of every sample taken (what a later refresh compares)
                keyed = [{"image": a, "source": f"{i}"} for i, a in enumerate(pixels)]
                packer.pack(keyed, out, fields={}, workers=workers, update=True)
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(cpu_seconds() - c0)
    for name in names:
        # each round's own ratio: the four run back to back, under the same load
        by_wall = [b / s for b, s in zip(walls["packer build"], walls[name])]
        by_cpu = [b / s for b, s in zip(cpus["packer build"], cpus[name])]
        print(
            f"{name:<21} {_spread(walls[name], '.2f')} s, {_spread(cpus[name], '.2f')} CPU-s; per round "
            f"{_spread(by_wall, '.2f')}x wall, {_spread(by_cpu, '.2f')}x CPU"
        )


def _spread(values: list[float], spec: str) -> str:
    """The median of ``values`` and their range."""
    return f"{statistics.median(values):{spec}} (median; {min(values):{spec}}-{max(values):{spec}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--formats", default="jpeg,raw", help="record formats read (comma-separated)")
    parser.add_argument("--pack", action="store_true", help="time the write side instead (all cores unless --workers)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.pack:
            pack_against_build(root, args.records, args.repeats, args.workers or None)
            return
        plain = samples(args.records, False)
        masked = samples(args.records, True)
        for fmt in args.formats.split(","):
            sets = {
                "no fields": ([{"image": s["image"]} for s in plain], {}),
                "10 boxes": (plain, {"boxes": "boxes", "box_labels": "box_labels"}),
                "10 boxes + mask": (masked, {"boxes": "boxes", "box_labels": "box_labels", "mask": "mask"}),
                "+ mask, raw": (
                    masked,
                    {"boxes": "boxes", "box_labels": "box_labels", "mask": {"kind": "mask", "encoding": "raw"}},
                ),
            }
            paths = {}
            for name, (data, fields) in sets.items():
                paths[name] = root / f"{fmt}-{name.replace(' ', '_').replace('+', '').replace(',', '')}"
                packer.pack(data, paths[name], fields=fields, format=fmt, backend="memmap")
            results = rates(paths, args.repeats, args.workers)
            base_wall, base_cpu = results["no fields"]
            for name, (wall, cpu) in results.items():
                kb = np.load(paths[name] / "index.npy", allow_pickle=False)["length"].mean() / 1000
                # each round's own ratio: the datasets of a round run back to back, under the same load
                by_wall = [w / b for w, b in zip(wall, base_wall)]
                by_cpu = [c / b for c, b in zip(cpu, base_cpu)]
                print(
                    f"{fmt:>4} {name:<16} {_spread(wall, '.0f')} samples/s, {_spread(cpu, '.0f')} per CPU-s; "
                    f"per round {_spread(by_wall, '.2f')}x wall, {_spread(by_cpu, '.2f')}x CPU  {kb:.0f} KB/record"
                )


if __name__ == "__main__":
    main()
