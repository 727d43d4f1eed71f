"""``packer build images/ out --coco instances.json``: a small COCO file, written here, over real photos."""

from __future__ import annotations

import json
import reprlib
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import packer
from packer import ShardDataset
from packer.builder.coco import polygon_masks, rle_counts, rle_mask
from packer.tools.verify import verify

PHOTOS = Path(__file__).resolve().parents[1] / "data" / "exif-orientation"
PACKER = [sys.executable, "-m", "packer.cli"]


def rle_string(runs: list[int]) -> str:
    """pycocotools' compressed RLE string of ``runs`` (its rleToString, written out)."""
    out = []
    for i, x in enumerate(runs):
        if i > 2:
            x -= runs[i - 2]
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = x != -1 if c & 0x10 else x != 0
            out.append(chr((c | (0x20 if more else 0)) + 48))
    return "".join(out)


def runs_of(mask: np.ndarray) -> list[int]:
    """The column-major runs (0s first) of a bool mask, as COCO's RLE counts them."""
    flat = mask.T.ravel().astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flat, [1 - flat[-1]]])))
    return np.diff(np.concatenate([[0], edges, [len(flat)]]))[: len(edges)].tolist() if len(flat) else []


def test_rle_round_trip() -> None:
    rng = np.random.default_rng(0)
    mask = np.zeros((37, 23), bool)
    mask[5:30, 3:20] = rng.random((25, 17)) > 0.3
    runs = runs_of(mask)
    assert sum(runs) == mask.size
    assert rle_counts(rle_string(runs)) == runs
    np.testing.assert_array_equal(rle_mask({"size": [37, 23], "counts": rle_string(runs)}, 37, 23), mask)
    with pytest.raises(ValueError, match="cover 859 pixels"):
        rle_mask({"size": [37, 23], "counts": [*runs[:-1], runs[-1] + 8]}, 37, 23)
    with pytest.raises(ValueError, match="not one of its alphabet"):
        rle_counts("ab\x01")


@pytest.fixture
def coco(tmp_path: Path) -> tuple[Path, Path]:
    """images/ with three upright photos and instances.json: polygons, an RLE of each form, a
    broken annotation and a missing file."""
    images = tmp_path / "images"
    images.mkdir()
    entries: list[dict] = []
    annotations: list[dict] = []
    sizes: list[tuple[int, int]] = []
    names = ["Landscape_1.jpg", "Portrait_3.jpg", "Landscape_6.jpg"]
    for k, name in enumerate(names):
        im = ImageOps.exif_transpose(Image.open(PHOTOS / name)).convert("RGB")
        im.save(images / name, quality=95)
        entries.append({"id": 10 + k, "file_name": name, "width": im.width, "height": im.height})
        sizes.append((im.height, im.width))
    annotations.append(  # a rectangle as a polygon, category 3
        {
            "id": 1,
            "image_id": 10,
            "category_id": 3,
            "bbox": [100, 50, 200, 100],
            "segmentation": [[100, 50, 300, 50, 300, 150, 100, 150]],
        }
    )
    for number, image, category, (top, left, bottom, right), compressed in (
        (2, 0, 7, (400, 600, 500, 900), False),  # uncompressed RLE, category 7 (a crowd)
        (3, 1, 3, (200, 100, 260, 400), True),  # compressed RLE, category 3
    ):
        size = sizes[image]
        mask = np.zeros(size, bool)
        mask[top:bottom, left:right] = True
        runs = runs_of(mask)
        segmentation = {"size": list(size), "counts": rle_string(runs) if compressed else runs}
        annotations.append(
            {
                "id": number,
                "image_id": 10 + image,
                "category_id": category,
                "bbox": [left, top, right - left, bottom - top],
                "segmentation": segmentation,
            }
        )
    annotations.append({"id": 4, "image_id": 12, "category_id": 3, "bbox": [1, 2, 3]})  # broken: its image skipped
    entries.append({"id": 13, "file_name": "missing.jpg", "width": 640, "height": 480})
    categories = [{"id": 3, "name": "cat"}, {"id": 7, "name": "crowd"}]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": entries, "annotations": annotations, "categories": categories}))
    return images, path


