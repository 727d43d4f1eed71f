"""Hostile records and manifests of a dataset with fields (issue 40, items 3, 8 and 9): a dataset
packed by packer.pack, then edited on disk as an attacker (or a damaged download) would, every
CRC-32 and digest made to match, so that only the checks of the fields themselves can tell.

Every read is a real ShardDataset (with DataLoader workers where it says so), every command a real
``python -m packer.cli`` process.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import packer
from packer import DatasetError, ShardDataset
from packer.format import INDEX, MANIFEST, Manifest, index_digest, logical_digest, manifest_digest
from packer.format.fields import join_record, split_record
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]
FIELDS = {"boxes": "boxes", "box_labels": "box_labels", "mask": "mask"}


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKER, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture
def detections(tmp_path: Path) -> Path:
    """Six 48 x 64 images, each with two boxes, their labels and a mask (JPEG records, memmap)."""
    rng = np.random.default_rng(1)
    samples = []
    for i in range(6):
        mask = np.zeros((48, 64), np.uint8)
        mask[10:30, 5:25], mask[20:40, 30:60] = 1, 2
        image = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
        boxes = [[5, 10, 25, 30], [30, 20, 60, 40]]
        samples.append({"image": image, "boxes": boxes, "box_labels": [1, 2], "mask": mask, "source": f"im{i}"})
    out = tmp_path / "d"
    report = packer.pack(samples, out, fields=FIELDS, backend="memmap", short_edge=48, workers=1)
    assert report.count == 6 and verify(out).ok
    return out


def record(root: Path, i: int) -> bytes:
    index = np.load(root / INDEX, allow_pickle=False)
    shard = root / Manifest.load(root).shards[int(index[i]["shard"])]["file"]
    at, n = int(index[i]["offset"]), int(index[i]["length"])
    with open(shard, "rb") as f:
        f.seek(at)
        return f.read(n)


def forge(root: Path, i: int, data: bytes, manifest: dict | None = None, **row: int) -> None:
    """Record ``i`` replaced by ``data`` as an attacker would: appended to its shard, its index row
    (offset, length, CRC-32, and ``row``'s other columns) and the manifest (``manifest``'s changes,
    the shard's bytes and dead bytes) rewritten, every digest recomputed to match."""
    index = np.load(root / INDEX, allow_pickle=False)
    m = json.loads((root / MANIFEST).read_text())
    shard = m["shards"][int(index[i]["shard"])]
    path = root / shard["file"]
    at, old = path.stat().st_size, int(index[i]["length"])
    with open(path, "ab") as f:
        f.write(data)
    index[i]["offset"], index[i]["length"], index[i]["crc32"] = at, len(data), zlib.crc32(data)
    for name, value in row.items():
        index[i][name] = value
    np.save(root / INDEX, index, allow_pickle=False)
    shard["bytes"] += len(data)
    shard["dead"] = shard.get("dead", 0) + old
    m["bytes"] += len(data)
    m["dead_bytes"] += old
    m.update(manifest or {})
    m["digest"] = logical_digest(index, m["labels_digest"])
    m["index_digest"] = index_digest(index)
    m["manifest_digest"] = manifest_digest(m)
    (root / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True))


def with_payload(root: Path, i: int, k: int, payload: bytes) -> bytes:
    """Record ``i``'s bytes with its ``k``-th field payload replaced."""
    image, payloads = split_record(memoryview(record(root, i)), len(FIELDS))
    parts = [bytes(p) for p in payloads]
    parts[k] = payload
    return join_record(bytes(image), parts)


# ------------------------------------------------------------ item 3: boxes a writer would refuse

BAD_BOXES = {
    "nan": [[5, 10, 25, 30], [np.nan, 20, 60, 40]],
    "inf": [[5, 10, 25, 30], [30, 20, np.inf, 40]],
    "inverted": [[5, 10, 25, 30], [60, 40, 30, 20]],  # both sides: a positive area, survived a crop
}


