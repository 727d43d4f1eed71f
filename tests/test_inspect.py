"""`packer preview`, `packer show` and the histograms of `packer info`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

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
