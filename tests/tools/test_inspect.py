"""`packer preview`, `packer show` and the histograms of `packer info`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

import packer
from packer.tools.preview import CAPTION, CELL, contact_sheet, pick


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer.cli", *map(str, args)], capture_output=True, text=True)


def test_preview_writes_grid_of_right_size(built, tmp_path: Path) -> None:
    out = built("lmdb", "jpeg")
    dest = tmp_path / "grid.png"
    run = cli("preview", out, "-o", dest, "--n", 10)
    assert run.returncode == 0, run.stderr
    with Image.open(dest) as im:
        assert im.format == "PNG" and im.size == (4 * CELL, 3 * (CELL + CAPTION))
        cells = np.asarray(im.convert("RGB"))
    # ten filled cells, two empty ones (background only) in the last row
    last_row = cells[2 * (CELL + CAPTION) : 2 * (CELL + CAPTION) + CELL]
    assert last_row[:, : 2 * CELL].std() > 10 and last_row[:, 2 * CELL :].std() == 0


def test_preview_augment_shows_the_training_crops(built, tmp_path: Path) -> None:
    """With --augment the thumbnails are ShardDataset's crops for that seed and epoch, and epochs differ."""
    out = built("memmap", "raw")
    a, b, c = (tmp_path / f"{k}.png" for k in "abc")
    contact_sheet(out, a, n=4, augment=True, seed=3, epoch=0)
    contact_sheet(out, b, n=4, augment=True, seed=3, epoch=0)
    contact_sheet(out, c, n=4, augment=True, seed=3, epoch=1)
    pa, pb, pc = (np.asarray(Image.open(p)) for p in (a, b, c))
    assert np.array_equal(pa, pb) and not np.array_equal(pa, pc)
    assert pick(18, 4, 3) == pick(18, 4, 3) and len(set(pick(18, 18, 1))) == 18


def test_show_writes_one_upright_record(built, tmp_path: Path) -> None:
    out = built("lmdb", "jpeg")
    dest = tmp_path / "one.png"
    run = cli("show", out, 12, "-o", dest)
    assert run.returncode == 0, run.stderr
    assert "portrait/Portrait_" in run.stdout and "class portrait" in run.stdout
    with Image.open(dest) as im:
        assert im.width == 320 and im.height > im.width
    bad = cli("show", out, 99)
    assert bad.returncode != 0 and "out of range" in bad.stderr and "Traceback" not in bad.stderr


def test_info_histograms(built) -> None:
    out = built("memmap", "jpeg")
    facts = json.loads(cli("info", out, "--json").stdout)
    assert sum(b["count"] for b in facts["long_edge_histogram"]) == 18
    assert facts["short_edge_histogram"] == [{"lo": 320, "hi": 320, "count": 18}]
    text = cli("info", out).stdout
    assert "per class:" in text and "stored long edge" in text and "#" in text


def test_non_utf8_names_print_as_valid_utf8(raw_photos: Path, tmp_path: Path) -> None:
    """A class folder and files whose names are not UTF-8 (os.fsdecode gives lone surrogates): `info
    --json` is valid UTF-8 whatever the stream's error handler, and its names turn back into the
    folder's bytes; `info` and `show` print them escaped under a strict UTF-8 stdout; report.jsonl
    is valid UTF-8 JSON too."""
    raw = tmp_path / "raw"
    cls = os.fsencode(raw) + b"/caf\xe9"
    os.makedirs(cls)
    photo = next((raw_photos / "landscape").iterdir())
    shutil.copyfile(photo, os.fsdecode(cls + b"/p\xff.jpg"))
    Path(os.fsdecode(cls + b"/bad\xfe.jpg")).write_bytes(b"not a jpeg")
    shutil.copytree(raw_photos / "portrait", raw / "ok")
    out = tmp_path / "out.lmdb"
    packer.build(raw, out, workers=1, quiet=True)
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for env in (strict, {**os.environ, "PYTHONIOENCODING": "utf-8:surrogateescape"}):
        run = subprocess.run(
            [sys.executable, "-m", "packer.cli", "info", "--json", str(out)], capture_output=True, env=env
        )
        assert run.returncode == 0, run.stderr
        facts = json.loads(run.stdout.decode("utf-8"))
        assert [os.fsencode(c) for c in facts["classes"]] == [b"caf\xe9", b"ok"]
        assert os.fsencode(next(iter(facts["class_counts"]))) == b"caf\xe9"
    run = subprocess.run([sys.executable, "-m", "packer.cli", "info", str(out)], capture_output=True, env=strict)
    assert run.returncode == 0 and run.stderr == b"", run.stderr
    assert b"    caf\\xe9  " in run.stdout and b"    ok  " in run.stdout
    run = subprocess.run([sys.executable, "-m", "packer.cli", "show", str(out), "0"], capture_output=True, env=strict)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(b"0: caf\\xe9/p\\xff.jpg  class caf\\xe9  ")
    (line,) = (out / "report.jsonl").read_bytes().decode("utf-8").splitlines()
    assert os.fsencode(json.loads(line)["path"]) == b"caf\xe9/bad\xfe.jpg"