@pytest.mark.parametrize("bad", BAD_BOXES)
def test_boxes_that_are_not_finite_and_ordered_are_reported_and_refused(detections: Path, bad: str) -> None:
    """A record whose boxes are NaN, inf or inverted (CRCs consistent): verify names the record; every
    read of it (train crops in a batch with DataLoader workers, eval crops, whole images, a
    transform's path) is a DatasetError naming the record; the others read as they did."""
    forge(detections, 2, with_payload(detections, 2, 0, np.array(BAD_BOXES[bad], "<f4").tobytes()))
    result = verify(detections)
    assert not result.ok and result.bad_records == 1
    assert (
        result.problems[0].startswith("record 2 (im2): boxes: box 1 ")
        and "is not finite with x0 <= x1" in (result.problems[0])
    )
    why = r"record 2 \(source 'im2'\): boxes: box 1 \[.*\] is not finite with x0 <= x1 and y0 <= y1"
    for ds in (
        ShardDataset(detections, crop_size=32, train=True, dtype=torch.uint8),
        ShardDataset(detections, crop_size=32, train=False, dtype=torch.uint8),
        ShardDataset(detections, crop_size=None, dtype=torch.uint8),
        ShardDataset(detections, crop_size=32, dtype=torch.uint8, transform=lambda image, fields: (image, fields)),
    ):
        with pytest.raises(DatasetError, match=why):
            ds[2]
        assert ds[3]["id"] == 3 and len(ds[3]["boxes"]) == len(ds[3]["box_labels"]) > 0
    ds = ShardDataset(detections, crop_size=32, train=True, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    with pytest.raises(DatasetError, match=why):
        list(loader)
    assert len(next(iter(DataLoader(torch.utils.data.Subset(ds, [0, 1, 3]), batch_size=3)))["boxes"]) == 3


@pytest.mark.parametrize("bad", ["nan", "inverted"])
def test_show_and_preview_of_a_record_with_bad_boxes_say_one_line(detections: Path, tmp_path: Path, bad: str) -> None:
    """`packer show` and `packer preview` (whole records and training crops), which could die of
    Pillow's error drawing such a box: one line naming the record, exit 1, as for any damaged record."""
    forge(detections, 2, with_payload(detections, 2, 0, np.array(BAD_BOXES[bad], "<f4").tobytes()))
    for args in (
        ["show", detections, 2, "-o", tmp_path / "one.png"],
        ["preview", detections, "-o", tmp_path / "sheet.png", "--n", 6],
        ["preview", detections, "-o", tmp_path / "sheet.png", "--n", 6, "--augment", "--crop-size", 32],
    ):
        run = cli(*args)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and "record 2 (source 'im2'): boxes: box 1" in run.stderr
    assert cli("show", detections, 3, "-o", tmp_path / "three.png").returncode == 0


# ------------------------------------------------------------ item 9: a mask as big as the index says


def test_a_mask_as_big_as_a_hostile_index_row_is_never_expanded(detections: Path) -> None:
    """Record 1's index row says 65,535 x 65,535 (the manifest's short edge raised to allow it) and
    its mask is 14 bytes: two runs covering 65,535 x 65,535 pixels. The image is 48 x 64: every reader
    and verify refuse the record by its image's size before the mask is expanded (4 GiB each time),
    in a child process whose peak memory stays far below that."""
    side = 65_535
    runs = struct.pack("<I", 2) + np.array([side * side - 1, 1], "<u4").tobytes() + bytes([0, 1])
    assert len(runs) == 14
    forge(detections, 1, with_payload(detections, 1, 2, runs), {"short_edge": side}, height=side, width=side)
    script = f"""
import resource, torch
from torch.utils.data import DataLoader
from packer import DatasetError, ShardDataset
from packer.tools.verify import verify
root = {str(detections)!r}
result = verify(root)
print("verify:", result.problems)
for kwargs in (dict(crop_size=32, train=True), dict(crop_size=32, train=False), dict(crop_size=None)):
    try:
        ShardDataset(root, dtype=torch.uint8, **kwargs)[1]
        print("read: served")
    except DatasetError as e:
        print("read:", repr(str(e)))
try:
    list(DataLoader(ShardDataset(root, crop_size=32, dtype=torch.uint8), batch_size=3, num_workers=2))
    print("loader: served")
except DatasetError as e:
    print("loader:", repr(str(e)))  # a worker's: its message, then the worker's traceback
print("peak MiB:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "record 1 (im1): JPEG frame size (48, 64) differs from the index's (65535, 65535)" in lines[0]
    reads = [line for line in lines if line.startswith(("read:", "loader:"))]
    assert len(reads) == 4 and all("record 1 (source " in line and "im1" in line for line in reads), reads
    assert int(lines[-1].split()[-1]) < 1024, lines  # no 4 GiB mask, in this process or its workers
    mask = struct.pack("<I", 2) + np.array([side * side - 2, 1], "<u4").tobytes() + bytes([0, 1])
    forge(detections, 1, with_payload(detections, 1, 2, mask), height=side, width=side)
    assert "record 1 (im1): JPEG frame size" in verify(detections).problems[0]  # the image first, still


# ------------------------------------------------------------ item 8: a manifest's field counts


@pytest.mark.parametrize(
    "per_record",
    [
        {"1": 1_000_000_000},  # np.repeat of this: 8 GB, then the OOM killer
        {"\u00b2": 3},  # str.isdigit() says yes, int() says no
        {"10**30": 3},
        {str(2**62): 6},
        {"01": 6},
        {"2": -1},
        {"2": True},
        {"2": 2.0},
        [6],
    ],
)
def test_field_counts_a_reader_cannot_trust_are_one_line(detections: Path, per_record) -> None:
    """field_counts.boxes.per_record is checked when the manifest is read: decimal keys below 2**60,
    counts adding up to at most the records; `packer info` (and every reader) says one line."""
    m = json.loads((detections / MANIFEST).read_text())
    m["field_counts"]["boxes"]["per_record"] = per_record
    (detections / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="manifest field field_counts is invalid"):
        Manifest.load(detections)
    run = cli("info", detections)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"packer: error: {detections / MANIFEST}: manifest field field_counts is invalid"
    ]


def test_a_histogram_of_far_apart_box_counts_is_drawn_from_its_pairs(detections: Path) -> None:
    """A valid histogram whose keys are far apart (0 and 10**17 boxes) is drawn from its pairs, as
    counts over bins, never expanded to one value per record."""
    m = json.loads((detections / MANIFEST).read_text())
    m["field_counts"]["boxes"]["per_record"] = {"0": 4, str(10**17): 2}
    (detections / MANIFEST).write_text(json.dumps(m))
    run = cli("info", "--json", detections)
    assert run.returncode == 0, run.stderr
    (boxes,) = [f for f in json.loads(run.stdout)["fields"] if f["name"] == "boxes"]
    histogram = boxes["per_record_histogram"]
    assert sum(b["count"] for b in histogram) == 6 and histogram[0] == {
        "lo": 0,
        "hi": 12500000000000000 - 1,
        "count": 4,
    }
