"""A record's fields through the crop its image gets: boxes mapped, clipped and dropped below a
visible share, masks sampled nearest-neighbour on the very geometry of the image's resize (the crop
box as decoded, a reduced DCT scale's rounding included), so that a box bounds its object's pixels
in the returned crop and a mask lines up with them pixel for pixel. Boxes are moved in one
vectorised pass over a whole batch's: no per-box (nor per-sample) numpy work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import DatasetError
from ..format.fields import BOX_RULE, Field, bad_box, nearest
from ..format.records import FORMATS
from .geometry import Crop, crop_box, dct_scale

#: (top, left, height, width) in stored-image pixels, fractions allowed.
Region = tuple[float, float, float, float]


def image_region(crop: Crop, fmt: str, size: int) -> Region:
    """The part of the stored image that the crop's resize maps onto the ``size`` x ``size`` output:
    the crop itself, or for a JPEG decoded at a reduced DCT scale, the crop box rounded out to whole
    pixels of that scale (as :func:`packer.transform.crop.crop_into` decodes it)."""
    if not FORMATS[fmt].compressed:
        return float(crop.top), float(crop.left), float(crop.height), float(crop.width)
    factor = dct_scale(crop, size)
    num, den = factor or (1, 1)
    top, left, bottom, right = crop_box(crop, factor)
    k = den / num
    return top * k, left * k, (bottom - top) * k, (right - left) * k


def move_boxes(
    boxes: Sequence[np.ndarray],
    regions: np.ndarray,
    flips: Sequence[bool],
    size: int,
    min_visible: float,
    name: str = "boxes",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's ``boxes`` (N x 4, x0 y0 x1 y1, stored pixels) in the ``size`` x ``size`` output
    of its ``regions`` row (B x 4: top, left, height, width), mirrored where ``flips``, clipped to
    it, keeping those with some area left in the output and at least ``min_visible`` of their own
    area in it (the rest are dropped, with their labels). Returns the kept boxes of the whole batch
    (M x 4, sample after sample), how many each sample keeps (B) and which of the batch's boxes,
    concatenated, are kept. One pass over the whole batch's boxes: no per-sample numpy calls.
    Checked first (:func:`check_boxes`, ``name``: the field's): inverted both ways, a box would
    keep a positive area."""
    counts = [len(b) for b in boxes]
    every = np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)
    at = np.repeat(np.arange(len(counts)), counts)
    check_boxes(every, at, name)
    top, left, height, width = np.asarray(regions, np.float32)[at].T[:, :, None]
    x = (every[:, 0::2] - left) * (np.float32(size) / width)  # N x (x0, x1)
    y = (every[:, 1::2] - top) * (np.float32(size) / height)
    flip = np.asarray(flips, bool)[at]
    x[flip] = np.float32(size) - x[flip][:, ::-1]
    area = (x[:, 1] - x[:, 0]) * (y[:, 1] - y[:, 0])
    for a in (x, y):  # ufuncs with out=: a tenth of np.clip's overhead
        np.minimum(np.maximum(a, 0, out=a), size, out=a)
    seen = (x[:, 1] - x[:, 0]) * (y[:, 1] - y[:, 0])
    keep = (seen > 0) & (seen >= min_visible * area)
    out = np.empty((len(every), 4), np.float32)
    out[:, 0::2], out[:, 1::2] = x, y
    return out[keep], np.bincount(at[keep], minlength=len(counts)), keep


def check_boxes(every: np.ndarray, at: np.ndarray, name: str = "boxes") -> None:
    """DatasetError (``record``: the sample's place in the batch) unless the batch's boxes (``at``:
    each one's sample) are all finite with x0 <= x1 and y0 <= y1, as the writer stored them: a
    damaged or hostile record's, CRCs matching. Once a batch (two reductions over all its boxes),
    not per sample."""
    k = bad_box(every)
    if k is not None:
        sample = int(at[k])
        first = int(np.searchsorted(at, sample))
        raise DatasetError(f"{name}: box {k - first} {every[k].tolist()} is not {BOX_RULE}", record=sample)


def whole(fields: Sequence[Field], values: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch's decoded field ``values`` for their whole images: copied out of the records, the
    boxes checked as :func:`cropped` checks them."""
    boxes = next((f.name for f in fields if f.kind == "boxes"), None)
    if boxes is not None and values:
        every = [v[boxes] for v in values]
        check_boxes(np.concatenate(every), np.repeat(np.arange(len(every)), [len(b) for b in every]), boxes)
    return [{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in d.items()} for d in values]


def move_mask(mask: np.ndarray, region: Region, flip: bool, size: int) -> np.ndarray:
    """``mask`` (stored size) over ``region``, nearest-neighbour at ``size`` x ``size``, mirrored when ``flip``."""
    return nearest(mask, region, (size, size), flip)


def tensors(values: dict[str, Any]) -> dict[str, Any]:
    """A sample's field values as torch tensors (text stays str; an array of a dtype torch lacks stays numpy)."""
    out: dict[str, Any] = {}
    for name, v in values.items():
        if isinstance(v, np.ndarray):
            try:
                v = torch.from_numpy(np.ascontiguousarray(v))
            except TypeError:
                pass
        out[name] = v
    return out


def cropped(
    fields: Sequence[Field],
    values: Sequence[dict[str, Any]],
    crops: Sequence[Crop],
    fmt: str,
    size: int,
    min_visible: float,
) -> list[dict[str, Any]]:
    """A batch's decoded field ``values`` through ``crops`` (their images', into ``size`` x ``size``)."""
    regions = [image_region(crop, fmt, size) for crop in crops]
    out = [dict(v) for v in values]
    boxes = next((f.name for f in fields if f.kind == "boxes"), None)
    if boxes is not None and out:
        kept, counts, keep = move_boxes(
            [v[boxes] for v in values], np.array(regions), [c.flip for c in crops], size, min_visible, boxes
        )
        # Each sample's boxes and labels are views of one batch tensor, split once (no per-sample
        # numpy work); a DataLoader worker sends each list by value, its bytes joined
        # (packer.read.batchpool.InlineList), not a shared-memory segment per sample or per list
        # (which cost more than all the rest of the fields' work: docs/PERFORMANCE.md, "Fields").
        sizes = counts.tolist()
        for v, b in zip(out, torch.from_numpy(kept).split(sizes)):
            v[boxes] = b
        labels = next((f.name for f in fields if f.kind == "box_labels"), None)
        if labels is not None:
            every = np.concatenate([v[labels] for v in values])[keep]
            for v, b in zip(out, torch.from_numpy(every).split(sizes)):
                v[labels] = b
    masks = [f.name for f in fields if f.kind == "mask"]
    for v, region, crop in zip(out, regions, crops):
        for name in masks:
            v[name] = move_mask(v[name], region, crop.flip, size)
    return out
