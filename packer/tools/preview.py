"""Look before training: a contact sheet of records (optionally the exact training crops), one record.

Both go through ShardDataset, so what you see is what the model gets: orientation, crops and flips,
and a dataset's boxes and masks drawn on them where it has fields.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image, ImageDraw

from ..format import DatasetError

CELL = 160  # thumbnail box, pixels
CAPTION = 14  # caption strip under each thumbnail


def _dataset(out: str | os.PathLike, augment: bool, seed: int, crop_size: int):
    import torch

    from ..read.dataset import ShardDataset

    if augment:
        return ShardDataset(out, crop_size=crop_size, train=True, seed=seed, dtype=torch.uint8)
    return ShardDataset(out, crop_size=None, dtype=torch.uint8)


def _to_pil(chw) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(chw.permute(1, 2, 0).numpy()), "RGB")


#: Overlay colours by id (a mask's value, a box's label), cycling.
_PALETTE = np.array(
    [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240)],
    np.uint8,
)


def drawn(sample: Any, fields: dict[str, Any]) -> Image.Image:
    """A sample's image as Pillow's, with its ``fields`` (ShardDataset.fields) drawn where it has
    them: each mask's non-zero ids tinted by id, each box outlined in its label's colour."""
    if not fields:
        return _to_pil(sample[0])
    kinds: dict[str, list[str]] = {}
    for name, f in fields.items():
        kinds.setdefault(f.kind, []).append(name)
    pixels = np.ascontiguousarray(sample["image"].permute(1, 2, 0).numpy()).copy()
    for name in kinds.get("mask", []):
        ids = sample[name].numpy()
        on = ids > 0
        pixels[on] = pixels[on] // 2 + _PALETTE[ids[on].astype(np.int64) % len(_PALETTE)] // 2
    pil = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(pil)
    for name in kinds.get("boxes", []):
        labels = [sample[n].tolist() for n in kinds.get("box_labels", [])]
        for k, box in enumerate(sample[name].tolist()):
            colour = _PALETTE[labels[0][k] % len(_PALETTE)] if labels else _PALETTE[0]
            draw.rectangle(box, outline=tuple(int(c) for c in colour), width=2)
    return pil


def caption(ds: Any, i: int, sample: Any) -> str:
    """What a record is: its class (or classes); for an unlabeled dataset with box labels (a
    ``--coco`` one), the categories of the boxes shown, by name where the field names its ids
    (``cat x2, dog``); else "unlabeled"."""
    labels = next((f for f in ds.fields.values() if f.kind == "box_labels"), None)
    if ds.label_kind != "none" or labels is None:
        return ds.label_name(i)
    ids, counts = np.unique(np.asarray(sample[labels.name], np.int64), return_counts=True)
    names = labels.classes
    named = [
        (names[k] if 0 <= k < len(names) and names[k] else str(k)) + (f" x{n}" if n > 1 else "")
        for k, n in zip(ids.tolist(), counts.tolist())
    ]
    return ", ".join(named) or "no boxes"


def pick(count: int, n: int, seed: int) -> list[int]:
    """``n`` distinct record indices, sorted, chosen reproducibly from ``seed``."""
    n = min(n, count)
    return sorted(np.random.default_rng(seed).choice(count, size=n, replace=False).tolist())


def contact_sheet(
    out: str | os.PathLike,
    dest: str | os.PathLike,
    n: int = 64,
    augment: bool = False,
    seed: int = 0,
    crop_size: int = 224,
    epoch: int = 0,
) -> tuple[int, int]:
    """Write a grid of ``n`` records captioned ``index`` and :func:`caption`; returns the grid's
    (columns, rows). A damaged record is a DatasetError naming it."""
    ds = _dataset(out, augment, seed, crop_size)
    ds.set_epoch(epoch)
    indices = pick(len(ds), n, seed)
    if not indices:
        raise DatasetError(f"{out}: the dataset is empty: nothing to preview")
    cols = math.ceil(math.sqrt(len(indices)))
    rows = math.ceil(len(indices) / cols)
    sheet = Image.new("RGB", (cols * CELL, rows * (CELL + CAPTION)), (32, 32, 32))
    draw = ImageDraw.Draw(sheet)
    for k, i in enumerate(indices):
        sample = ds[i]
        thumb = drawn(sample, ds.fields)
        thumb.thumbnail((CELL - 4, CELL - 4), Image.Resampling.BILINEAR)
        x, y = (k % cols) * CELL, (k // cols) * (CELL + CAPTION)
        sheet.paste(thumb, (x + (CELL - thumb.width) // 2, y + (CELL - thumb.height) // 2))
        draw.text((x + 3, y + CELL), f"{i} {caption(ds, i, sample)}"[:26], fill=(235, 235, 235))
    sheet.save(dest, quality=90)
    return cols, rows


def show(out: str | os.PathLike, index: int, dest: Optional[str | os.PathLike]) -> tuple[str, str, tuple[int, int]]:
    """Write record ``index`` as stored (upright, short edge 320); returns (source, what it is:
    :func:`caption`, (w, h)). A damaged record is a DatasetError naming it."""
    ds = _dataset(out, augment=False, seed=0, crop_size=0)
    sample = ds[index]
    pil = drawn(sample, ds.fields)
    if dest is not None:
        pil.save(Path(dest), quality=95)
    return ds.source(index), caption(ds, index, sample), pil.size
