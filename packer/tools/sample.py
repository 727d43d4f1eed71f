"""Synthetic camera-like JPEG folders, so packer can be exercised and benchmarked with no download.

Real camera files matter to packing in three ways that flat test images miss: they are big (12 MP,
a few MB each at high quality, so decode and resize dominate), they carry EXIF orientation (so the
stored pixels are often sideways or mirrored relative to the scene), and their content is
photo-like (smooth regions plus sensor noise, which sets the compressed size). This module produces
all three, quickly, in the ImageFolder layout ``out_dir/<class>/IMG_0001.jpg``.

Each picture is rendered upright at low resolution with numpy (a class-specific hue and shape, so
a tiny CNN can tell the classes apart), then the inverse of its EXIF orientation is applied - as a
camera does, storing sensor-aligned pixels and a tag - and only then upscaled with Pillow's bicubic
resize to full size, which keeps the per-pixel work in C. Sensor-like noise comes from one small
multi-scale noise patch tiled over the frame and added with ``ImageChops.add``. Everything is
seeded, and EXIF timestamps are derived from the seed, so a given seed yields identical bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops

__all__ = ["INVERSE_ORIENTATION", "main", "make_sample", "render_photo"]

# Pillow's ImageOps.exif_transpose maps tag -> transpose that makes the stored pixels upright.
# A camera stores the inverse of that transform applied to the upright scene; flips, 180 and the
# (anti)diagonal transposes are their own inverse, while the two quarter turns swap.
_T = Image.Transpose
INVERSE_ORIENTATION: dict[int, _T | None] = {
    1: None,
    2: _T.FLIP_LEFT_RIGHT,
    3: _T.ROTATE_180,
    4: _T.FLIP_TOP_BOTTOM,
    5: _T.TRANSPOSE,
    6: _T.ROTATE_90,  # exif_transpose applies ROTATE_270
    7: _T.TRANSVERSE,
    8: _T.ROTATE_270,  # exif_transpose applies ROTATE_90
}

# Per-class base hue in degrees; classes beyond this list get evenly spread hues.
_HUES = {"cat": 28.0, "dog": 110.0, "ship": 215.0}
_LOW_RES = 160  # long side of the numpy-rendered scene; content above this is only noise
_PATCH = 512  # side of the tiled noise patch


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Vectorised HSV (h in [0,1)) -> RGB float in [0,1], so hues can be jittered per pixel."""
    i = np.floor(h * 6.0).astype(np.int64) % 6
    f = h * 6.0 - np.floor(h * 6.0)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    r = np.choose(i, [v, q, p, p, t, v])
    g = np.choose(i, [t, v, v, q, p, p])
    b = np.choose(i, [p, p, t, v, v, q])
    return np.stack([r, g, b], axis=-1)


def _scene(rng: np.random.Generator, class_index: int, hue: float, w: int, h: int) -> np.ndarray:
    """Upright low-resolution scene (h, w, 3) uint8: lit gradient sky/ground plus class shapes.

    The layout is asymmetric (sky above, light from one side) so that a wrong orientation
    transform is visible, and the shape family depends on the class so classes are learnable.
    """
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    yn, xn = y / max(h - 1, 1), x / max(w - 1, 1)
    base = hue / 360.0 + rng.normal(0, 0.02)
    # Background: brighter at the top (sky), a side light, and a couple of soft low-freq blobs.
    hmap = base + 0.06 * np.sin(2 * np.pi * (xn * rng.uniform(0.5, 1.5) + rng.uniform()))
    smap = 0.35 + 0.25 * yn
    vmap = 0.85 - 0.45 * yn + 0.12 * (xn - 0.5) * rng.choice([-1.0, 1.0])
    for _ in range(3):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0.3, 1), rng.uniform(0.1, 0.35)
        vmap -= 0.15 * np.exp(-((xn - cx) ** 2 + (yn - cy) ** 2) / (2 * r * r))
    # Foreground: class-specific shapes with soft edges, in a saturated variant of the hue.
    fg = np.zeros_like(xn)
    s = min(w, h)
    kind = class_index % 3
    for _ in range(int(rng.integers(2, 5))):
        cx, cy = rng.uniform(0.2, 0.8) * w, rng.uniform(0.35, 0.85) * h
        size = rng.uniform(0.12, 0.28) * s
        if kind == 0:  # round blobs
            d = np.hypot(x - cx, (y - cy) * rng.uniform(0.8, 1.3)) - size
        elif kind == 1:  # upright boxes
            d = np.maximum(np.abs(x - cx) - 0.5 * size, np.abs(y - cy) - size)
        else:  # flat hulls with a mast-like triangle above
            hull = np.maximum(np.abs(x - cx) - 1.5 * size, np.abs(y - cy) - 0.3 * size)
            sail = np.maximum(y - (cy - 0.3 * size), np.abs(x - cx) - (y - (cy - 2 * size)) * 0.4)
            d = np.minimum(hull, np.maximum(sail, cy - 2 * size - y))
        fg = np.maximum(fg, np.clip(0.5 - d / (0.04 * s + 1), 0.0, 1.0))
    hmap = (hmap + fg * rng.uniform(-0.03, 0.03)) % 1.0
    smap = smap * (1 - fg) + fg * rng.uniform(0.75, 0.95)
    vmap = vmap * (1 - fg) + fg * (rng.uniform(0.45, 0.8) - 0.2 * yn)
    rgb = _hsv_to_rgb(hmap, np.clip(smap, 0, 1), np.clip(vmap, 0.02, 1))
    return (rgb * 255.0 + 0.5).astype(np.uint8)


