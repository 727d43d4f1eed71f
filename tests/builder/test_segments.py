"""Segments (format 3): a refresh links the old data files and writes only what changed; readers, walks,
verify, info and ``packer compact`` handle datasets whose rows point into several data files; versions
1 and 2 keep opening and refreshing."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import packer.builder.segments
from packer import BuildError, ShardDataset, build
from packer.backends import data_files
from packer.backends.lmdb import close_lmdb
from packer.backends.walk import InOrder, walk
from packer.format import (
    INDEX,
    MANIFEST,
    Digest,
    Manifest,
    index_digest,
    load_index,
    manifest_digest,
    source_path,
)
from packer.read.reader import open_reader
from packer.tools.verify import verify

from ..conftest import BACKEND_NAMES

PACKER = [sys.executable, "-m", "packer.cli"]


def paint(path: Path, cls: int, number: int, size: tuple[int, int] = (40, 32)) -> None:
    """A flat image whose colour encodes its class and number (see :func:`painted`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (40 + 80 * cls, 4 * number, 128)).save(path)


def painted(source: str) -> tuple[int, int]:
    """(class, number) of a source path as :func:`make_raw` and the tests name them."""
    folder, name = source.split("/")
    return int(folder[1:]), int(name[1:4])


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    for number in range(30):
        paint(root / f"c{number % 3}" / f"m{number:03d}.png", number % 3, number)
    return root


def out_path(tmp_path: Path, backend: str, name: str = "d") -> Path:
    return tmp_path / (f"{name}.lmdb" if backend == "lmdb" else name)


def touch_one(raw: Path) -> None:
    """Change one file (new size and mtime, same colour), delete one, add one."""
    paint(raw / "c1" / "m004.png", 1, 4, size=(48, 36))
    (raw / "c2" / "m005.png").unlink()
    paint(raw / "c0" / "m031.png", 0, 31)


def check_pixels(ds: ShardDataset) -> None:
    """Every record's label and colour are those its source path was painted with."""
    for i in range(len(ds)):
        image, label = ds[i]
        cls, number = painted(ds.source(i))
        red, green = image[0].float().mean().item(), image[1].float().mean().item()
        assert label == cls and abs(red - (40 + 80 * cls)) < 6 and abs(green - 4 * number) < 6, (i, ds.source(i))