def test_coco_in_one_command(tmp_path: Path, coco: tuple[Path, Path]) -> None:
    images, instances = coco
    out = tmp_path / "coco.lmdb"
    run = subprocess.run(
        [*PACKER, "build", str(images), str(out), "--coco", str(instances)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "packed 2 of 4 scanned (2 skipped" in run.stderr
    report = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    reasons = {r["path"]: r["reason"] for r in report}
    assert "bbox [1, 2, 3] is not [x, y, width, height]" in reasons["Landscape_6.jpg"]
    assert "missing.jpg" in reasons and "No such file" in reasons["missing.jpg"]
    assert verify(out).ok
    ds = ShardDataset(out, crop_size=None, dtype=torch.uint8)
    assert ds.fields["box_labels"].classes[3] == "cat" and ds.fields["mask"].classes[7] == "crowd"
    first = ds[0]
    h, w = first["mask"].shape
    sx, sy = w / 1026, h / 684  # Landscape_1 is 1026 x 684, stored 480 x 320
    np.testing.assert_allclose(
        first["boxes"].numpy(),
        [[100 * sx, 50 * sy, 300 * sx, 150 * sy], [600 * sx, 400 * sy, 900 * sx, 500 * sy]],
        rtol=1e-5,
    )
    assert first["box_labels"].tolist() == [3, 7]
    mask = first["mask"].numpy()
    assert set(np.unique(mask).tolist()) == {0, 3, 7}
    ys, xs = np.nonzero(mask == 3)
    assert abs(xs.min() - 100 * sx) <= 1 and abs(xs.max() + 1 - 300 * sx) <= 1.5
    ys, xs = np.nonzero(mask == 7)
    assert abs(ys.min() - 400 * sy) <= 1 and abs(ys.max() + 1 - 500 * sy) <= 1
    second = ds[1]
    assert ds.source(second["id"]) == "Portrait_3.jpg" and second["box_labels"].tolist() == [3]
    ys, xs = np.nonzero(second["mask"].numpy() == 3)
    h, w = second["mask"].shape
    assert abs(ys.min() - 200 * h / 1026) <= 1 and abs(xs.max() + 1 - 400 * w / 684) <= 1


def test_not_coco_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "i").mkdir()
    (tmp_path / "x.json").write_text('{"annotations": []}')
    run = subprocess.run(
        [
            *PACKER,
            "build",
            str(tmp_path / "i"),
            str(tmp_path / "o"),
            "--coco",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "not COCO annotations (no 'images' list)" in run.stderr
    assert not (tmp_path / "o").exists()


def noise(folder: Path, sizes: dict[str, tuple[int, int]]) -> Path:
    """``folder`` with a noise PNG of each (width, height) in ``sizes``."""
    rng = np.random.default_rng(0)
    for name, (width, height) in sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
    return folder


def entry(image_id: object, name: str, width: object = 40, height: object = 30) -> dict:
    return {"id": image_id, "file_name": name, "width": width, "height": height}


def box(number: int, image_id: object, bbox: list, category: object = 3, **more: object) -> dict:
    return {"id": number, "image_id": image_id, "category_id": category, "bbox": bbox, **more}


def coco_build(tmp_path: Path, images: Path, doc: dict) -> tuple[packer.BuildReport, list[tuple[str, str]]]:
    """A real --coco build of ``doc`` over ``images`` (in this process) and its report's (path, reason)s."""
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps(doc))
    report = packer.build(images, tmp_path / "out", coco=str(instances), workers=0, quiet=True)
    lines = (tmp_path / "out" / "report.jsonl").read_text().splitlines()
    return report, [(r["path"], r["reason"]) for r in map(json.loads, lines)]


def test_an_id_or_file_two_images_share_is_a_skip_of_each(tmp_path: Path) -> None:
    """Two annotation files merged naively: an image id (or a file) listed twice is never packed
    with another image's annotations, nor with half of its own."""
    images = noise(tmp_path / "images", dict.fromkeys(("a.png", "b.png", "c.png", "d.png"), (40, 30)))
    doc = {
        "images": [entry(1, "a.png"), entry(1, "b.png"), entry(2, "c.png"), entry(3, "c.png"), entry(4, "d.png")],
        "annotations": [
            box(1, 1, [0, 0, 5, 5]),
            box(2, 1, [10, 10, 5, 5]),
            box(3, 2, [1, 1, 2, 2]),
            box(4, 3, [3, 3, 2, 2]),
            box(5, 4, [1, 2, 3, 4]),
        ],
        "categories": [{"id": 3, "name": "cat"}],
    }
    report, reasons = coco_build(tmp_path, images, doc)
    assert (report.count, report.skipped, report.scanned) == (1, 4, 5)
    assert [path for path, _ in reasons] == ["a.png", "b.png", "c.png", "c.png"]
    assert all("image id 1 is shared by 2 images" in why for _, why in reasons[:2])
    assert all("file_name listed by 2 images" in why for _, why in reasons[2:])
    ds = ShardDataset(tmp_path / "out", crop_size=None, dtype=torch.uint8)
    assert ds.source(0) == "d.png" and ds[0]["boxes"].tolist() == [[1, 2, 4, 6]]


BASE = {
    "images": [entry(1, "a.png")],
    "annotations": [box(1, 1, [1, 1, 5, 5])],
    "categories": [{"id": 3, "name": "cat"}],
}


@pytest.mark.parametrize(
    "change, error",
    [
        # annotations that belong to no listed image (their image would be packed without them)
        (
            {"annotations": [box(1, "1", [1, 1, 5, 5])]},
            "image_id '1' is no listed image's (the images' ids are integers)",
        ),
        ({"annotations": [box(1, 1, [0, 0, 1, 1]), box(7, 9, [1, 1, 5, 5])]}, "(annotation 7: image_id 9 is no listed"),
        ({"annotations": [box(1, [1], [1, 1, 5, 5])]}, "image_id [1] is not an id (an integer or a string)"),
        ({"annotations": [box(1, {"a": 1}, [1, 1, 5, 5])]}, "image_id {'a': 1} is not an id"),
        ({"annotations": [box(1, 1, [1, 1, 5, 5]), 7]}, "annotation 1, counting from 0, is a number"),
        # a file that is not COCO
        ({"annotations": {"1": box(1, 1, [1, 1, 5, 5])}}, "'annotations' is an object, not a list"),
        ({"annotations": 5}, "'annotations' is a number, not a list"),
        ({"annotations": None}, "'annotations' is null, not a list"),
        ({"categories": 5}, "'categories' is a number, not a list"),
        ({"categories": None}, "'categories' is null, not a list"),
        ({"categories": [{"id": [3], "name": "cat"}]}, "category {'id': [3], 'name': 'cat'} has no id in 1..255"),
        ({"categories": [{"id": 3, "name": {"en": "cat"}}]}, "category 3's name {'en': 'cat'} is not a string"),
    ],
    ids=[
        *("string image_id", "unlisted image_id", "list image_id", "object image_id", "annotation a number"),
        *("annotations an object", "annotations a number", "annotations null", "categories a number"),
        *("categories null", "list category id", "object category name"),
    ],
)
def test_annotations_of_no_listed_image_fail_the_build_in_one_line(tmp_path: Path, change: dict, error: str) -> None:
    images = noise(tmp_path / "images", {"a.png": (40, 30)})
    with pytest.raises(packer.BuildError) as caught:
        coco_build(tmp_path, images, BASE | change)
    assert error in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_json_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    """100,000-deep nesting: json's RecursionError, as the CLI ends it."""
    (tmp_path / "images").mkdir()
    (tmp_path / "x.json").write_text('{"images": [], "annotations": ' + "[" * 100_000 + "]" * 100_000 + "}")
    run = subprocess.run(
        [*PACKER, "build", str(tmp_path / "images"), str(tmp_path / "o"), "--coco", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "unreadable COCO annotations (nested deeper than a JSON reader goes)" in run.stderr
    assert not (tmp_path / "o").exists()


def test_values_that_are_not_coco_are_reported_skips(tmp_path: Path) -> None:
    """An id that is a list or an object, a size that is not a number, a bbox number past a float,
    a category id true, an RLE string of 2 MB, a polygon number past a float or a polygon reaching
    far past its image: each its image's reported skip, counts adding up."""
    sizes = dict.fromkeys(("a.png", "b.png", "c.png", "d.png", "e.png", "f.png", "g.png", "h.png", "i.png"), (40, 30))
    images = noise(tmp_path / "images", sizes)
    doc = {
        "images": [
            entry([1], "a.png"),
            entry({"x": 1}, "b.png"),
            entry(3, "c.png", width="40"),
            entry(4, "d.png"),
            entry(5, "e.png"),
            entry(6, "f.png"),
            entry(7, "g.png"),
            entry(8, "h.png"),
            entry(9, "i.png"),
        ],
        "annotations": [
            box(1, 4, [0, 0, 10**400, 5]),
            box(2, 5, [0, 0, 5, 5], category=True),
            box(3, 6, [0, 0, 5, 5], segmentation={"size": [30, 40], "counts": "o" * 2_000_000}),
            box(4, 7, [0, 0, 5, 5], segmentation=[[0, 0, 5, 0, 5, 5]]),
            box(5, 8, [0, 0, 5, 5], segmentation=[[0, 0, 10**400, 0, 5, 5]]),
            box(6, 9, [0, 0, 5, 5], segmentation=[[0, 0, 1e12, 0, 5, 5]]),
        ],
        "categories": [{"id": 3, "name": "cat"}],
    }
    report, reasons = coco_build(tmp_path, images, doc)
    assert (report.count, report.skipped, report.scanned) == (1, 8, 9)
    assert reasons == [
        ("a.png", "image id [1] is not an id (an integer or a string)"),
        ("b.png", "image id {'x': 1} is not an id (an integer or a string)"),
        ("c.png", "the file says '40' x 30, the image is 40 x 30"),
        ("d.png", f"annotation 1: bbox [0, 0, {reprlib.repr(10**400)}, 5] is not [x, y, width, height]"),
        ("e.png", "annotation 2: category_id True is not 1..255 (a mask byte)"),
        ("f.png", "RLE counts: 2000000 characters, more than a 30 x 40 image's runs take"),
        ("h.png", "annotation 5: a polygon is not x, y pairs (at least three points)"),
        ("i.png", "a polygon reaches past 1120 pixels (16 x (width + height)): its points or its outline"),
    ]


def test_polygons_are_drawn_as_pycocotools_draws_them() -> None:
    """The expected masks are pycocotools 2.0.11's (pip install pycocotools, then for each case
    ``mask.decode(mask.merge(mask.frPyObjects(polygons, h, w)))``), written here as runs_of() them:
    checked by hand for the rectangles (60 x 40 covers rows 10..49, columns 10..69; 4 x 4 rows and
    columns 0..3), Pillow fills one more row and column (2,501 and 25 pixels)."""
    cases: list[tuple[list[list[float]], int, int, list[int]]] = [
        ([[1.3, 0.6, 8.7, 2.2, 3.1, 10.9]], 12, 10, [25, 6, 6, 9, 3, 8, 4, 6, 7, 4, 8, 2, 10, 1, 21]),
        (
            [[0.5, 0.5, 9.5, 0.5, 9.5, 9.5, 5.2, 3.7, 0.5, 9.5]],
            11,
            10,
            [12, 7, 4, 6, 5, 5, 6, 4, 7, 3, 8, 4, 7, 6, 5, 7, 4, 8, 2],
        ),  # concave
        ([[-3.4, -2.0, 12.6, 1.2, 7.0, 15.5, -1.0, 6.25]], 9, 10, [0, 8, 1, 72, 1, 8]),  # past every edge
        ([[0, 0, 3, 0, 3, 3, 0, 3], [5.5, 5.5, 9, 6, 7, 9]], 10, 10, [0, 3, 7, 3, 7, 3, 43, 2, 8, 2, 8, 1, 13]),
    ]
    for polygons, height, width, runs in cases:
        mask = np.zeros((height, width), bool)
        for top, left, box in polygon_masks(polygons, height, width):
            mask[top : top + box.shape[0], left : left + box.shape[1]] |= box
        assert runs_of(mask) == runs, polygons
    for rectangle, (top, left, bottom, right) in (
        ([10, 10, 70, 10, 70, 50, 10, 50], (10, 10, 50, 70)),
        ([0, 0, 4, 0, 4, 4, 0, 4], (0, 0, 4, 4)),
    ):
        [(top, left, box)] = polygon_masks([rectangle], 100, 100)
        mask = np.zeros((100, 100), bool)
        mask[top : top + box.shape[0], left : left + box.shape[1]] = box
        expected = np.zeros((100, 100), bool)
        expected[top:bottom, left:right] = True
        np.testing.assert_array_equal(mask, expected)
    with pytest.raises(ValueError, match="reaches past 2880 pixels"):
        polygon_masks([[0, 0, 5, 0, 5, 5], [0, 0, 1e12, 0, 5, 5]], 100, 80)


def test_a_coco_build_masks_polygons_as_pycocotools(tmp_path: Path) -> None:
    """A 60 x 40 and a 4 x 4 rectangle, packed: 2,400 and 16 mask pixels, where they are."""
    images = noise(tmp_path / "images", {"a.png": (120, 80)})
    doc = {
        "images": [entry(1, "a.png", 120, 80)],
        "annotations": [
            box(1, 1, [10, 10, 60, 40], segmentation=[[10, 10, 70, 10, 70, 50, 10, 50]]),
            box(2, 1, [80, 60, 4, 4], category=7, segmentation=[[80, 60, 84, 60, 84, 64, 80, 64]]),
        ],
        "categories": [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}],
    }
    report, reasons = coco_build(tmp_path, images, doc)
    assert report.count == 1 and reasons == []
    mask = ShardDataset(tmp_path / "out", crop_size=None, dtype=torch.uint8)[0]["mask"].numpy()
    expected = np.zeros((80, 120), np.uint8)
    expected[10:50, 10:70] = 3
    expected[60:64, 80:84] = 7
    np.testing.assert_array_equal(mask, expected)


def test_a_size_the_image_has_not_is_a_skip_before_any_mask(tmp_path: Path) -> None:
    """The file says 40,000 x 40,000 for a 120 x 160 PNG: a skip from its header, no mask of the
    file's size made (the build runs within 1 GiB of address space: that mask alone is 1.6 GB)."""
    images = noise(tmp_path / "images", {"a.png": (120, 160), "b.png": (120, 160)})
    doc = {
        "images": [entry(1, "a.png", 40_000, 40_000), entry(2, "b.png", 120, 160)],
        "annotations": [box(1, 1, [1, 1, 5, 5], segmentation=[[1, 1, 6, 1, 6, 6]])],
        "categories": [{"id": 3, "name": "cat"}],
    }
    (tmp_path / "instances.json").write_text(json.dumps(doc))
    limit = 1 << 30
    run = subprocess.run(
        [*PACKER, "build", str(images), str(tmp_path / "out"), "--coco", str(tmp_path / "instances.json")],
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert run.returncode == 0, run.stderr
    assert "packed 1 of 2 scanned (1 skipped" in run.stderr
    report = [json.loads(line) for line in (tmp_path / "out" / "report.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in report] == [
        ("a.png", "the file says 40000 x 40000, the image is 120 x 160")
    ]


def test_a_file_name_outside_images_is_a_skip(tmp_path: Path) -> None:
    """ "..", an absolute path and a link out of images/ are refused; a link inside it, and images/
    itself a link, are followed."""
    noise(tmp_path / "private", {"x.png": (40, 30)})
    folder = noise(tmp_path / "real", {"in.png": (40, 30), "sub/deep.png": (40, 30)})
    (folder / "out.png").symlink_to(tmp_path / "private" / "x.png")
    (folder / "sub" / "up.png").symlink_to("../in.png")
    (tmp_path / "images").symlink_to(folder)
    names = ["../private/x.png", str(tmp_path / "private" / "x.png"), "out.png", "sub/../../private/x.png"]
    names += ["in.png", "sub/deep.png", "sub/up.png"]
    doc = {"images": [entry(i, name) for i, name in enumerate(names)], "annotations": [], "categories": []}
    report, reasons = coco_build(tmp_path, tmp_path / "images", doc)
    assert (report.count, report.skipped) == (3, 4)
    assert [path for path, _ in reasons] == names[:4]
    assert all(
        f"is not a file under {tmp_path / 'images'} (.., an absolute path or a link" in why for _, why in reasons
    )
    ds = ShardDataset(tmp_path / "out", crop_size=None)
    assert [ds.source(i) for i in range(len(ds))] == names[4:]


def test_rle_counts_decode_in_linear_time() -> None:
    """A string of continuation characters is one number too long for any image, refused before
    it is summed (it was summed with ever longer shifts: 2 MB ran for minutes); a string longer
    than an image's runs can take is refused before it is read."""
    with pytest.raises(ValueError, match="a number of 20001 characters, longer than any image's run"):
        rle_counts("o" * 20_000 + "0")
    with pytest.raises(ValueError, match="2000000 characters, more than a 160 x 120 image's runs take"):
        rle_mask({"size": [160, 120], "counts": "o" * 2_000_000}, 160, 120)
    runs = [0, *[1, 2, 3, 40_000] * 5_000]  # 20,001 runs: deltas of every sign and size
    assert rle_counts(rle_string(runs)) == runs