def _noise_patch(rng: np.random.Generator) -> np.ndarray:
    """Square (P, P, 3) uint8 sensor-noise patch centred on 128: fine grain plus mid-frequency
    texture, mostly luma. Its amplitude is what lands a q92 12 MP file in the 2-5 MB range."""
    fine = rng.normal(0.0, 3.0, (_PATCH, _PATCH))
    mid = rng.normal(0.0, 4.0, (_PATCH // 4, _PATCH // 4))
    mid_img = Image.fromarray(np.clip(mid + 128, 0, 255).astype(np.uint8)).resize(
        (_PATCH, _PATCH), Image.Resampling.BICUBIC
    )
    luma = fine + (np.asarray(mid_img, dtype=np.float64) - 128.0)
    chroma = rng.normal(0.0, 1.0, (_PATCH, _PATCH, 3))
    return np.clip(luma[..., None] + chroma + 128.5, 0, 255).astype(np.uint8)


def render_photo(
    class_index: int,
    *,
    hue: float | None = None,
    portrait: bool,
    size: tuple[int, int] = (4000, 3000),
    orientation: int = 1,
    seed: int | Sequence[int] = 0,
) -> Image.Image:
    """Stored (sensor-aligned) RGB pixels of one synthetic photo.

    ``size`` is the landscape (W, H); a portrait scene is (H, W) upright. The returned image is
    the upright scene with the inverse of ``orientation`` applied, so
    ``ImageOps.exif_transpose`` with that tag recovers the scene. The transform happens at low
    resolution, before upscaling, because transposing 12 MP costs more than the whole render.
    """
    if orientation not in INVERSE_ORIENTATION:
        raise ValueError(f"EXIF orientation must be 1..8, got {orientation}")
    rng = np.random.default_rng(seed)
    lw, lh = size
    up_w, up_h = (lh, lw) if portrait else (lw, lh)
    scale = _LOW_RES / max(up_w, up_h)
    sw, sh = max(2, round(up_w * scale)), max(2, round(up_h * scale))
    if hue is None:
        hue = (class_index * 137.5) % 360.0
    small = Image.fromarray(_scene(rng, class_index, hue, sw, sh))
    inverse = INVERSE_ORIENTATION[orientation]
    if inverse is not None:
        small = small.transpose(inverse)
    out_w, out_h = (up_h, up_w) if orientation >= 5 else (up_w, up_h)
    img = small.resize((out_w, out_h), Image.Resampling.BICUBIC)
    # Tile a noise patch (random phase per image) over the frame: sensor noise is in stored
    # coordinates anyway, and tiling keeps the cost to one memory copy.
    patch = np.roll(_noise_patch(rng), tuple(rng.integers(0, _PATCH, 2)), axis=(0, 1))
    reps = (-(-out_h // _PATCH), -(-out_w // _PATCH), 1)
    noise = np.tile(patch, reps)[:out_h, :out_w]
    return ImageChops.add(img, Image.fromarray(noise), scale=1.0, offset=-128)


def _exif(orientation: int, index: int, seed: int) -> Image.Exif:
    """Camera-style EXIF: orientation plus Make/Model and seed-derived (so stable) timestamps."""
    exif = Image.Exif()
    exif[0x010F] = "PackerCam"  # Make
    exif[0x0110] = "Synthetic 12MP"  # Model
    secs = (seed * 86_400 + index * 37) % (28 * 86_400)
    day, hh, mm, ss = 1 + secs // 86_400, secs // 3600 % 24, secs // 60 % 60, secs % 60
    stamp = f"2023:05:{day:02d} {hh:02d}:{mm:02d}:{ss:02d}"
    exif[0x0132] = stamp  # DateTime
    exif[0x0112] = orientation  # Orientation
    exif.get_ifd(0x8769)[0x9003] = stamp  # ExifIFD DateTimeOriginal
    return exif


def make_sample(
    out_dir: str | Path,
    *,
    classes: Sequence[str] = ("cat", "dog", "ship"),
    per_class: int = 4,
    size: tuple[int, int] = (4000, 3000),
    seed: int = 0,
    quality: int = 92,
) -> list[Path]:
    """Write ``per_class`` camera-like JPEGs per class under ``out_dir/<class>/IMG_NNNN.jpg``.

    EXIF orientation cycles 1..8 over all files in order, and every other picture in a class is
    an upright portrait, so readers must honour the tag to get the right aspect. Files are
    numbered globally (like a camera roll) and the output is byte-identical for a given seed.
    Returns the written paths in order.
    """
    out = Path(out_dir)
    paths: list[Path] = []
    n = 0
    for ci, name in enumerate(classes):
        hue = _HUES.get(name, (360.0 * ci / max(len(classes), 1) + 60.0) % 360.0)
        cls_dir = out / name
        cls_dir.mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            orientation = n % 8 + 1
            img = render_photo(
                ci,
                hue=hue,
                portrait=k % 2 == 1,
                size=size,
                orientation=orientation,
                seed=(seed, ci, k),
            )
            path = cls_dir / f"IMG_{n + 1:04d}.jpg"
            img.save(path, "JPEG", quality=quality, exif=_exif(orientation, n, seed).tobytes())
            paths.append(path)
            n += 1
    return paths


def _one_class(out_dir: str, cls: str, per: int, size: tuple[int, int], seed: int) -> list[Path]:
    return make_sample(out_dir, classes=(cls,), per_class=per, size=size, seed=seed)


def make_folder(
    out_dir: str | Path,
    n: int,
    size: tuple[int, int] = (4000, 3000),
    workers: int = 1,
    classes: Sequence[str] = ("a", "b", "c", "d"),
) -> list[Path]:
    """Exactly ``n`` photos over ``classes``, generated by ``workers`` processes (one class each).

    Benchmarks cache the folder across runs: one that already holds exactly ``n`` photos is reused.
    """
    import multiprocessing as mp
    import shutil

    out_dir = Path(out_dir)
    files = sorted(out_dir.rglob("*.jpg"))
    if len(files) == n:
        return files
    shutil.rmtree(out_dir, ignore_errors=True)
    per = -(-n // len(classes))
    with mp.get_context("fork").Pool(workers) as pool:
        pool.starmap(_one_class, [(str(out_dir), c, per, size, i) for i, c in enumerate(classes)])
    for extra in sorted(out_dir.rglob("*.jpg"))[n:]:
        extra.unlink()
    return sorted(out_dir.rglob("*.jpg"))


def _parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m packer.tools.sample OUT [--per-class N] [--size WxH] [--seed S]``."""
    ap = argparse.ArgumentParser(prog="python -m packer.tools.sample", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--per-class", type=int, default=4)
    ap.add_argument("--size", type=_parse_size, default=(4000, 3000), help="landscape WxH")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = make_sample(args.out, per_class=args.per_class, size=args.size, seed=args.seed)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} images ({total / 1e6:.1f} MB) under {args.out}")


if __name__ == "__main__":
    main()
