"""ShardDataset through real DataLoaders (fork and spawn workers) on datasets built from the real photos."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

from packer import DatasetError, codec
from packer.format import lmdb_key
from packer.read.dataset import ShardDataset
from packer.transform import IMAGENET_MEAN, IMAGENET_STD, to_device

from ..conftest import COMBOS

CROP = 64
Batch = tuple[torch.Tensor, torch.Tensor]


def load(ds: ShardDataset, workers: int = 0, ctx: Optional[str] = None, **kw: Any) -> list[Batch]:
    """Every batch of one pass, in order (no shuffle: worker-count independence is about the fetch)."""
    loader = DataLoader(ds, batch_size=4, num_workers=workers, multiprocessing_context=ctx if workers else None, **kw)
    return list(loader)


def same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_batches_shapes_ranges_labels(built, backend: str, fmt: str) -> None:
    ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=1)
    batches = load(ds)
    assert sum(len(b[1]) for b in batches) == len(ds) == 18
    lo = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    hi = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    for images, labels in batches:
        assert images.shape[1:] == (3, CROP, CROP) and images.dtype == torch.float32
        assert lo - 1e-5 <= images.min() and images.max() <= hi + 1e-5
        assert labels.dtype == torch.int64
    label_ids = torch.cat([b[1] for b in batches]).numpy()
    assert (label_ids == ds.labels).all()
    assert ds.classes == ["landscape", "portrait"]
    assert [ds.classes[y] for y in label_ids] == [ds.source(i).split("/")[0] for i in range(len(ds))]

    u8 = load(ShardDataset(ds.root, crop_size=CROP, seed=1, dtype=torch.uint8))
    assert all(b[0].dtype == torch.uint8 and b[0].shape[1:] == (3, CROP, CROP) for b in u8)
    assert u8[0][0].float().std() > 10  # real picture content, not a constant fill
    # The float path is the uint8 path normalized; to_device does the same arithmetic.
    assert torch.equal(to_device(u8[0][0], "cpu"), batches[0][0])

    whole = ShardDataset(ds.root, crop_size=None, dtype=torch.uint8)
    img = whole[0].image
    row = whole.index[0]
    assert img.shape == (3, row["height"], row["width"]) and min(img.shape[1:]) == 320
    with pytest.MonkeyPatch.context() as m:  # packer's binding decodes as PyTurboJPEG does, pixel for pixel
        m.setattr(codec, "_native", None)
        assert torch.equal(whole[0][0], img)

    ev = ShardDataset(ds.root, crop_size=CROP, train=False)
    e0 = ev[5][0]
    ev.set_epoch(3)
    assert e0.shape == (3, CROP, CROP) and torch.equal(e0, ev[5][0])  # eval crops ignore the epoch


@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_fork_workers_match_in_process_and_epochs_differ(built, backend: str, fmt: str) -> None:
    ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=7, dtype=torch.uint8)
    ds[0]  # the notebook pattern: the parent opens its handles before the workers fork
    base = load(ds)
    assert same(base, load(ds, workers=2, ctx="fork"))
    ds.set_epoch(1)
    other = load(ds, workers=2, ctx="fork")
    assert not any(torch.equal(x[0], y[0]) for x, y in zip(base, other))
    assert same(other, load(ds))
    assert not same(load(ShardDataset(ds.root, crop_size=CROP, seed=8, dtype=torch.uint8)), load(ds))


def test_spawn_persistent_workers_follow_set_epoch(built) -> None:
    """set_epoch after persistent workers started still changes their crops (shared-memory epoch)."""
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=CROP, seed=3)
    ds[1]
    expected = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        expected.append(load(ds))
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        assert same(list(loader), expected[epoch])


def test_pickle_round_trip_before_and_after_use(built) -> None:
    for backend, fmt in (("lmdb", "jpeg"), ("memmap", "raw")):
        ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=2)
        ds.set_epoch(4)
        fresh = pickle.loads(pickle.dumps(ds))
        first = ds[3]
        used = pickle.loads(pickle.dumps(ds))
        for copy in (fresh, used):
            assert copy.epoch == 4 and torch.equal(copy[3][0], first[0]) and copy[3][1] == first[1]


def test_two_datasets_over_one_path(built) -> None:
    """Train and eval views of one LMDB in one process, and both again inside forked workers."""
    path = built("lmdb", "raw")
    train = ShardDataset(path, crop_size=CROP, dtype=torch.uint8)
    evaluation = ShardDataset(path, crop_size=CROP, train=False, dtype=torch.uint8)
    a, b = train[2], evaluation[2]
    assert a[1] == b[1] and not torch.equal(a[0], b[0])
    assert same(load(train, workers=2, ctx="fork"), load(train))
    assert same(load(evaluation, workers=2, ctx="fork"), load(evaluation))


def test_a_reopen_takes_the_new_versions_verify_default(built, tmp_path: Path) -> None:
    """``verify`` not asked follows the record format of the version read: a dataset reopened
    (ShardSampler's agreement of DDP ranks) onto a version of another format takes that format's
    default (JPEG: CRC-32 on read; raw pixels: off), an asked one stays."""
    out = shutil.copytree(built("memmap", "jpeg"), tmp_path / "out")
    default, asked = ShardDataset(out, crop_size=CROP), ShardDataset(out, crop_size=CROP, verify=True)
    assert default.verify and asked.verify
    shutil.rmtree(out)
    shutil.copytree(built("memmap", "raw"), out)  # rebuilt in place with --force, as raw pixels
    for ds in (default, asked):
        ds._reopen()
        assert ds.manifest.format == "raw" and ds[0][0].shape == (3, CROP, CROP)
    assert not default.verify and asked.verify
    assert not pickle.loads(pickle.dumps(default)).verify  # a worker's copy reads it alike


def test_samplers(built) -> None:
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=CROP, dtype=torch.uint8)
    counts = ds.class_counts()
    assert counts.tolist() == [9, 9] and counts.sum() == len(ds)
    weights = ds.sample_weights()
    assert np.allclose(np.bincount(ds.labels, weights), 1.0)
    sampler = WeightedRandomSampler(weights.tolist(), num_samples=8, generator=torch.Generator().manual_seed(0))
    images, labels = next(iter(DataLoader(ds, batch_size=8, sampler=sampler)))
    assert images.shape == (8, 3, CROP, CROP) and labels.shape == (8,)


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_jpeg_record_names_dataset_record_and_source(built, tmp_path: Path) -> None:
    path = copy_dataset(built("memmap", "jpeg"), tmp_path / "ds")
    ds = ShardDataset(path, crop_size=CROP)
    row = ds.index[5]
    shard = path / ds.manifest.shards[int(row["shard"])]["file"]
    with open(shard, "r+b") as f:  # damage the middle of the entropy-coded data
        f.seek(int(row["offset"]) + int(row["length"]) // 2)
        f.write(b"\x00" * 64)
    for verify in (True, False):
        ds = ShardDataset(path, crop_size=CROP, verify=verify)
        ds[4]  # neighbours are unaffected
        if verify:
            with pytest.raises(DatasetError, match="CRC-32") as e:
                ds[5]
            assert str(path) in str(e.value) and "record 5" in str(e.value) and ds.source(5) in str(e.value)
    with open(shard, "r+b") as f:  # a broken header fails even without the CRC check
        f.seek(int(row["offset"]))
        f.write(b"\x00" * 16)
    with pytest.raises(DatasetError, match=r"record 5 .*corrupt JPEG data"):
        ShardDataset(path, crop_size=CROP, verify=False)[5]
    with pytest.raises(DatasetError, match="record 5"):
        load(ShardDataset(path, crop_size=CROP), workers=2, ctx="fork")


def test_corrupt_raw_records(built, tmp_path: Path) -> None:
    """Damage inside an LMDB value (found by plain py-lmdb, closed again before packer opens the path)."""
    path = copy_dataset(built("lmdb", "raw"), tmp_path / "damaged")
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(lmdb_key(3))
    env.close()
    data = path / "data.mdb"
    blob = data.read_bytes()
    assert value is not None
    at = blob.index(value[:4096]) + 100
    data.write_bytes(blob[:at] + bytes(64) + blob[at + 64 :])
    with pytest.raises(DatasetError, match=r"record 3 \(source 'landscape/Landscape_3.jpg'\): CRC-32"):
        ShardDataset(path, crop_size=CROP, verify=True)[3]

    path = copy_dataset(built("lmdb", "raw"), tmp_path / "short")
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:  # a value whose length disagrees with the index
        txn.put(lmdb_key(6), b"short")
    env.close()
    with pytest.raises(DatasetError, match=r"record 6 \(source .*\): .*5 bytes"):
        ShardDataset(path, crop_size=CROP)[6]


def test_truncated_memmap_shard(built, tmp_path: Path) -> None:
    path = copy_dataset(built("memmap", "raw"), tmp_path / "ds")
    ds = ShardDataset(path, crop_size=CROP)
    last = ds.manifest.shards[-1]["file"]
    os.truncate(path / last, 10)
    ds[0]
    with pytest.raises(DatasetError, match=re.escape(f"{path}: record 17 (source ") + ".*truncated"):
        ds[17]


def test_index_errors(built) -> None:
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=CROP, dtype=torch.uint8)
    assert torch.equal(ds[-1][0], ds[17][0])
    with pytest.raises(IndexError):
        ds[18]
    with pytest.raises(ValueError, match=r"dtype must be torch\.uint8 or a floating type"):
        ShardDataset(ds.root, dtype=torch.int32)
