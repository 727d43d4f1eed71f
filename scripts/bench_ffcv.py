#!/usr/bin/env python3
"""Read speed side by side: packer's ShardDataset vs FFCV's Loader, on the same 320x240 images.

One run, interleaved over several repeats; figures are medians. Both sides read the same 200
generated camera photos stored at a short edge of 240 (320x240 or 240x320: the size of FFCV's
published figures, images at a long side of 320), raw pixels and JPEG (quality 90, 4:2:0), and
produce the same batches: RandomResizedCrop 224 (scale 0.08-1, ratio 3/4-4/3) + horizontal flip,
uint8 NCHW in channels_last memory, labels, batch 256, no normalization, no GPU, as many workers
(packer: DataLoader processes; FFCV: its threads) on both sides:

  packer raw/jpeg: ShardDataset(dtype=torch.uint8) through a DataLoader (packer.tools.bench.measure);
  FFCV raw/jpeg:   Loader(order=RANDOM, os_cache=True, drop_last=True) with the pipeline
                   RandomResizedCropRGBImageDecoder -> RandomHorizontalFlip -> ToTensor -> ToTorchImage.

The .beton files are written once next to the packer datasets (in bench_read.py's cache folder)
from packer's raw records, so FFCV's raw file holds the very same pixels and its JPEG file those
pixels encoded by OpenCV at quality 90, as packer's JPEG records are by libjpeg-turbo; the script
checks both and prints bytes per record and the JPEG error against the raw pixels.

FFCV needs its own environment: its sdist compiles against the system's OpenCV and libturbojpeg
(found with pkg-config), and --no-deps because it asks for opencv-python, whose GUI build is not needed
(the headless one serves its writer). packer is imported from this tree (bench_read.py puts it on
sys.path), with its C extension as the project's own venv built it; its dependencies go in too:

    apt-get install -y pkg-config libopencv-dev libturbojpeg0-dev libjpeg62-turbo-dev
    python3 -m venv /work/ffcv-venv
    /work/ffcv-venv/bin/pip install torch==2.13.0   # the CPU wheel
    /work/ffcv-venv/bin/pip install numba opencv-python-headless terminaltables pytorch_pfn_extras \
        fastargs assertpy tqdm psutil pillow 'PyTurboJPEG>=1.7,<2' 'lmdb>=3.0' click
    /work/ffcv-venv/bin/pip install --no-deps --no-build-isolation ffcv==1.0.2

    /work/ffcv-venv/bin/python scripts/bench_ffcv.py                           # ~2 minutes on 2 cores
    /work/ffcv-venv/bin/python scripts/bench_ffcv.py --repeats 1 --samples 512  # smoke test
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# bench_read.py (beside this file) puts the repository on sys.path: packer comes from this tree
from bench_read import CACHE, CROP, camera_images, median_table, packed, run_interleaved

from packer import __version__ as packer_version
from packer.format import Manifest, load_index
from packer.read.dataset import ShardDataset
from packer.read.reader import open_reader
from packer.tools.bench import cores, measure
from packer.transform import resize_backend

try:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.reader import Reader
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter
except ImportError as e:  # the project's own venv has no FFCV: say how to get one
    sys.exit(
        f"FFCV is not importable here ({e}): run this script with the FFCV venv's python, "
        "set up as the docstring says (/work/ffcv-venv/bin/python scripts/bench_ffcv.py)"
    )

#: Batches each measured run skips before timing, on both sides: what packer.tools.bench.measure skips
#: (each worker's first prefetch_factor + 1 batches, prefetch_factor 2).
PREFETCH = 2


def warm_batches(workers: int) -> int:
    return max(1, workers * (PREFETCH + 1))


# --- the .beton files ----------------------------------------------------------------------------


class Pixels:
    """packer's raw records as FFCV's writer wants them: (H x W x 3 uint8, label)."""

    def __init__(self, dataset: Path) -> None:
        ds = ShardDataset(dataset, crop_size=None, dtype=torch.uint8)  # whole stored images, CHW
        self.images = [ds[i][0].permute(1, 2, 0).contiguous().numpy() for i in range(len(ds))]
        self.labels = [int(x) for x in ds.labels]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], self.labels[i]


def beton(raw: Path, pixels: Pixels, mode: str, workers: int) -> Path:
    """The .beton beside the packer dataset, written once; rewritten when packer's raw dataset changed
    (its manifest digest is kept in a sidecar file)."""
    out = raw.parent / f"ffcv-{mode}-{raw.stem.split('-', 1)[1]}.beton"
    stamp = out.with_name(out.name + ".src")
    digest = Manifest.load(raw).digest
    if out.exists() and stamp.exists() and stamp.read_text() == digest:
        return out
    tmp = out.with_name(out.name + ".tmp")  # a half-written file is never taken for a finished one
    field = RGBImageField(write_mode=mode, jpeg_quality=90)  # FFCV's default quality; packer's too
    writer = DatasetWriter(str(tmp), {"image": field, "label": IntField()}, num_workers=workers)
    writer.from_indexed_dataset(pixels)
    os.replace(tmp, out)
    stamp.write_text(digest)
    return out


def beton_records(path: Path) -> list[bytes]:
    """The image field's stored bytes of each record, found through FFCV's own allocation table."""
    reader = Reader(str(path))
    size = dict(zip(reader.alloc_table["ptr"].tolist(), reader.alloc_table["size"].tolist()))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    image = reader.metadata[reader.metadata.dtype.names[reader.field_names.index("image")]]  # fields are unnamed
    return [bytes(data[p : p + size[p]]) for p in image["data_ptr"].tolist()]


def check_stored(pixels: Pixels, jpeg: Path, raw_beton: Path, jpg_beton: Path) -> str:
    """Bytes per record and JPEG error against the raw pixels, both sides: the same images, stored
    the same way (a mismatch of the raw files is fatal: the comparison would not be like for like)."""
    import cv2

    for ref, rec in zip(pixels.images, beton_records(raw_beton)):
        if rec != ref.tobytes():
            sys.exit(f"{raw_beton} does not hold packer's raw pixels: delete it to rewrite it")
    manifest = Manifest.load(jpeg)
    index, _ = load_index(jpeg, manifest)
    reader = open_reader(jpeg, manifest, index)
    packer_bytes = [len(reader.get(i)) for i in range(manifest.count)]
    decoded = ShardDataset(jpeg, crop_size=None, dtype=torch.uint8)
    packer_err = [
        np.abs(decoded[i][0].permute(1, 2, 0).numpy().astype(np.int16) - ref).mean()
        for i, ref in enumerate(pixels.images)
    ]
    recs = beton_records(jpg_beton)
    bgr = [cv2.imdecode(np.frombuffer(r, np.uint8), cv2.IMREAD_COLOR) for r in recs]
    ffcv_err = [np.abs(b[..., ::-1].astype(np.int16) - ref).mean() for b, ref in zip(bgr, pixels.images)]
    kib = 1024
    ffcv_bytes = [len(r) for r in recs]
    return (
        f"stored per record: raw {pixels.images[0].nbytes / kib:.0f} KiB both (FFCV's = packer's pixels, "
        f"checked); JPEG q90 packer {np.mean(packer_bytes) / kib:.1f} KiB, FFCV {np.mean(ffcv_bytes) / kib:.1f} "
        f"KiB; mean |error| vs raw: packer {np.mean(packer_err):.2f}, FFCV {np.mean(ffcv_err):.2f}"
    )


# --- the measurements ----------------------------------------------------------------------------


def packer_rate(path: Path, samples: int, batch_size: int, workers: int) -> tuple[float, float]:
    """(samples/s, CPU us per sample) of ShardDataset through a DataLoader, warm-up excluded."""
    point = measure(ShardDataset(path, dtype=torch.uint8), workers, batch_size, samples, prefetch_factor=PREFETCH)
    return point.samples_per_s, point.cpu_us_per_sample


_LOADERS: dict[Path, Loader] = {}


def ffcv_loader(path: Path, count: int, samples: int, batch_size: int, workers: int) -> Loader:
    """The Loader of one .beton, made once and kept across repeats as training keeps it across epochs:
    numba compiles its pipeline on the first epoch, which is run here and not timed. (Kept alive to the
    end also because numba 0.68's finalizer of a collected FFCV pipeline prints a harmless KeyError.)"""
    if path not in _LOADERS:
        warm = warm_batches(workers)
        # An epoch visits the stored records in a random order, each about equally often, as many times as
        # the measurement needs: the same records packer's sampler draws from, no replicated file.
        indices = np.resize(np.arange(count), (warm + samples // batch_size) * batch_size)
        loader = Loader(
            str(path),
            batch_size=batch_size,
            num_workers=workers,
            order=OrderOption.RANDOM,
            seed=0,
            os_cache=True,
            drop_last=True,
            indices=indices,
            pipelines={
                "image": [
                    RandomResizedCropRGBImageDecoder((CROP, CROP)),
                    RandomHorizontalFlip(),
                    ToTensor(),
                    ToTorchImage(),
                ],
                "label": [IntDecoder(), ToTensor()],
            },
        )
        for images, _ in loader:  # the compiling epoch
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, CROP, CROP)
        _LOADERS[path] = loader
    return _LOADERS[path]


def ffcv_rate(path: Path, count: int, samples: int, batch_size: int, workers: int) -> tuple[float, float]:
    """(samples/s, CPU us per sample) of one epoch of FFCV's Loader, timed after the same warm-up
    batches packer's measure skips (an epoch starts its thread and allocates its batch buffers anew)."""
    it = iter(ffcv_loader(path, count, samples, batch_size, workers))
    for _ in range(warm_batches(workers)):
        next(it)
    # FFCV's workers are threads of this process: its CPU time is theirs and the main thread's
    cpu0, t0, n = time.process_time(), time.perf_counter(), 0
    for _, labels in it:
        n += len(labels)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return n / seconds, cpu / n * 1e6


# --- main ----------------------------------------------------------------------------------------


def linked(prefix: str) -> str:
    """The file name of a shared library this process has loaded (its version is in it)."""
    with open("/proc/self/maps") as f:
        names = {Path(line.split()[-1]).name for line in f if "/" in line}
    return ", ".join(sorted(n for n in names if n.startswith(prefix))) or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=200, help="camera images (packed once, read in epochs)")
    ap.add_argument(
        "--samples",
        type=int,
        default=5120,
        help="samples timed per run, rounded up to whole batches; keep 20+ batches: the batches "
        "in progress when the clock starts skew a short run",
    )
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=cores(), help="DataLoader processes / FFCV threads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--short-edge", type=int, default=240, help="stored short edge (240: FFCV's 320 long side)")
    args = ap.parse_args()
    w, bs, se = args.workers, args.batch_size, args.short_edge
    samples = -(-args.samples // bs) * bs  # whole batches: both sides time exactly this many samples

    raw_photos = camera_images(args.images, w)
    work = CACHE / f"read-{args.images}"
    jpeg = packed(raw_photos, work / f"jpeg-{se}.lmdb", "jpeg", w, short_edge=se)
    raw = packed(raw_photos, work / f"raw-{se}.lmdb", "raw", w, short_edge=se)
    pixels = Pixels(raw)
    count = len(pixels)
    raw_beton = beton(raw, pixels, "raw", w)
    jpg_beton = beton(raw, pixels, "jpg", w)
    stored = check_stored(pixels, jpeg, raw_beton, jpg_beton)
    del pixels  # 200 decoded images: not kept through the measurements

    # neighbours compare: each FFCV run right after packer's on the same format
    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "packer raw uint8": lambda: packer_rate(raw, samples, bs, w),
        "FFCV raw uint8": lambda: ffcv_rate(raw_beton, count, samples, bs, w),
        "packer jpeg uint8": lambda: packer_rate(jpeg, samples, bs, w),
        "FFCV jpeg uint8": lambda: ffcv_rate(jpg_beton, count, samples, bs, w),
    }
    import cv2
    import numba
    import PIL

    print(
        f"{count} images at short edge {se}, {w} workers, batch {bs}, RandomResizedCrop {CROP} + flip, uint8, "
        f"{samples:,} samples timed a run after {warm_batches(w)} warm-up batches, {args.repeats} repeats; "
        f"{cores()} cores usable ({os.cpu_count()} on the machine)"
    )
    print(
        f"packer {packer_version} (resize by {resize_backend()}, Pillow {PIL.__version__}); "
        f"FFCV {importlib.metadata.version('ffcv')}, numba {numba.__version__}, numpy {np.__version__}, "
        f"torch {torch.__version__}, opencv-python-headless {cv2.__version__} (writing the JPEG .beton only)"
    )
    print(stored, flush=True)
    wall, cpu = run_interleaved(runs, args.repeats, w, width=18)
    print(
        f"FFCV's decoder links {linked('libturbojpeg')}, {linked('libopencv_imgproc')}; "
        f"numba threading layer {numba.threading_layer()}"
    )

    print(
        f"\nmedians of {args.repeats}; 'CPU-based' = {w} x 1e6 / (CPU us per sample, all processes and threads): "
        f"the rate {w} idle cores would give"
    )
    med, med_cpu = median_table(wall, cpu, width=18)
    print("\npacker / FFCV        wall-clock  CPU-based")
    for fmt in ("raw", "jpeg"):
        a, b = f"packer {fmt} uint8", f"FFCV {fmt} uint8"
        print(f"  {fmt:<18} {med[a] / med[b]:>10.2f}x {med_cpu[a] / med_cpu[b]:>9.2f}x")
    print(
        "  notes: FFCV decodes whole JPEGs with libjpeg-turbo's fast integer DCT (TJFLAG_FASTDCT) and resizes\n"
        "  with OpenCV INTER_AREA; packer decodes only the crop's rows and columns with the accurate DCT and\n"
        "  resizes with its antialiased bilinear kernel. Both read from the page cache (warm): cold reads from\n"
        "  disk are not measured."
    )


if __name__ == "__main__":
    main()