def same_as_full_rebuild(raw: Path, out: Path, tmp_path: Path, backend: str, **options) -> None:
    full = out_path(tmp_path, backend, "full")
    build(raw, full, backend=backend, workers=1, quiet=True, force=True, **options)
    ma, mb = Manifest.load(out), Manifest.load(full)
    assert ma.digest == mb.digest and ma.count == mb.count and ma.inputs == mb.inputs
    ra, rb = open_reader(out), open_reader(full)
    assert [bytes(b) for b in ra.get_many(list(range(ma.count)))] == [
        bytes(b) for b in rb.get_many(list(range(mb.count)))
    ]
    assert verify(out).ok and verify(full).ok


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_refresh_links_the_old_files_and_writes_only_the_change(raw: Path, tmp_path: Path, backend: str) -> None:
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    before = Manifest.load(out)
    inodes = {name: (out / name).stat().st_ino for name in data_files(before)}
    old_index, old_sources = load_index(out, before)
    gone = sum(int(r["length"]) for r in old_index if source_path(old_sources, r) in ("c1/m004.png", "c2/m005.png"))
    touch_one(raw)
    report = build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
    assert (report.processed, report.reused, report.count) == (2, 28, 30)
    after = Manifest.load(out)
    files = data_files(after)
    assert files[: len(inodes)] == list(inodes) and all((out / n).stat().st_ino == i for n, i in inodes.items())
    new = files[len(inodes) :]
    assert new == (["data-00001.mdb"] if backend == "lmdb" else ["shard-00004.bin"])
    assert after.segments == 2 and [s["count"] for s in after.shards][len(inodes) :] == [2]
    index, _ = load_index(out, after)
    assert after.dead_bytes == gone > 0 and (backend == "lmdb" or gone == after.bytes - int(index["length"].sum()))
    same_as_full_rebuild(raw, out, tmp_path, backend, shard_size=8)
    check_pixels(ShardDataset(out, crop_size=None, dtype=torch.uint8))
    info = json.loads(subprocess.run([*PACKER, "info", str(out), "--json"], capture_output=True, text=True).stdout)
    assert info["segments"] == 2 and info["dead_bytes"] == after.dead_bytes and info["count"] == 30


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_walks_read_every_record_of_a_segmented_dataset_once(raw: Path, tmp_path: Path, backend: str) -> None:
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    touch_one(raw)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    reader = open_reader(out)
    expected = [bytes(b) for b in reader.get_many(list(range(len(index))))]
    close_lmdb(out)
    unused: list[tuple[str, int, int]] = []
    seen = {}
    for i, data, crc in walk(out, manifest, index, lambda *a: unused.append(a)):
        assert data is not None and bytes(data) == expected[i] and crc == zlib.crc32(data) == int(index[i]["crc32"])
        seen[i] = True
    assert sorted(seen) == list(range(len(index)))
    if backend == "lmdb":  # the changed and the deleted file's old records: dead, named by no row
        assert [(name, n) for name, n, _ in unused] == [("data.mdb", 2)]
        assert sum(b for _, _, b in unused) == manifest.dead_bytes
    records = InOrder(out, manifest, index)
    try:
        assert [bytes(records.get(j)[0] or b"") for j in range(len(index))] == expected
        assert bytes(records.get(3)[0] or b"") == expected[3]  # behind the walks: they start again
    finally:
        records.close()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_compact_rewrites_into_one_segment_with_the_same_digest(raw: Path, tmp_path: Path, backend: str) -> None:
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    for k in range(3):
        paint(raw / "c0" / f"m{40 + k:03d}.png", 0, 40 + k)
        (raw / "c1" / f"m{3 * k + 1:03d}.png").unlink()
        build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
    before = Manifest.load(out)
    assert before.segments == 4 and before.dead_bytes > 0
    old = ShardDataset(out, crop_size=None, dtype=torch.uint8)  # a reader of the version compact replaces
    first = [old[i][0].clone() for i in range(len(old))]
    run = subprocess.run([*PACKER, "compact", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "compacted" in run.stderr, run.stderr
    after = Manifest.load(out)
    assert (after.segments, after.dead_bytes, after.digest, after.count) == (1, 0, before.digest, before.count)
    assert after.bytes < before.bytes and after.inputs == before.inputs
    assert len(data_files(after)) == (1 if backend == "lmdb" else 4)
    assert verify(out).ok and all(torch.equal(old[i][0], first[i]) for i in range(len(old)))
    check_pixels(ShardDataset(out, crop_size=None, dtype=torch.uint8))
    up = build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
    assert up.up_to_date  # compact keeps the recorded inputs


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_too_much_dead_rewrites_everything_and_too_many_segments_the_later_ones(
    raw: Path, tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    for path in sorted(raw.rglob("*.png"))[:9]:  # 30% of the records
        path.unlink()
    report = build(raw, out, backend=backend, workers=1, shard_size=8, update=True)
    assert "rewriting every record into one segment" in capsys.readouterr().err and report.reused == 21
    manifest = Manifest.load(out)
    assert (manifest.segments, manifest.dead_bytes) == (1, 0)
    same_as_full_rebuild(raw, out, tmp_path, backend, shard_size=8)
    monkeypatch.setattr(packer.builder.segments, "MAX_SEGMENTS", 3)
    for k in range(3):
        paint(raw / "c0" / f"m{50 + k:03d}.png", 0, 50 + k)
        build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
        assert Manifest.load(out).segments == [2, 3, 2][k]  # then the last two and the new one merge
    assert [s["segment"] for s in Manifest.load(out).shards][-1] == 1
    same_as_full_rebuild(raw, out, tmp_path, backend, shard_size=8)


def test_a_filesystem_without_hard_links_rewrites_with_a_note(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """os.link fails across filesystems (EXDEV; staging sits beside OUT, so here it is made to fail)."""
    out = tmp_path / "d"
    build(raw, out, workers=1, quiet=True, shard_size=8)
    touch_one(raw)

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", no_links)
    report = build(raw, out, workers=1, shard_size=8, update=True)
    assert "cannot hard-link" in capsys.readouterr().err and report.reused == 28
    assert Manifest.load(out).segments == 1
    same_as_full_rebuild(raw, out, tmp_path, "memmap", shard_size=8)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_an_interrupted_refresh_resumes_over_its_links(raw: Path, tmp_path: Path, backend: str) -> None:
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    touch_one(raw)
    for k in range(6):
        paint(raw / "c2" / f"m{60 + k:03d}.png", 2, 60 + k)
    script = (
        "import sys, packer.builder.pipeline as p\n"
        "from packer import build\n"
        "p.CHECKPOINT_RECORDS = 10\n"
        "real = p.Manifest.to_json\n"
        "def boom(self): raise SystemExit(3)\n"
        "p.Manifest.to_json = boom\n"
        "build(sys.argv[1], sys.argv[2], backend=sys.argv[3], workers=1, quiet=True, shard_size=8, update=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(raw), str(out), backend], capture_output=True, text=True)
    assert run.returncode == 3, run.stderr[-800:]
    with pytest.raises(BuildError, match=r"than this resume=True \(use update=True to refresh it, or force=True"):
        build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, resume=True)  # keywords, not flags
    with pytest.raises(BuildError, match=r"cannot resume=True: .* \(update=True\), .* with update=True resume=True"):
        build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, force=True, resume=True)
    report = build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True, resume=True)
    assert report.count == 36
    same_as_full_rebuild(raw, out, tmp_path, backend, shard_size=8)


def as_version_2(root: Path) -> None:
    """Rewrite a one-segment version-3 LMDB dataset as version 2 wrote it (rows at shard 0, offset 0,
    keys in row order, no shard list, the digest over the record bytes): a fixture for the old format."""
    manifest = json.loads((root / MANIFEST).read_text())
    index = np.load(root / INDEX)
    assert manifest["backend"] == "lmdb" and (index["offset"] == np.arange(len(index))).all()
    reader = open_reader(root)
    digest = Digest()
    for i in range(len(index)):
        digest.update(int(index[i]["label"]), bytes(reader.get(i)))
    close_lmdb(root)
    index["offset"] = 0
    np.save(root / INDEX, index, allow_pickle=False)
    manifest.update(
        format_version=2,
        shards=[],
        digest=digest.hexdigest(manifest["labels_digest"]),
        index_digest=index_digest(index),
    )
    for key in ("dead_bytes", "segments"):
        del manifest[key]
    manifest["manifest_digest"] = manifest_digest(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


def test_a_version_2_lmdb_dataset_reads_verifies_and_refreshes_into_segments(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.lmdb"
    build(raw, out, workers=1, quiet=True)
    as_version_2(out)
    assert Manifest.load(out).format_version == 2 and verify(out).ok
    check_pixels(ShardDataset(out, crop_size=None, dtype=torch.uint8))
    touch_one(raw)
    report = build(raw, out, workers=1, quiet=True, update=True)
    manifest = Manifest.load(out)
    assert (
        report.reused == 28 and manifest.format_version == 3 and data_files(manifest) == ["data.mdb", "data-00001.mdb"]
    )
    same_as_full_rebuild(raw, out, tmp_path, "lmdb")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fork_workers_of_the_old_version_read_it_whole_while_a_refresh_lands(
    raw: Path, tmp_path: Path, backend: str
) -> None:
    """A training job's DataLoader reads the old version through a refresh that shares its data files
    (and leaves some of their records dead); a new dataset object reads the new version."""
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8)
    ds = ShardDataset(out, crop_size=None, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
    expected = {i: (ds[i][0].clone(), ds[i][1]) for i in range(len(ds))}
    for epoch in range(2):
        seen = 0
        for b, (images, labels) in enumerate(loader):
            for k in range(len(labels)):
                assert torch.equal(images[k], expected[seen + k][0]) and labels[k] == expected[seen + k][1]
            seen += len(labels)
            if epoch == 0 and b == 0:
                touch_one(raw)
                build(raw, out, backend=backend, workers=1, quiet=True, shard_size=8, update=True)
        assert seen == 30
    new = ShardDataset(out, crop_size=None, dtype=torch.uint8)
    assert new.manifest.segments == 2 and "c2/m005.png" not in [new.source(i) for i in range(len(new))]
    check_pixels(new)
    for i in range(len(ds)):  # the old and the new version in one process, sharing data files
        assert torch.equal(ds[i][0], expected[i][0])
