"""``packer build images/ out --coco instances.json``: a COCO detection or instance-segmentation set
packed with the Writer (packer.builder.writer): per image its boxes, their category ids and one
segmentation map (each instance's polygons or RLE drawn in its category id, later annotations over
earlier ones, polygons rasterised exactly as pycocotools rasterises them), the category names
recorded with the fields.

The annotations file is checked as it is read. Anything that makes one image's annotations wrong (a
box that is not four finite numbers, an RLE whose runs do not cover its image, a size its file does
not have, an id two images share, a file_name outside ``images/``) makes that image a reported skip,
never a crash; the image's own file is measured (its header) before anything of its size is made. A
file that is not COCO at all, or an annotation that belongs to no listed image (its image would be
packed without it), is a BuildError in one line, OUT untouched.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from ..errors import BuildError
from .options import BuildOptions
from .preprocess import PreprocessSpec, stored_size
from .staging import BuildReport, OptionNames
from .writer import pack

#: The fields a COCO build writes (box label ids are COCO's category ids; their names ride on the
#: box_labels and mask fields, id i at position i).
COCO_FIELDS = ("boxes", "box_labels", "mask")

#: The most characters one number of a compressed RLE string takes: 9 x 5 bits hold any run (or
#: difference of runs) of an image under 2**20 x 2**20 pixels, sign included.
RLE_DIGITS = 9

#: How far a polygon may reach, in multiples of its image's width + height: every point within that
#: distance of the origin, its outline no longer. Real annotations lie in or just outside their
#: image; past that a polygon is a hostile file's, whose rasterisation (a walk along the outline,
#: as pycocotools' rleFrPoly walks it) would take as long as its numbers are large.
POLYGON_REACH = 16

#: The most steps one walk of polygons takes at once (its arrays take about 100 bytes a step).
WALK_STEPS = 1 << 18

#: A polygon's pixels: (top, left, a bool array of the box from there).
Mask = tuple[int, int, np.ndarray]

_show = reprlib.Repr()  # a value from the file, as an error message quotes it: short whatever its size
_show.maxlevel, _show.maxstring, _show.maxlong, _show.maxother = 2, 40, 40, 40


def rle_counts(counts: Any) -> list[int]:
    """The run lengths of a COCO RLE: a list of ints, or the compressed string of pycocotools
    (6-bit groups from character 48, 5 bits each, continuation bit 0x20, sign bit 0x10 on the
    last; from the fourth run on, a delta on the run two before, as pycocotools' rleFrString).
    Linear in the string's length: a number longer than :data:`RLE_DIGITS` characters is refused
    before it is summed."""
    if isinstance(counts, list):
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError("RLE counts: not non-negative integers")
        return counts
    if not isinstance(counts, str):
        raise ValueError(f"RLE counts: a list or a string, not {type(counts).__name__}")
    if not counts:
        return []
    codes = np.frombuffer(counts.encode("utf-32-le"), np.uint32).astype(np.int64) - 48
    wrong = np.flatnonzero((codes < 0) | (codes >= 64))
    if len(wrong):
        raise ValueError(f"RLE counts: character {counts[wrong[0]]!r} is not one of its alphabet")
    ends = np.flatnonzero((codes & 0x20) == 0)  # each number's last character
    if len(ends) == 0 or ends[-1] != len(codes) - 1:
        raise ValueError("RLE counts: the string ends inside a number")
    starts = np.concatenate(([0], ends[:-1] + 1))
    digits = ends - starts + 1
    if digits.max() > RLE_DIGITS:
        raise ValueError(f"RLE counts: a number of {digits.max()} characters, longer than any image's run")
    place = np.arange(len(codes)) - np.repeat(starts, digits)  # each character's place in its number
    x = np.add.reduceat((codes & 0x1F) << (5 * place), starts)
    x -= np.where(codes[ends] & 0x10, 1 << (5 * digits), 0)  # negative: x |= -1 << 5k, i.e. x - 2**5k
    deltas = x.tolist()
    runs = deltas.copy()  # runs[i] = deltas[i] + runs[i - 2] from i = 3: two running sums
    runs[1::2] = accumulate(deltas[1::2])
    runs[2::2] = accumulate(deltas[2::2])
    if min(runs) < 0:
        raise ValueError("RLE counts: a negative run")
    return runs


def rle_mask(segmentation: dict[str, Any], height: int, width: int) -> np.ndarray:
    """A COCO RLE (``{"counts", "size": [h, w]}``; runs of 0s then 1s in column-major order) as a
    bool H x W array; ValueError unless its runs cover exactly its size, which is the image's (a
    counts string longer than that many runs can take is refused before it is read)."""
    size = segmentation.get("size")
    if size != [height, width]:
        raise ValueError(f"RLE size {_show.repr(size)}, the image is {height} x {width}")
    counts = segmentation.get("counts")
    if isinstance(counts, str) and len(counts) > RLE_DIGITS * (height * width + 1):
        raise ValueError(f"RLE counts: {len(counts)} characters, more than a {height} x {width} image's runs take")
    runs = rle_counts(counts)
    if sum(runs) != height * width:  # before anything of that size is made
        raise ValueError(f"RLE runs cover {sum(runs)} pixels, the image has {height * width}")
    flat = np.repeat(np.arange(len(runs), dtype=np.uint8) % 2, runs).astype(bool)
    return flat.reshape(width, height).T


def polygon_masks(polygons: Sequence[Sequence[float] | np.ndarray], height: int, width: int) -> list[Mask]:
    """The pixels of COCO polygons (each x, y, x, y, ...) in a ``height`` x ``width`` image, exactly
    as pycocotools' rleFrPoly (common/maskApi.c) rasterises each, so that masks agree with the
    evaluation's: per polygon (top, left, a bool array of the box of pixels from there that it can
    cover). ValueError for a polygon beyond :data:`POLYGON_REACH`.

    rleFrPoly upsamples the points by 5 (C's int cast: toward zero), walks each edge one step of
    the longer axis at a time, keeps the steps that cross a pixel column's centre line (in the
    image), each at the first pixel centre below it, and fills column-major between pairs of such
    boundaries. Here each stage is one numpy operation over all steps of many polygons at once (an
    image's, up to :data:`WALK_STEPS` steps a walk): a polygon costs its steps, not a few dozen calls."""
    if not polygons:
        return []
    corners = np.concatenate([np.asarray(polygon, np.float64) for polygon in polygons]).reshape(-1, 2)
    sizes = np.array([len(polygon) // 2 for polygon in polygons])
    outlines = np.add.reduceat(np.abs(corners[_following(sizes)] - corners).max(axis=1), np.cumsum(sizes) - sizes)
    reach = POLYGON_REACH * (width + height)
    if not (np.abs(corners).max() <= reach and outlines.max() <= reach):
        raise ValueError(
            f"a polygon reaches past {reach} pixels ({POLYGON_REACH} x (width + height)): its points or its outline"
        )
    # walks of polygons whose steps (about 5 x their outline + their points) add up to WALK_STEPS
    walk = np.cumsum(5 * outlines + 2 * sizes) // WALK_STEPS
    bounds = [0, *(np.flatnonzero(np.diff(walk)) + 1), len(sizes)]  # the polygons of each walk
    starts = np.concatenate(([0], np.cumsum(sizes)))  # their points
    masks = []
    for i, k in pairwise(bounds):
        masks += _walk(corners[starts[i] : starts[k]], sizes[i:k], height, width)
    return masks


def _following(sizes: np.ndarray) -> np.ndarray:
    """The index of each point's next one in polygons of ``sizes`` points laid end to end (the last
    point's next is its polygon's first)."""
    following = np.arange(sizes.sum()) + 1
    following[np.cumsum(sizes) - 1] = np.cumsum(sizes) - sizes
    return following


def _walk(corners: np.ndarray, sizes: np.ndarray, height: int, width: int) -> list[Mask]:
    """:func:`polygon_masks` of polygons of ``sizes`` points laid end to end in ``corners``, in one walk."""
    points = (5 * corners + 0.5).astype(np.int64)  # x[j] = (int)(scale * xy[2j] + .5)
    (x, y), (x1, y1) = points.T, points[_following(sizes)].T
    dx, dy = np.abs(x1 - x), np.abs(y1 - y)
    along_x = dx >= dy
    flip = np.where(along_x, x > x1, y > y1)  # each edge is computed from its lower end, walked from its start
    xs, xe = np.where(flip, x1, x), np.where(flip, x, x1)
    ys, ye = np.where(flip, y1, y), np.where(flip, y, y1)
    steps = np.where(along_x, dx, dy)
    # a zero-length edge divides 0 by 0 there (its one point's other coordinate is then never read:
    # its column is its neighbours'); here it is 0
    slope = np.where(along_x, ye - ys, xe - xs) / np.maximum(steps, 1)
    counts = steps + 1  # each edge's points, its ends included: each per edge value, per step
    t = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    t = np.where(np.repeat(flip, counts), np.repeat(steps, counts) - t, t)
    walked = np.repeat(np.where(along_x, xs, ys), counts) + t
    other = (np.repeat(np.where(along_x, ys, xs), counts) + np.repeat(slope, counts) * t + 0.5).astype(np.int64)
    along = np.repeat(along_x, counts)
    u, v = np.where(along, walked, other), np.where(along, other, walked)
    owner = np.repeat(np.repeat(np.arange(len(sizes)), sizes), counts)  # each step's polygon
    # the steps between columns a and a + 1 (in one polygon) whose crossing is a pixel column's
    # centre in the image: rleFrPoly's xd = (a + .5) / 5 - .5 an integer in 0 .. w - 1, i.e.
    # a = 2 (mod 5); at the first pixel centre at or below the lower of its two ends,
    # yd = ceil((b + .5) / 5 - .5) in 0 .. h
    a = np.minimum(u[1:], u[:-1])
    crossing = (u[1:] != u[:-1]) & (a % 5 == 2) & (a >= 2) & (a <= 5 * width - 3) & (owner[1:] == owner[:-1])
    j = np.flatnonzero(crossing)
    columns = (a[j] - 2) // 5
    rows = np.clip((np.minimum(v[j], v[j + 1]) + 2) // 5, 0, height)  # row == height: below the last
    bounds = np.searchsorted(owner[j], np.arange(len(sizes) + 1))
    return [_fill(rows[i:k], columns[i:k]) for i, k in pairwise(bounds)]


def _fill(rows: np.ndarray, columns: np.ndarray) -> Mask:
    """One polygon's pixels from its boundaries. Each column is crossed an even number of times (the
    walk is closed): its pixels lie between pairs of boundaries, from one's row up to the next's
    (rleFrPoly's runs; two at one pixel are none, its zero runs); here within the box they span."""
    if len(rows) == 0:
        return 0, 0, np.zeros((0, 0), bool)
    top, left = rows.min(), columns.min()
    box = np.zeros((rows.max() - top + 1, columns.max() - left + 1), np.uint8)
    np.bitwise_xor.at(box, (rows - top, columns - left), 1)
    np.bitwise_xor.accumulate(box, axis=0, out=box)
    return int(top), int(left), box[:-1].view(bool)


def _finite(value: Any) -> bool:
    """A JSON number that is a finite float (not a bool, nor an integer past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: Any) -> TypeGuard[int]:
    return type(value) is int  # what json makes of an integer: not a bool, not a float


def _is_id(value: Any) -> bool:
    """An id COCO's ids can be: an integer (COCO's own) or a string (some converters')."""
    return _is_int(value) or isinstance(value, str)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _points(polygon: Any, name: str) -> np.ndarray:
    """A COCO polygon's x, y pairs as floats; ValueError (naming its annotation) unless it is three
    or more finite pairs."""
    try:  # type() excludes bools; a float of an integer past its range raises
        pairs = isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0
        xy = np.array(polygon if pairs and all(type(v) in (int, float) for v in polygon) else (), np.float64)
    except OverflowError:
        xy = np.array(())
    if not (xy.size and np.isfinite(xy).all()):
        raise ValueError(f"{name}: a polygon is not x, y pairs (at least three points)")
    return xy


def _sample(
    file: Path, entry: dict[str, Any], annotations: list[dict[str, Any]], spec: PreprocessSpec
) -> dict[str, Any]:
    """One image's sample; ValueError for an annotation that is not COCO's or a size its file does
    not have (its image is skipped). The file's header is read first: nothing is made at a size
    the file does not have."""
    size = entry.get("width"), entry.get("height")
    stored = stored_size(os.fspath(file), spec)
    # the size as stored or upright (EXIF rotated): which one the writer checks against the pixels
    if size not in (stored, stored[::-1]):
        raise ValueError(
            f"the file says {_show.repr(size[0])} x {_show.repr(size[1])}, the image is {stored[0]} x {stored[1]}"
        )
    width, height = stored if size == stored else stored[::-1]
    boxes, labels = [], []
    shapes: list[tuple[int, np.ndarray | dict[str, Any]]] = []  # each polygon or RLE, in its category
    for a in annotations:
        name = f"annotation {_show.repr(a.get('id'))}"
        box, category = a.get("bbox"), a.get("category_id")
        if not (isinstance(box, list) and len(box) == 4 and all(map(_finite, box))):
            raise ValueError(f"{name}: bbox {_show.repr(box)} is not [x, y, width, height]")
        if not _is_int(category) or not 0 < category < 256:
            raise ValueError(f"{name}: category_id {_show.repr(category)} is not 1..255 (a mask byte)")
        x, y, w, h = map(float, box)
        boxes.append([x, y, x + w, y + h])
        labels.append(category)
        seg = a.get("segmentation")
        if isinstance(seg, list):
            shapes += [(category, _points(polygon, name)) for polygon in seg]
        elif isinstance(seg, dict):
            shapes.append((category, seg))
        elif seg is not None:
            raise ValueError(f"{name}: segmentation is neither polygons nor RLE")
    drawn = iter(polygon_masks([s for _, s in shapes if isinstance(s, np.ndarray)], height, width))
    mask = np.zeros((height, width), np.uint8)
    for category, shape in shapes:  # in the file's order: later annotations over earlier ones
        if isinstance(shape, dict):
            mask[rle_mask(shape, height, width)] = category
        else:
            top, left, inside = next(drawn)
            mask[top : top + inside.shape[0], left : left + inside.shape[1]][inside] = category
    return {
        "image": file,
        "boxes": np.array(boxes, np.float64).reshape(-1, 4),
        "box_labels": np.array(labels, np.int64),
        "mask": mask,
        "source": entry["file_name"],
    }


def load_coco(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[Any, list[dict[str, Any]]], list[str]]:
    """The images, the annotations by image id, and the category names by id (position = COCO's
    category id, "" for ids without a category) of the COCO annotations file ``path``; BuildError
    for a file that is not COCO, or for an annotation that belongs to no listed image (an image it
    was meant for would be packed without it)."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise BuildError(f"{path}: unreadable COCO annotations ({e})") from None
    except RecursionError:
        raise BuildError(f"{path}: unreadable COCO annotations (nested deeper than a JSON reader goes)") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise BuildError(f"{path}: not COCO annotations (no 'images' list)")
    images = [e for e in data["images"] if isinstance(e, dict) and isinstance(e.get("file_name"), str)]
    if len(images) != len(data["images"]):
        raise BuildError(f"{path}: an 'images' entry without a file_name")
    for key in ("annotations", "categories"):  # absent: none (an image-info file has no annotations)
        if not isinstance(data.get(key, []), list):
            raise BuildError(f"{path}: not COCO annotations ('{key}' is {_json_kind(data[key])}, not a list)")
    ids = {e["id"] for e in images if _is_id(e.get("id"))}
    by_image: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    strays = []
    for n, a in enumerate(data.get("annotations", [])):
        if not isinstance(a, dict):
            raise BuildError(f"{path}: not COCO annotations (annotation {n}, counting from 0, is {_json_kind(a)})")
        if _is_id(a.get("image_id")) and a["image_id"] in ids:
            by_image[a["image_id"]].append(a)
        else:
            strays.append(a)
    if strays:
        raise BuildError(_strays(path, strays, ids))
    names: dict[int, str] = {}
    for c in data.get("categories", []):
        if not (isinstance(c, dict) and _is_int(c.get("id")) and 0 < c["id"] < 256):
            raise BuildError(f"{path}: category {_show.repr(c)} has no id in 1..255")
        if not isinstance(c.get("name", ""), str):
            raise BuildError(f"{path}: category {c['id']}'s name {_show.repr(c['name'])} is not a string")
        names[c["id"]] = c.get("name", "")
    classes = [names.get(i, "") for i in range(max(names, default=0) + 1)]
    return images, by_image, classes


def _strays(path: str | os.PathLike, strays: list[dict[str, Any]], ids: set[Any]) -> str:
    """The one line that refuses annotations of no listed image, saying what the first one names."""
    first = strays[0].get("image_id")
    if not _is_id(first):
        why = f"image_id {_show.repr(first)} is not an id (an integer or a string)"
    else:
        why = f"image_id {_show.repr(first)} is no listed image's"
        if ids and not any(type(i) is type(first) for i in ids):
            why += f" (the images' ids are {'strings' if isinstance(next(iter(ids)), str) else 'integers'})"
    count = f"{len(strays)} annotations belong" if len(strays) > 1 else "an annotation belongs"
    return (
        f"{path}: {count} to no listed image (annotation {_show.repr(strays[0].get('id'))}: {why}); "
        f"the image it was meant for would be packed without it: fix or remove it"
    )


def build_coco(
    images: str | os.PathLike, out: str | os.PathLike, options: BuildOptions, quiet: bool, *, names: OptionNames
) -> BuildReport:
    """Pack the images ``options.coco`` lists (files under ``images``) with their annotations into
    ``out``; ``names``: how messages name the options (the caller's: CLI flags or packer.build's keywords)."""
    assert options.coco is not None, "a --coco build"
    listed, by_image, classes = load_coco(options.coco)
    fields = {name: {"kind": name, "classes": classes if name != "boxes" else ()} for name in COCO_FIELDS}
    samples = _samples(Path(images), listed, by_image, options.preprocess)
    return pack(samples, out, fields=fields, options=options.but(coco=None), quiet=quiet, names=names)


def _samples(
    images: Path, listed: list[dict[str, Any]], by_image: dict[Any, list[dict[str, Any]]], spec: PreprocessSpec
) -> Iterator[dict[str, Any]]:
    """Each listed image's sample, or a skip saying why it cannot be packed as the file says."""
    ids = Counter(e["id"] for e in listed if _is_id(e.get("id")))
    names = Counter(e["file_name"] for e in listed)
    root = images.resolve()
    for entry in listed:
        try:
            file = _file(entry, images, root, ids, names)
            sample = _sample(file, entry, by_image.get(entry["id"], []), spec)
        except ValueError as e:
            sample = {"source": entry["file_name"], "skip": str(e)}
        yield sample


def _file(entry: dict[str, Any], images: Path, root: Path, ids: Counter[Any], names: Counter[str]) -> Path:
    """The image's file under ``images`` (``root``: resolved), once neither its id nor its
    file_name is another image's (their annotations could not be told apart); else ValueError
    saying which. A file_name that resolves outside ``images`` is refused: an absolute path, one up
    through "..", or a link out of it (followed, it would pack any file the user can read, and a
    downloaded archive of images may hold links); ``images`` itself may be a link."""
    image_id, name = entry.get("id"), entry["file_name"]
    if not _is_id(image_id):
        raise ValueError(f"image id {_show.repr(image_id)} is not an id (an integer or a string)")
    if ids[image_id] > 1:
        raise ValueError(
            f"image id {_show.repr(image_id)} is shared by {ids[image_id]} images: whose annotations are whose "
            f"is unknown"
        )
    if names[name] > 1:
        raise ValueError(f"file_name listed by {names[name]} images (its annotations split between their ids)")
    try:
        file = Path(os.path.realpath(root / name))
    except ValueError:  # a NUL in the name
        file = root
    if file == root or not file.is_relative_to(root):
        raise ValueError(
            f"file_name {_show.repr(name)} is not a file under {images} (.., an absolute path or a link out of it)"
        )
    return file
