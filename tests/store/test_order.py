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

from .proxy import Faults, Proxy
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


def _rank_epoch(url: str, cache: str, rank: int, order: str, env: dict[str, str], unit_bytes: int) -> None:
    """One DDP rank of a node: 2 DataLoader workers over the node cache (a spawned process)."""
    import os

    os.environ.update(env)
    settings.UNIT_BYTES = unit_bytes
    ds = ShardDataset(url, crop_size=16, seed=1, cache_dir=cache)
    sampler = ShardSampler(ds, seed=1, order=order, num_replicas=2, rank=rank)
    for _ in DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2):
        pass


@pytest.mark.parametrize("order", ["block", "random"])
def test_two_ranks_of_a_node_fetch_each_unit_once(
    class_sorted: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, order: str
) -> None:
    """2 ranks x 2 workers on one node cache, whatever the order: every byte of the data is fetched once."""
    import multiprocessing as mp
    import os

    from packer.backends import data_files
    from packer.format import Manifest

    unit_bytes = int(16.5 * float(ShardDataset(class_sorted, crop_size=16).index["length"].mean()))  # 48 units
    url = s3_server.upload(class_sorted, f"order/ranks-{order}")
    proxy.faults.append(Faults(delay=0.02, rate=2e6))  # slow enough that the ranks' fetches overlap
    ranks = [
        mp.get_context("spawn").Process(
            target=_rank_epoch, args=(url, str(tmp_path / "cache"), r, order, dict(os.environ), unit_bytes)
        )
        for r in range(2)
    ]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(120)
        assert r.exitcode == 0
    for name in data_files(Manifest.load(class_sorted)):
        assert proxy.fetched(name) == (class_sorted / name).stat().st_size, name
