"""The detection recipe of docs/FIELDS.md ("Training a detector"), run as a user runs it: a small COCO
subset drawn here (shapes on noise, an instances.json with their boxes and polygons), packed with
``packer build images/ out --coco instances.json``, then scripts/train_detector.py (torchvision's
Faster R-CNN) for a few steps on it through ShardSampler and a DataLoader with 2 workers.

torchvision is not in packer's own venv: ``make recipe-check`` runs this file in build/recipe/venv
(torch and torchvision from PyPI, packer from the checkout), with PACKER_RECIPE=1, which turns the
skip without torchvision into a failure. The check that the docs show the script as it is runs in
every venv.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from packer import ShardDataset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_detector.py"
#: COCO-style category ids (not contiguous, as COCO's are) and their shapes.
CATEGORIES = {1: "square", 3: "disc", 7: "triangle"}


def _outline(shape: str, x0: float, y0: float, w: float, h: float) -> list[float]:
    """The polygon (x, y, x, y, ...) of a ``shape`` filling the box (x0, y0, w, h)."""
    if shape == "square":
        points = [(x0, y0), (x0 + w, y0), (x0 + w, y0 + h), (x0, y0 + h)]
    elif shape == "disc":
        t = np.linspace(0, 2 * np.pi, 32, endpoint=False)
        points = list(zip(x0 + w / 2 * (1 + np.cos(t)), y0 + h / 2 * (1 + np.sin(t))))
    else:
        points = [(x0 + w / 2, y0), (x0 + w, y0 + h), (x0, y0 + h)]
    return [float(c) for p in points for c in p]


def coco_subset(root: Path, n: int = 16) -> tuple[Path, Path, dict[str, set[int]]]:
    """images/ with ``n`` JPEGs (noise, 1-3 filled shapes each), instances.json with their boxes
    and polygons, and each file's categories."""
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    entries: list[dict] = []
    annotations: list[dict] = []
    categories: dict[str, set[int]] = {}
    for i in range(n):
        width, height = (480, 360) if i % 2 else (360, 480)
        pixels = rng.integers(60, 190, (height, width, 3), dtype=np.uint8)
        im = Image.fromarray(pixels)
        draw = ImageDraw.Draw(im)
        name = f"{i:03d}.jpg"
        categories[name] = set()
        for _ in range(int(rng.integers(1, 4))):
            category = int(rng.choice(list(CATEGORIES)))
            w, h = rng.uniform(60, 160, 2)
            x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
            polygon = _outline(CATEGORIES[category], x0, y0, w, h)
            draw.polygon(polygon, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": category,
                    "bbox": [float(x0), float(y0), float(w), float(h)],
                    "segmentation": [polygon],
                    "area": float(w * h),
                    "iscrowd": 0,
                }
            )
            categories[name].add(category)
        im.save(images / name, quality=92)
        entries.append({"id": i, "file_name": name, "width": width, "height": height})
    instances = root / "instances.json"
    instances.write_text(
        json.dumps(
            {
                "images": entries,
                "annotations": annotations,
                "categories": [{"id": k, "name": v, "supercategory": "shape"} for k, v in CATEGORIES.items()],
            }
        )
    )
    return images, instances, categories


def test_docs_show_the_recipe_as_it_runs() -> None:
    """docs/FIELDS.md's "Training a detector" shows scripts/train_detector.py whole, as it is."""
    docs = (ROOT / "docs" / "FIELDS.md").read_text()
    section = docs.split("## Training a detector", 1)[1]
    block = section.split("```python\n", 1)[1].split("```\n", 1)[0]
    assert block == SCRIPT.read_text()


def test_faster_rcnn_trains_on_a_packed_coco_subset(tmp_path: Path) -> None:
    if not os.environ.get("PACKER_RECIPE"):
        pytest.importorskip("torchvision", reason="make recipe-check runs this in a venv with torchvision")
    images, instances, categories = coco_subset(tmp_path)
    out = tmp_path / "coco.lmdb"
    packer = Path(sys.executable).with_name("packer")
    subprocess.run([packer, "build", images, out, "--coco", instances], check=True, capture_output=True, timeout=300)
    steps, batch = 12, 2  # ~2 s a step on 2 cores (a CUDA build of torch on CPU)
    run = subprocess.run(
        [sys.executable, SCRIPT, out, "--steps", str(steps), "--batch-size", str(batch), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    log = [json.loads(line) for line in run.stdout.splitlines()]
    assert [entry["step"] for entry in log] == list(range(steps))
    losses = [entry["loss"] for entry in log]
    assert all(math.isfinite(x) for x in losses), losses
    assert statistics.median(losses[-4:]) < statistics.median(losses[:4]), losses
    # the targets are each sample's own: its id names its image, whose shapes its labels are among
    ds = ShardDataset(out)
    assert ds.fields["box_labels"].classes[1:] == ("square", "", "disc", "", "", "", "triangle")
    seen = set()
    for entry in log:
        assert len(entry["ids"]) == len(entry["labels"]) == batch
        for record, labels in zip(entry["ids"], entry["labels"]):
            assert set(labels) <= categories[ds.source(record)], (record, labels)
            seen.add(record)
    assert seen == set(range(len(categories)))  # 12 steps of 2: the 16 images, then half of them again
    assert sum(len(labels) for entry in log for labels in entry["labels"]) > len(log)  # boxes survive the crops
