"""Every setting of :class:`~packer.read.dataset.ShardDataset` in one place: :class:`ReadOptions`.

Each field carries its default, the text of its row in docs/DATASET.md's table of ShardDataset's
arguments (tests/test_read_options.py checks the table and ShardDataset's signature against the
fields) and its check, so a new read setting is written once. ShardDataset makes one from its
arguments, so a bad value is refused in one line before anything is opened; the per-sample code then
reads plain attributes, never this object.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from ..transform import IMAGENET_MEAN, IMAGENET_STD, Augment
from . import resolution
from .remote import parse_limit
from .resolution import CropSize

#: ``transform(image) -> tensor`` per sample; ``batch_transform(images, labels) -> (images, labels)``,
#: on a dataset with fields ``batch_transform(images, fields) -> (images, fields)`` (fields: a dict).
Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]
BatchTransform = Optional[Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]]


def _setting(default: Any, doc: str, check: Optional[Callable[[Any], bool]] = None, must: str = "", **meta: Any) -> Any:
    """A field with its docs row (``doc``; ``shown``: the default as the table says it, if not its
    value; ``keyword``: a keyword-only argument of ShardDataset) and its check: a value ``check``
    refuses is a ValueError saying what it ``must`` be."""
    return field(default=default, metadata={"doc": doc, "check": check, "must": must, **meta})


def _pair(v: Any, bound: Optional[float] = None) -> bool:
    """(low, high) with 0 < low <= high (< ``bound``)."""
    return len(v) == 2 and 0 < v[0] <= v[1] and (bound is None or v[1] < bound)


def _callable(v: Any) -> bool:
    return v is None or callable(v)


def _crop_size(v: Any) -> bool:
    """None, a positive side, or a schedule whose epoch 0 gives one (its own ValueError if not)."""
    if callable(v):
        return resolution.side(v, 0) > 0
    return v is None or v > 0


def _limit(v: Any) -> bool:
    parse_limit(v)  # its own ValueError says what is wrong
    return True


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How a ShardDataset reads; the defaults are ShardDataset's. Invalid values: ValueError."""

    crop_size: CropSize = _setting(
        224,
        "output side; `None` returns the whole stored image (sizes differ: batch_size=1 or your own collate_fn); "
        "a schedule (`Ramp`, `Steps` or a picklable function of the epoch) sets it per epoch (below)",
        _crop_size,
        "positive, None or a schedule (a function of the epoch)",
    )
    train: bool = _setting(
        True,
        "True: RandomResizedCrop (`scale`, `ratio`, torchvision's defaults and algorithm) + horizontal flip "
        "(`flip`). False: resize short edge to `crop_size / eval_ratio` (0.875 -> 256 for 224), center crop",
    )
    seed: int = _setting(0, "with the epoch and the record index, determines every random choice")
    dtype: torch.dtype = _setting(
        torch.float32,
        "`torch.uint8`: raw pixels, no normalization. A float dtype: normalized with `mean`/`std` (ImageNet)",
        lambda v: v == torch.uint8 or v.is_floating_point,
        "torch.uint8 or a floating type",
        shown="float32",
    )
    mean: Sequence[float] = _setting(
        IMAGENET_MEAN,
        "per-channel mean (of pixels scaled to 0..1) a float dtype's batch is normalized with",
        shown="ImageNet's",
    )
    std: Sequence[float] = _setting(
        IMAGENET_STD,
        "per-channel standard deviation (of pixels scaled to 0..1) a float dtype's batch is divided by",
        shown="ImageNet's",
    )
    scale: tuple[float, float] = _setting(
        (0.08, 1.0),
        "`train=True`: the crop's share of the image's area, (low, high)",
        _pair,
        "(low, high) with 0 < low <= high",
    )
    ratio: tuple[float, float] = _setting(
        (3 / 4, 4 / 3),
        "`train=True`: the crop's width / height, (low, high)",
        lambda v: _pair(v, math.inf),
        "(low, high) with 0 < low <= high < inf",
        shown="(3/4, 4/3)",
    )
    eval_ratio: float = _setting(
        0.875,
        "`train=False`: crop size / resized short edge",
        lambda v: 0 < v <= 1,
        "in (0, 1] (crop size / resized short edge)",
    )
    flip: bool = _setting(True, "`train=True`: flip half the crops horizontally")
    verify: Optional[bool] = _setting(
        None,
        "CRC-32 check of each record before use (~1% of a JPEG decode; more than a raw crop costs)",
        shown="jpeg: on, raw: off",
    )
    memory_format: torch.memory_format = _setting(
        torch.channels_last,
        "the batch's memory layout (shape is always B x 3 x H x W); `torch.contiguous_format` costs a "
        "transposing copy per sample",
        lambda v: v in (torch.channels_last, torch.contiguous_format),
        "torch.channels_last or torch.contiguous_format",
        shown="`torch.channels_last`",
    )
    transform: Transform = _setting(
        None,
        "your per-sample augmentation: gets the uint8 crop (C x H x W, channels-last memory; the whole stored "
        "image with `crop_size=None`), returns a tensor; seeded per draw (below)",
        _callable,
        "a callable or None",
    )
    batch_transform: BatchTransform = _setting(
        None,
        "`f(images, labels) -> (images, labels)` on the whole batch (`dtype`; labels as the batch has them: "
        "int64 B, or float32 B x C multi-hot), in the worker; with fields `f(images, fields) -> (images, fields)`, "
        "`fields` the batch's dict less its images",
        _callable,
        "a callable or None",
    )
    cache_dir: Optional[str | os.PathLike] = _setting(
        None,
        "a URL path (`s3://...`, `https://...`): the node-local cache its files are fetched into, shared by "
        'every rank and worker of the node (docs/OBJECT-STORAGE.md, "Reading from a bucket")',
        shown="`$PACKER_CACHE_DIR`, else `~/.cache/packer`",
        keyword=True,
    )
    cache_limit: int | str | None = _setting(
        None,
        'bytes (or "200GB", "1.5GiB") the whole cache may hold, as `du` counts it; units no dataset holds go, '
        "furthest next use first",
        _limit,
        keyword=True,
    )

    box_min_visible: float = _setting(
        0.0,
        "a dataset with boxes: a box whose share of its own area left inside the crop is below this is dropped "
        "with its label (one with no area left always is)",
        lambda v: 0 <= v <= 1,
        "in [0, 1]",
        keyword=True,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            check = f.metadata["check"]
            if check is not None and not check(value):
                raise ValueError(f"{f.name} must be {f.metadata['must']}, not {value!r}")
        if self.batch_transform is not None and self.crop_size is None and self.transform is None:
            raise ValueError("batch_transform needs images of one size: a crop_size or a transform")
        for name in ("mean", "std", "scale", "ratio"):  # any sequence given; kept as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def augment(self, epoch: int = 0) -> Optional[Augment]:
        """The crop policy of ``epoch`` (None with ``crop_size=None``: whole images)."""
        size = self.crop_size
        if size is None:
            return None
        side = resolution.side(size, epoch) if callable(size) else size
        return Augment(side, self.train, self.scale, self.ratio, self.eval_ratio, self.flip)


#: ShardDataset's signature takes its defaults from here (so help() shows them, written once)
DEFAULTS = ReadOptions()