def test_info_show_and_preview_of_a_coco_dataset_name_its_categories(tmp_path: Path) -> None:
    """A ``--coco`` dataset has no image labels: `info` says its box categories (names, boxes per
    category), not "0 classes (unlabeled)"; `show` and the preview's captions name the categories
    of the boxes shown, not "unlabeled"."""
    from PIL import ImageOps

    from packer import ShardDataset
    from packer.tools.preview import caption

    photos = Path(__file__).resolve().parents[1] / "data" / "exif-orientation"
    images = tmp_path / "images"
    images.mkdir()
    entries, annotations = [], []
    for k, name in enumerate(["Landscape_1.jpg", "Portrait_3.jpg"]):
        im = ImageOps.exif_transpose(Image.open(photos / name)).convert("RGB")
        im.save(images / name, quality=95)
        entries.append({"id": k, "file_name": name, "width": im.width, "height": im.height})
    for number, (image, category, box) in enumerate(
        [(0, 3, [100, 50, 200, 100]), (0, 3, [400, 300, 100, 100]), (0, 7, [10, 10, 50, 50]), (1, 3, [20, 20, 90, 90])]
    ):
        annotations.append({"id": number, "image_id": image, "category_id": category, "bbox": box})
    categories = [{"id": 3, "name": "cat"}, {"id": 7, "name": "crowd"}, {"id": 9, "name": "unused"}]
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps({"images": entries, "annotations": annotations, "categories": categories}))
    out = tmp_path / "coco"
    run = cli("build", images, out, "--coco", instances, "--backend", "memmap", "--workers", "1")
    assert run.returncode == 0, run.stderr

    text = cli("info", out).stdout
    assert "2 images, 3 box categories (no image label)" in text and "0 classes" not in text
    assert "boxes per category:" in text
    lines = text.splitlines()
    assert any(line.split()[:3] == ["3", "cat", "3"] for line in lines), text
    assert any(line.split()[:3] == ["7", "crowd", "1"] for line in lines), text
    assert any(line.split()[:3] == ["9", "unused", "0"] for line in lines), text
    facts = json.loads(cli("info", "--json", out).stdout)
    (labels,) = [f for f in facts["fields"] if f["kind"] == "box_labels"]
    assert labels["categories"] == [
        {"id": 3, "name": "cat", "boxes": 3},
        {"id": 7, "name": "crowd", "boxes": 1},
        {"id": 9, "name": "unused", "boxes": 0},
    ]

    ds = ShardDataset(out, crop_size=None)
    first = ds.source(0) == "Landscape_1.jpg"
    assert [caption(ds, i, ds[i]) for i in range(2)] == (
        ["cat x2, crowd", "cat"] if first else ["cat", "cat x2, crowd"]
    )
    run = cli("show", out, 0)
    assert run.returncode == 0 and "unlabeled" not in run.stdout and " cat" in run.stdout, run.stdout
    assert contact_sheet(out, tmp_path / "sheet.png", n=2) == (2, 1)
