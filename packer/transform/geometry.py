"""Crop boxes: the crop policy (train RandomResizedCrop + flip, eval resize + center crop) drawn for a
whole batch at once, and the box's place in a DCT-scaled decode."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from .draws import DRAWS, uniforms

#: DCT scales tried when a crop will be downscaled by 2x or more. Powers of two only: libjpeg-turbo
#: has SIMD reduced-size IDCTs for them (7/8, 3/4 and 5/8 measured slower than a full decode:
#: docs/PERFORMANCE.md, "What changed"), and Pillow's draft() (the fallback decoder) offers only these.
DCT_SCALES = ((1, 8), (1, 4), (1, 2))


class Crop(NamedTuple):
    """A crop box in stored-image pixels (integers, so raw records slice without resampling) + flip."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def random_resized_crops(
    u: np.ndarray,
    heights: np.ndarray,
    widths: np.ndarray,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
    """torchvision's RandomResizedCrop.get_params for a batch: 10 tries from ``u[:, :40]``, then a
    center crop clamped to ``ratio``. Returns int64 rows (top, left, height, width)."""
    H = np.asarray(heights, dtype=np.float64)[:, None]
    W = np.asarray(widths, dtype=np.float64)[:, None]
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = H * W * (scale[0] + (scale[1] - scale[0]) * u[:, 0:40:4])
    aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 1:40:4])
    w = np.rint(np.sqrt(target * aspect))
    h = np.rint(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    rows = np.arange(len(u))
    first = ok.argmax(axis=1)
    h, w, H, W = h[rows, first], w[rows, first], H[:, 0], W[:, 0]
    top = np.floor(u[rows, 4 * first + 2] * (H - h + 1))
    left = np.floor(u[rows, 4 * first + 3] * (W - w + 1))
    # no try fits: the whole image, cropped to the nearest allowed aspect ratio, centred
    in_ratio = W / H
    fh = np.where(in_ratio < min(ratio), np.rint(W / min(ratio)), H)
    fw = np.where(in_ratio > max(ratio), np.rint(H * max(ratio)), W)
    fallback = ~ok.any(axis=1)
    h, w = np.where(fallback, fh, h), np.where(fallback, fw, w)
    top = np.where(fallback, (H - h) // 2, top)
    left = np.where(fallback, (W - w) // 2, left)
    return np.stack([top, left, h, w], axis=1).astype(np.int64)


def center_crops(heights: np.ndarray, widths: np.ndarray, crop_size: int, eval_ratio: float) -> np.ndarray:
    """Resize-short-edge-to ``crop_size / eval_ratio`` then center-crop, as one source box per image."""
    H, W = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    resized_short = int(crop_size / eval_ratio)
    side = np.minimum(np.rint(crop_size * np.minimum(H, W) / resized_short).astype(np.int64), np.minimum(H, W))
    return np.stack([(H - side) // 2, (W - side) // 2, side, side], axis=1)


@dataclass(frozen=True)
class Augment:
    """The crop policy: train = RandomResizedCrop + flip, eval = resize + center crop."""

    crop_size: int
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_ratio: float = 0.875
    flip: bool = True

    def crops(
        self, seed: int, epoch: int | np.ndarray, indices: Sequence[int], heights: np.ndarray, widths: np.ndarray
    ) -> list[Crop]:
        """The crop of each of ``indices`` (stored sizes ``heights`` x ``widths``) in ``epoch`` (one
        value, or one per sample)."""
        if not self.train:
            boxes = center_crops(heights, widths, self.crop_size, self.eval_ratio)
            flips = np.zeros(len(indices), dtype=bool)
        else:
            u = uniforms(seed, epoch, np.asarray(indices), DRAWS)
            boxes = random_resized_crops(u, heights, widths, self.scale, self.ratio)
            flips = (u[:, 40] < 0.5) & self.flip
        return [Crop(top, left, h, w, bool(f)) for (top, left, h, w), f in zip(boxes.tolist(), flips)]


def dct_scale(crop: Crop, size: int) -> Optional[tuple[int, int]]:
    """The smallest power-of-two DCT scale keeping the crop >= ``size`` in both dimensions, if any."""
    for num, den in DCT_SCALES:
        if crop.height * num >= size * den and crop.width * num >= size * den:
            return num, den
    return None


def crop_box(crop: Crop, factor: Optional[tuple[int, int]]) -> tuple[int, int, int, int]:
    """The crop box (stored-image pixels) as (top, left, bottom, right) in an image decoded at ``factor``."""
    num, den = factor or (1, 1)
    return (
        crop.top * num // den,
        crop.left * num // den,
        -(-(crop.top + crop.height) * num // den),
        -(-(crop.left + crop.width) * num // den),
    )
