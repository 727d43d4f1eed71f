"""``packer build images/ out --coco instances.json``: a COCO detection or instance-segmentation set
packed with the Writer (packer.builder.writer): per image its boxes, their category ids and one
segmentation map (each instance's polygons or RLE drawn in its category id, later annotations over
earlier ones), the category names recorded with the fields.

The annotations file is checked as it is read: anything that is not what COCO's format says (a box
that is not four finite numbers, an RLE whose runs do not cover its image) makes its image a
reported skip, never a crash; a file that is not COCO at all is a BuildError.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from ..errors import BuildError
from .options import BuildOptions
from .staging import BuildReport, OptionNames
from .writer import pack

#: The fields a COCO build writes (box label ids are COCO's category ids; their names ride on the
#: box_labels and mask fields, id i at position i).
COCO_FIELDS = ("boxes", "box_labels", "mask")


def rle_counts(counts: Any) -> list[int]:
    """The run lengths of a COCO RLE: a list of ints, or the compressed string of pycocotools
    (6-bit groups from character 48, 5 bits each, continuation bit 0x20, sign bit 0x10 on the
    last; from the fourth run on, a delta on the run two before, as pycocotools' rleFrString)."""
    if isinstance(counts, list):
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError("RLE counts: not non-negative integers")
        return counts
    if not isinstance(counts, str):
        raise ValueError(f"RLE counts: a list or a string, not {type(counts).__name__}")
    runs: list[int] = []
    p = 0
    while p < len(counts):
        x = k = 0
        more = True
        while more:
            if p >= len(counts):
                raise ValueError("RLE counts: the string ends inside a number")
            c = ord(counts[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"RLE counts: character {counts[p]!r} is not one of its alphabet")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p, k = p + 1, k + 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(runs) > 2:
            x += runs[-2]
        if x < 0:
            raise ValueError("RLE counts: a negative run")
        runs.append(x)
    return runs


def rle_mask(segmentation: dict[str, Any], height: int, width: int) -> np.ndarray:
    """A COCO RLE (``{"counts", "size": [h, w]}``; runs of 0s then 1s in column-major order) as a
    bool H x W array; ValueError unless its runs cover exactly its size, which is the image's."""
    size = segmentation.get("size")
    if size != [height, width]:
        raise ValueError(f"RLE size {size}, the image is {height} x {width}")
    runs = rle_counts(segmentation.get("counts"))
    if sum(runs) != height * width:  # before anything of that size is made
        raise ValueError(f"RLE runs cover {sum(runs)} pixels, the image has {height * width}")
    flat = np.repeat(np.arange(len(runs), dtype=np.uint8) % 2, runs).astype(bool)
    return flat.reshape(width, height).T


def _polygons(segmentation: list[Any]) -> list[list[float]]:
    for poly in segmentation:
        if not (
            isinstance(poly, list)
            and len(poly) >= 6
            and len(poly) % 2 == 0
            and all(isinstance(v, (int, float)) and np.isfinite(v) for v in poly)
        ):
            raise ValueError("a polygon is not x, y pairs (at least three points)")
    return segmentation


def _sample(images: Path, entry: dict[str, Any], annotations: list[dict[str, Any]]) -> dict[str, Any]:
    """One image's sample; ValueError for an annotation that is not COCO's (its image is skipped)."""
    height, width = entry.get("height"), entry.get("width")
    if not all(isinstance(v, int) and 0 < v < 1 << 20 for v in (height, width)):
        raise ValueError(f"image size {width} x {height} is not two positive integers")
    assert isinstance(height, int) and isinstance(width, int)
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    boxes, labels = [], []
    for a in annotations:
        box, category = a.get("bbox"), a.get("category_id")
        if not (
            isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and np.isfinite(v) for v in box)
        ):
            raise ValueError(f"annotation {a.get('id')}: bbox {box!r} is not [x, y, width, height]")
        if not isinstance(category, int) or not 0 < category < 256:
            raise ValueError(f"annotation {a.get('id')}: category_id {category!r} is not 1..255 (a mask byte)")
        x, y, w, h = box
        boxes.append([x, y, x + w, y + h])
        labels.append(category)
        seg = a.get("segmentation")
        if isinstance(seg, list):
            for poly in _polygons(seg):
                draw.polygon([(poly[i], poly[i + 1]) for i in range(0, len(poly), 2)], fill=category)
        elif isinstance(seg, dict):
            mask.paste(category, mask=Image.fromarray(rle_mask(seg, height, width).astype(np.uint8) * 255))
        elif seg is not None:
            raise ValueError(f"annotation {a.get('id')}: segmentation is neither polygons nor RLE")
    return {
        "image": images / str(entry["file_name"]),
        "boxes": np.array(boxes, np.float64).reshape(-1, 4),
        "box_labels": np.array(labels, np.int64),
        "mask": np.asarray(mask),
        "source": str(entry["file_name"]),
    }


def load_coco(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[Any, list[dict[str, Any]]], list[str]]:
    """The images, the annotations by image id, and the category names by id (position = COCO's
    category id, "" for ids without a category) of the COCO annotations file ``path``."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise BuildError(f"{path}: unreadable COCO annotations ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise BuildError(f"{path}: not COCO annotations (no 'images' list)")
    images = [e for e in data["images"] if isinstance(e, dict) and isinstance(e.get("file_name"), str)]
    if len(images) != len(data["images"]):
        raise BuildError(f"{path}: an 'images' entry without a file_name")
    by_image: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for a in data.get("annotations", []):
        if isinstance(a, dict):
            by_image[a.get("image_id")].append(a)
    names: dict[int, str] = {}
    for c in data.get("categories", []):
        if not (isinstance(c, dict) and isinstance(c.get("id"), int) and 0 < c["id"] < 256):
            raise BuildError(f"{path}: category {c!r} has no id in 1..255")
        names[c["id"]] = str(c.get("name", ""))
    classes = [names.get(i, "") for i in range(max(names, default=0) + 1)]
    return images, by_image, classes


def build_coco(
    images: str | os.PathLike, out: str | os.PathLike, options: BuildOptions, quiet: bool, *, names: OptionNames
) -> BuildReport:
    """Pack the images ``options.coco`` lists (files under ``images``) with their annotations into
    ``out``; ``names``: how messages name the options (the caller's: CLI flags or packer.build's keywords)."""
    assert options.coco is not None, "a --coco build"
    listed, by_image, classes = load_coco(options.coco)
    fields = {name: {"kind": name, "classes": classes if name != "boxes" else ()} for name in COCO_FIELDS}
    samples = _samples(Path(images), listed, by_image)
    return pack(samples, out, fields=fields, options=options.but(coco=None), quiet=quiet, names=names)


def _samples(
    images: Path, listed: list[dict[str, Any]], by_image: dict[Any, list[dict[str, Any]]]
) -> Iterator[dict[str, Any]]:
    """Each listed image's sample, or for one whose annotations are not COCO's a skip saying why."""
    for entry in listed:
        try:
            yield _sample(images, entry, by_image.get(entry.get("id"), []))
        except ValueError as e:
            yield {"source": str(entry["file_name"]), "skip": str(e)}
