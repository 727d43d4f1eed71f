"""``packer build images/ out --coco instances.json``: a small COCO file, written here, over real photos."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from packer import ShardDataset
from packer.builder.coco import rle_counts, rle_mask
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
