"""Resize kernels side by side, one process: packer's (packer/_resize.c), Pillow's (Pillow-SIMD when
installed) and torch's uint8 antialiased bilinear, on RandomResizedCrop boxes of a 427x320 record.

Each kernel does what the read path needs from it, from the record's RGB pixels to a 224x224 RGB
batch slot, mirrored for half the boxes:
- packer: one call, reading the crop in place and writing the slot;
- Pillow ("in+resize+out"): unpack the crop to its RGBX layout, resize, pack back to RGB and mirror
  (packer's ``pack_rgb``), as ShardDataset does with PACKER_RESIZE=pillow; its resize alone is
  shown too;
- torch: ``F.interpolate(antialias=True)`` on the crop, flip, copy into the slot.

    python scripts/bench_resize.py [--boxes 256] [--repeats 7]

Prints microseconds per crop (median of the repeats, each over the same boxes) by crop-size class.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packer.transform import DRAWS, random_resized_crops, uniforms
from packer.transform.resize import _native, _pixels

H, W, SIZE = 320, 427, 224


def kernels(img: np.ndarray, out: np.ndarray) -> dict[str, Callable[[tuple[int, int, int, int, bool]], object]]:
    def packer(box: tuple[int, int, int, int, bool]) -> None:
        top, left, h, w, flip = box
        _native.resize_crop(img, H, W, top, left, h, w, out, SIZE, SIZE, flip)

    def pillow_resize(box: tuple[int, int, int, int, bool]) -> Image.Image:
        top, left, h, w, _ = box
        src = Image.frombuffer("RGB", (w, h), img.reshape(-1)[(top * W + left) * 3 :], "raw", "RGB", W * 3, 1)
        return src.resize((SIZE, SIZE), Image.Resampling.BILINEAR)

    def pillow(box: tuple[int, int, int, int, bool]) -> None:
        _native.pack_rgb(_pixels(pillow_resize(box)), SIZE, SIZE, box[4], out)

    slot = torch.from_numpy(out)

    def torch_kernel(box: tuple[int, int, int, int, bool]) -> None:
        top, left, h, w, flip = box
        region = torch.from_numpy(img[top : top + h, left : left + w]).permute(2, 0, 1)[None]
        hwc = F.interpolate(region, size=(SIZE, SIZE), mode="bilinear", antialias=True)[0].permute(1, 2, 0)
        slot.copy_(hwc.flip(1) if flip else hwc)

    return {"packer": packer, "Pillow in+resize+out": pillow, "Pillow resize": pillow_resize, "torch": torch_kernel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boxes", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if _native is None:
        sys.exit("packer._native is not built: nothing to compare")
    torch.set_num_threads(1)  # as in a DataLoader worker
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    u = uniforms(0, 0, np.arange(args.boxes), DRAWS)
    crops = random_resized_crops(u, np.full(args.boxes, H), np.full(args.boxes, W))
    boxes = [(top, left, h, w, bool(f < 0.5)) for (top, left, h, w), f in zip(crops.tolist(), u[:, 40])]
    classes = {
        "all RandomResizedCrop boxes": boxes,
        "crop taller than 224": [b for b in boxes if b[2] >= SIZE],
        "crop shorter than 224": [b for b in boxes if b[2] < SIZE],
    }
    fns = kernels(img, out)
    import PIL

    print(
        f"{args.boxes} boxes of a {W}x{H} record -> {SIZE}x{SIZE}, median of {args.repeats}; "
        f"Pillow {PIL.__version__}, torch {torch.__version__} (1 thread)"
    )
    print(f"  {'us per crop':<34}" + "".join(f"{name:>22}" for name in fns))
    for label, subset in classes.items():
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():  # interleaved, so drifting machine load hits all alike
                t = time.perf_counter()
                for box in subset:
                    fn(box)
                times[name].append((time.perf_counter() - t) / len(subset) * 1e6)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"  {label + f' ({len(subset)})':<34}" + "".join(f"{med[name]:>22,.0f}" for name in fns))


if __name__ == "__main__":
    main()
