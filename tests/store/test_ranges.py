"""Records read past the cache (packer.read.remote.ranges), from a real S3 server (SeaweedFS on
127.0.0.1) through the fault proxy: a batch whose units the cache limit cannot hold reads just its
records of them, as byte ranges, checked; any order works down to the limit refused at open."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packer import MixDataset, ShardDataset, ShardSampler
from packer.format import DatasetError

from .du import du_peak
from .proxy import Faults, Proxy
from .seaweed import S3Server
from .test_s3 import _files, _least_limit, photo_copies, same_epochs
from .test_s3 import small_shards as small_shards  # the fixture: 18 shards of 4 records


def _name(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _past_reads(proxy: Proxy, sizes: dict[str, int]) -> int:
    """GETs of a shard's bytes that asked for less than one of its units (whole shards here)."""
    short = 0
    for key, ranges in proxy.ranges.items():
        name = _name(key)
        for asked in ranges if name in sizes else ():
            first, _, last = asked.removeprefix("bytes=").partition("-")
            short += bool(asked) and int(last) + 1 - int(first) < sizes[name]
    return short


@pytest.mark.parametrize("limit", ["least", "half"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_random_order_through_a_small_cache(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, context: str, limit: str
) -> None:
    """A global shuffle, 2 workers, batches of 8 records of 8 shards each: the batches in flight
    need more units than a cache of half the data (or the least limit the open accepts: one unit)
    holds. They read what has no room past the cache, for two epochs: the batches equal a local
    run's, the cache, sampled as ``du`` counts it throughout, never exceeds the limit, and records
    were read as ranges shorter than their unit."""
    sizes = _files(small_shards)
    url = s3_server.upload(small_shards, f"ranges/{context}-{limit}")
    cache = tmp_path / "cache"
    least, _ = _least_limit(url, cache)
    bytes_limit = least if limit == "least" else sum(sizes.values()) // 2
    with du_peak(cache) as highest:
        remote = ShardDataset(url, crop_size=16, seed=5, cache_dir=cache, cache_limit=bytes_limit)
        local = ShardDataset(small_shards, crop_size=16, seed=5)
        sampler = ShardSampler(remote, seed=0, order="random")
        want_sampler = ShardSampler(local, seed=0, order="random")
        loader = DataLoader(
            remote,
            batch_size=8,
            sampler=sampler,
            num_workers=2,
            multiprocessing_context=context,
            persistent_workers=True,
        )
        same_epochs(loader, sampler, local, want_sampler, 9)
    assert 0 < max(highest) <= bytes_limit, (highest, bytes_limit)
    assert _past_reads(proxy, sizes) > 0


@pytest.fixture(scope="module")
def sixteen_a_shard(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A memmap dataset of 144 records (the photos eight times over) in nine shards (units) of 16."""
    return photo_copies(raw_photos, tmp_path_factory.mktemp("sixteen"), copies=8, shard_size=16)


@pytest.mark.parametrize(
    ("workers", "context", "mix"), [(0, None, False), (2, "fork", False), (2, "spawn", False), (2, "fork", True)]
)
def test_a_global_shuffle_through_half_a_cache_fetches_each_record_once(
    sixteen_a_shard: Path,
    s3_server: S3Server,
    proxy: Proxy,
    tmp_path: Path,
    workers: int,
    context: str | None,
    mix: bool,
) -> None:
    """A global shuffle's batches of 16 lie in ~8 of the 9 units, a cache of half the data holds 4:
    the units it has are kept (for this epoch's draws of them and the next's) and the others'
    records read past it, so the first epoch fetches the data about once and the second about the
    part not cached, in this process and in DataLoader workers (which evict by the sampler's
    order too; ``mix``: the dataset a member of a MixDataset beside a local one, whose draws it
    does not read), batches equal to a local run's. Before, each batch evicted whole units for a
    record or two each: several times the data an epoch."""
    sizes = _files(sixteen_a_shard)
    data = sum(sizes.values())
    url = s3_server.upload(sixteen_a_shard, f"shuffle/{workers}-{context}-{mix}")
    cache, limit = tmp_path / "cache", data // 2
    local = ShardDataset(sixteen_a_shard, crop_size=16, seed=5)
    fetched = []
    with du_peak(cache) as highest:
        remote = ShardDataset(url, crop_size=16, seed=5, cache_dir=cache, cache_limit=limit)
        read, want_read = (MixDataset([remote, local]), MixDataset([local, local])) if mix else (remote, local)
        sampler, want = ShardSampler(read, seed=0, order="random"), ShardSampler(want_read, seed=0, order="random")
        loader = DataLoader(
            read,
            batch_size=16,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context=context,
            persistent_workers=bool(workers),
        )
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want.set_epoch(epoch)
            got, wanted = list(loader), list(DataLoader(want_read, batch_size=16, sampler=want))
            assert len(got) == len(wanted) == 9 * (1 + mix)
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, wanted))
            proxy.settle()
            fetched.append(sum(proxy.fetched(name) for name in sizes) / data)
            proxy.clear()
    assert 0 < max(highest) <= limit, (highest, limit)
    assert fetched[0] <= 1.05 and fetched[1] <= 0.7, fetched


def test_records_read_past_the_cache_are_checked(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A cache of one unit, a batch of records of every shard: all but one shard's are read past
    the cache. A damaged range is read again (its records' CRC-32s); a store that damages every
    response fails in one line naming the object and the record, and serves no byte of it."""
    url = s3_server.upload(small_shards, "ranges/checked")
    least, _ = _least_limit(url, tmp_path / "cache")
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache", cache_limit=least)
    local = ShardDataset(small_shards, crop_size=None, dtype=torch.uint8)
    batch = list(range(0, len(local), 3))
    proxy.faults.append(Faults(match="shard-00005", corrupt=1))
    got = remote.__getitems__(batch)
    assert all(torch.equal(g[0], local[i][0]) and g[1] == local[i][1] for g, i in zip(got, batch, strict=True))
    assert _past_reads(proxy, _files(small_shards)) > 0 and proxy.faults[0].seen >= 2
    proxy.faults[:] = [Faults(match="shard-00007", corrupt=-1)]
    damaged = r"shard-00007\.bin: record \d+: CRC-32 differs .* after 3 (reads|downloads)$"
    with pytest.raises(DatasetError, match=damaged):
        remote.__getitems__([i for i in range(len(local)) if local.index["shard"][i] == 7] + batch)


def _in_cache(cache: Path, names: dict[str, int]) -> set[str]:
    """The data files whose whole unit is in the cache's version folder."""
    return {p.name for p in cache.glob("*/versions/*/*") if p.name in names}


def test_release_keeps_the_records_another_batch_read_past(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """Two batches read in two threads of one process: the one that ends first lets go of the
    units, and of its own records read past the cache, not of the other's (which it still reads,
    and would otherwise GET again, one record at a time)."""
    url = s3_server.upload(small_shards, "ranges/release")
    least, _ = _least_limit(url, tmp_path / "cache")
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache", cache_limit=least)
    client = remote._remote
    assert client is not None
    records = np.arange(0, len(remote), 3, dtype=np.int64)
    read, ended = threading.Event(), threading.Event()
    kept: list[int] = []

    def first() -> None:
        client.prefetch(records, wait=True)
        read.set()
        assert ended.wait(120)  # bounds a hang only
        kept.append(len(client._batch_past()))
        client.release()

    def second() -> None:
        assert read.wait(120)  # bounds a hang only
        client.prefetch(records[:1], wait=True)
        client.release()
        kept.append(len(client._batch_past()))
        ended.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    # the second's own records gone; the first's kept: all but those of the one unit the cache holds
    assert kept[0] == 0 and kept[1] >= len(records) - 2, kept
