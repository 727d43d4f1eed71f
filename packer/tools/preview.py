"""Look before training: a contact sheet of records (optionally the exact training crops), one record.

Both go through ShardDataset, so what you see is what the model gets: orientation, crops and flips.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

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
    """Write a grid of ``n`` records captioned ``index class``; returns the grid's (columns, rows)."""
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
        image = ds[i][0]
        thumb = _to_pil(image)
        thumb.thumbnail((CELL - 4, CELL - 4), Image.Resampling.BILINEAR)
        x, y = (k % cols) * CELL, (k // cols) * (CELL + CAPTION)
        sheet.paste(thumb, (x + (CELL - thumb.width) // 2, y + (CELL - thumb.height) // 2))
        draw.text((x + 3, y + CELL), f"{i} {ds.label_name(i)}"[:26], fill=(235, 235, 235))
    sheet.save(dest, quality=90)
    return cols, rows


def show(out: str | os.PathLike, index: int, dest: Optional[str | os.PathLike]) -> tuple[str, str, tuple[int, int]]:
    """Write record ``index`` as stored (upright, short edge 320); returns (source, class, (w, h))."""
    ds = _dataset(out, augment=False, seed=0, crop_size=0)
    image = ds[index][0]
    pil = _to_pil(image)
    if dest is not None:
        pil.save(Path(dest), quality=95)
    return ds.source(index), ds.label_name(index), pil.size
