"""ShardSampler's default order for a dataset in object storage (a real S3 server, SeaweedFS on
127.0.0.1): block order over the cache's units, its window sized to mix the labels and bounded by the
cache limit; the same batches as the local dataset read in that order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packer import ShardDataset, ShardSampler
from packer.read.remote import settings
from packer.read.sampler import MIX_BATCH, MIX_TARGET, label_entropy

from .seaweed import S3Server


def test_a_dataset_in_the_store_is_read_unit_by_unit_mixed(
    class_sorted: Path, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = ShardDataset(class_sorted, crop_size=16)
    mean = float(local.index["length"].mean())
    monkeypatch.setattr(settings, "UNIT_BYTES", int(16.5 * mean))  # units of 16 records: 48 of them
    url = s3_server.upload(class_sorted, "order/sorted")
    ds = ShardDataset(url, crop_size=16, cache_dir=tmp_path / "cache")
    per_unit, limit = ds.fetch_unit() or (0, None)
    assert per_unit == 16 and limit is None and local.fetch_unit() is None
    s = ShardSampler(ds, seed=2)
    assert (s.order, s.block_size) == ("block", per_unit) and ShardSampler(local).order == "random"
    shuffled = label_entropy(ds.labels, np.random.default_rng(5).permutation(len(ds)), MIX_BATCH)
    assert label_entropy(ds.labels, s.sequence(1), MIX_BATCH) >= (MIX_TARGET - 0.03) * shuffled
    assert ShardSampler(ds, order="random").order == "random"  # asked for, as before

    # a whole epoch through 2 workers: the local dataset's batches in the same order
    def batches(d: ShardDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
        order = ShardSampler(d, seed=2, order="block", block_size=s.block_size, window=s.window)
        order.set_epoch(1)
        return list(DataLoader(d, batch_size=MIX_BATCH, sampler=order, num_workers=2))

    got, want = batches(ds), batches(local)
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))

    # a cache limit: the window's units and those fetched ahead fit in it
    unit_bytes = per_unit * mean
    small = ShardDataset(url, crop_size=16, cache_dir=tmp_path / "small", cache_limit=int(unit_bytes * 3 * 4) + 1)
    bounded = ShardSampler(small)
    assert bounded.window * unit_bytes * (bounded.prefetch + 2) <= small.fetch_unit()[1]
    assert bounded.window == 4 < s.window
