"""ShardDataset from a real S3 server (SeaweedFS on 127.0.0.1), directly and through the fault proxy:
the same samples as the local dataset, each data file fetched once per node and checked first."""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from packer import MixDataset, ShardDataset, ShardSampler, build
from packer.backends import BACKENDS, data_files
from packer.format import MANIFEST, DatasetError, Manifest
from packer.read.remote import Remote, checks, local_version, settings
from packer.read.remote import turns as remote_turns
from packer.read.remote.eviction import _version_held, evict_version
from packer.read.remote.locks import locked as cache_lock
from packer.read.remote.paths import VERSIONS
from packer.store import StoreError
from packer.store.base import PerProcess

from .du import du_peak, on_disk
from .furthest import furthest_future_bytes
from .proxy import Faults, Proxy, serve_folder
from .redteam import in_time
from .seaweed import S3Server


@pytest.fixture(autouse=True)
def _fresh_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's prefetches take turns from a fresh start: the process's turns keep the stream
    rates and the readers' pace they measured, and an earlier test's could widen this one's (two
    released at once send their GETs in either order)."""
    monkeypatch.setattr(remote_turns, "process_turns", PerProcess(remote_turns.Turns))


def _same(a: ShardDataset, b: ShardDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x[0], y[0]) and x[1] == y[1]


def same_order(local: ShardDataset, remote: ShardSampler) -> ShardSampler:
    """A sampler of the local copy in the order the store's default sampler took (block order there)."""
    return ShardSampler(local, seed=remote.seed, order=remote.order, block_size=remote.block_size, window=remote.window)


def _files(local: Path) -> dict[str, int]:
    manifest = Manifest.load(local)
    return {name: (local / name).stat().st_size for name in data_files(manifest)}


@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_s3_dataset_reads_as_local(built, s3_server: S3Server, tmp_path: Path, backend: str) -> None:
    local = built(backend, "jpeg")
    url = s3_server.upload(local, f"same/{backend}")
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
    assert remote.root == url and len(remote) == 18
    _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))


@pytest.mark.parametrize("backend,context", [("lmdb", "fork"), ("memmap", "spawn"), ("memmap", "forkserver")])
def test_workers_fetch_each_file_once(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, backend, context):
    """Two DataLoader workers (and a second dataset object of the same node cache) download each data
    file exactly once between them, and the batches equal a local run's."""
    local = built(backend, "raw")
    url = s3_server.upload(local, f"workers/{backend}-{context}")
    cache = tmp_path / "cache"
    remote = ShardDataset(url, crop_size=32, seed=3, cache_dir=cache)
    loader = DataLoader(remote, batch_size=4, num_workers=2, multiprocessing_context=context, persistent_workers=True)
    got = [b for _ in range(2) for b in loader]
    want = list(DataLoader(ShardDataset(local, crop_size=32, seed=3), batch_size=4)) * 2
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    again = ShardDataset(url, crop_size=32, seed=3, cache_dir=cache)
    _same(again, remote)
    for name, size in _files(local).items():
        assert proxy.fetched(name) == size, name  # once per node: the lock holder's download only


def test_workers_reach_the_store_their_parent_resolved(
    built, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose environment lacks the AWS variables (a forkserver started before a script set
    them, as a build's earlier in the same process does) reads from the endpoint, with the keys, that
    the dataset was opened with: seen in CI as workers asking AWS itself for a SeaweedFS bucket."""
    local = built("memmap", "jpeg")
    url = s3_server.upload(local, "settings/memmap")
    remote = ShardDataset(url, crop_size=32, seed=3, cache_dir=tmp_path / "cache")
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    loader = DataLoader(remote, batch_size=6, num_workers=1, multiprocessing_context="spawn")
    want = DataLoader(ShardDataset(local, crop_size=32, seed=3), batch_size=6)
    for g, w in zip(loader, want, strict=True):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


def test_faults_retried_resumed_and_batches_identical(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path):
    """503 SlowDown, resets mid-body and bodies cut short are retried; a broken transfer resumes from
    the byte it reached (its next Range starts there); every sample equals the local one."""
    local = built("memmap", "jpeg")
    url = s3_server.upload(local, "faults/memmap")
    proxy.faults.append(Faults(match="shard-", fail=2, reset=2, truncate=2))
    proxy.faults.append(Faults(match="index.npy", fail=1, truncate=1))
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
    _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))
    resumed = [r for key, rs in proxy.ranges.items() if "shard-" in key for r in rs if not r.startswith("bytes=0-")]
    assert resumed, proxy.ranges  # a retry after a cut body asked for the rest only


def test_damaged_object_refetched_then_named(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """A byte flipped on the way is caught by the record CRC-32s and fetched again; an object damaged
    in the store fails after a few downloads with a DatasetError naming it, and no sample is served."""
    local = built("lmdb", "jpeg")
    url = s3_server.upload(local, "damaged/lmdb")
    proxy.faults.append(Faults(match="data.mdb", corrupt=1))
    _same(
        ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "a"),
        ShardDataset(local, crop_size=None, dtype=torch.uint8),
    )
    assert proxy.gets("data.mdb") >= 2
    proxy.clear()
    proxy.faults.append(Faults(match="data.mdb", corrupt=-1))
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "b")
    with pytest.raises(DatasetError, match=r"damaged/lmdb/data\.mdb: .*after 3 downloads"):
        ds[0]
    assert not list((tmp_path / "b").glob("*/units/data.mdb*"))


def test_damaged_range_refetched_then_named(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    """A memmap unit is a range of a shard, checked by its records' CRC-32s before any decoder sees
    it: a byte flipped on the way is fetched again (that range only); a range damaged in the store
    fails with a DatasetError naming the object and the range, and no sample is served."""
    local = built("memmap", "jpeg")
    here = ShardDataset(local, crop_size=None, dtype=torch.uint8)
    monkeypatch.setattr(settings, "UNIT_BYTES", 2 * int(here.index["length"].mean()))
    url = s3_server.upload(local, "damaged/memmap-ranges")
    proxy.faults.append(Faults(match="shard-00001", corrupt=1))
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "a")
    _same(ds, here)
    assert ds._remote._units is not None
    ranges = [key for key in ds._remote._units.keys if key.startswith("shard-00001.bin@")]
    assert ranges and proxy.gets("shard-00001.bin") == len(ranges) + 1
    assert proxy.fetched("shard-00001.bin") - _files(local)["shard-00001.bin"] < _files(local)["shard-00001.bin"]
    proxy.clear()
    proxy.faults.append(Faults(match="shard-00001", corrupt=-1))
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "b")
    with pytest.raises(DatasetError, match=r"memmap-ranges/shard-00001\.bin \(bytes \d+-\d+\): .*after 3 downloads"):
        ds[8]


def test_missing_and_forbidden_fail_at_once(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    local = built("memmap", "raw")
    url = s3_server.upload(local, "missing/memmap")
    with pytest.raises(DatasetError, match="not a packer dataset"):
        ShardDataset(url + "-nothing", cache_dir=tmp_path / "c")
    s3_server.client.delete_object(Bucket=s3_server.bucket, Key="missing/memmap/shard-00001.bin")
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "c")
    ds[0]
    with pytest.raises(DatasetError, match=r"missing/memmap/shard-00001\.bin: missing"):
        ds[10]
    missing = "/packer/missing/memmap/shard-00001.bin"
    assert proxy.requests["GET", missing] == 1 and not proxy.requests["HEAD", missing]  # no retries of a 404
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StoreError, match="access denied"):
        ShardDataset(url, cache_dir=tmp_path / "d")


def test_refresh_reuses_segments_and_pins_version(raw_photos: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path):
    """A dataset refreshed in the bucket opens as its new version, downloading only the new segment;
    the dataset opened before keeps reading its own version."""
    raw = tmp_path / "raw"
    shutil.copytree(raw_photos, raw)
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    url = s3_server.upload(out, "refresh/lmdb")
    cache = tmp_path / "cache"
    old = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
    old_local = [old[i] for i in range(len(old))]
    (raw / "landscape" / "extra.jpg").write_bytes(next((raw / "portrait").iterdir()).read_bytes())
    build(raw, out, workers=1, quiet=True, update=True)
    assert len(data_files(Manifest.load(out))) == 2
    s3_server.upload(out, "refresh/lmdb")
    proxy.clear()
    new = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
    assert len(new) == len(old) + 1
    _same(new, ShardDataset(out, crop_size=None, dtype=torch.uint8))
    assert proxy.fetched("data.mdb") == 0 and proxy.fetched("data-00001.mdb") > 0  # the old segment reused
    for i, (image, label) in enumerate(old_local):  # the first dataset still reads its own version
        assert torch.equal(old[i][0], image) and old[i][1] == label


def test_cache_limit_waits_for_holders_then_refuses(
    built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch
):
    """An LMDB reader holds the segments of the batch it is reading until the batch is done: a
    download that finds no room waits for it (the deadline: $PACKER_CACHE_WAIT), then fails in one line naming
    a limit that works; a dataset opened with that limit reads while the batch still holds its
    files, and once the batch is done its files may be evicted."""
    local = built("lmdb", "jpeg")
    sizes = _files(local)
    url = s3_server.upload(local, "limit/lmdb")
    cache = tmp_path / "cache"
    limit = sum(sizes.values()) + min(sizes.values()) - 1  # one dataset fits, not a unit more
    reading, finish = threading.Event(), threading.Event()

    def hold(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch stays open (its files held) until the test says so."""
        reading.set()
        assert finish.wait(60)
        return images, labels

    first = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=limit)
    _same(first, ShardDataset(local, crop_size=None, dtype=torch.uint8))
    holder = ShardDataset(url, crop_size=8, cache_dir=cache, cache_limit=limit, batch_transform=hold)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        batch = pool.submit(holder.__getitems__, list(range(len(holder))))  # every segment, held
        assert reading.wait(60)
        other = s3_server.upload(local, "limit/lmdb-copy")
        monkeypatch.setenv("PACKER_CACHE_WAIT", "0.5")
        with pytest.raises(DatasetError) as refused:
            ShardDataset(other, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=limit)[17]
        monkeypatch.delenv("PACKER_CACHE_WAIT")
        message = str(refused.value)
        found = re.search(
            r"too small for the batches read at once: at least (\d+) bytes would work \(.* held by", message
        )
        assert found and "\n" not in message, message
        works = int(found.group(1))
        assert works > limit
        second = ShardDataset(other, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=works)
        _same(second, ShardDataset(local, crop_size=None, dtype=torch.uint8))  # beside the held batch
        finish.set()
        assert len(batch.result(60)) == len(holder)
    assert max(on_disk(cache)) <= works
    third = ShardDataset(
        s3_server.upload(local, "limit/lmdb-third"),
        crop_size=None,
        dtype=torch.uint8,
        cache_dir=cache,
        cache_limit=limit,
    )
    _same(third, ShardDataset(local, crop_size=None, dtype=torch.uint8))  # the batch done: its files evicted
    assert _cached(cache) <= limit
    assert os.environ["AWS_ENDPOINT_URL"] == proxy.url


def test_cache_limit_that_cannot_work_refused_at_once(built, s3_server: S3Server, tmp_path: Path) -> None:
    """A limit below the largest unit and what the cache keeps of the version fails as the dataset
    is opened, in one line that names the limit that would work; that limit does."""
    local = built("memmap", "jpeg")
    url = s3_server.upload(local, "limit/tiny")
    largest = max(_files(local).items(), key=lambda item: item[1])
    with pytest.raises(DatasetError) as refused:
        ShardDataset(url, cache_dir=tmp_path / "cache", cache_limit=largest[1])
    message = str(refused.value)
    assert "\n" not in message and f"{largest[0]} takes" in message, message
    found = re.match(
        rf"cache_limit {largest[1]} bytes is too small for {url}: at least (\d+) bytes would work", message
    )
    assert found, message
    least = int(found.group(1))
    with pytest.raises(DatasetError, match="too small"):
        ShardDataset(url, cache_dir=tmp_path / "cache", cache_limit=least - 1)
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache", cache_limit=least)
    _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))
    assert max(on_disk(tmp_path / "cache")) <= least


def test_failed_download_gives_its_room_back(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    """A download that failed leaves its reserved part for a later resume; when another unit needs
    the room of a cache of one unit, that part (no process downloading it) goes, not the reader."""
    monkeypatch.setattr("packer.store.base.ATTEMPTS", 2)
    monkeypatch.setattr("packer.store.base.BACKOFF_S", 0.01)
    local = built("memmap", "raw")
    sizes = _files(local)
    url = s3_server.upload(local, "limit/stale")
    cache = tmp_path / "cache"
    least, _ = _least_limit(url, cache)  # a cache of one unit
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=least)
    proxy.faults.append(Faults(match="shard-00000", fail=2))
    with pytest.raises(StoreError, match=r"shard-00000\.bin: failed 2 times"):
        ds[0]
    units = ds._remote._units  # record 0's unit: shard-00000's first range (units of 2 MiB or more)
    assert units is not None and _cached(cache) == int(units.sizes[units.of[0]])  # reserved, kept for a resume
    local_ds = ShardDataset(local, crop_size=None, dtype=torch.uint8)
    assert torch.equal(ds[10][0], local_ds[10][0])  # shard-00001: the stale part made room
    assert torch.equal(ds[0][0], local_ds[0][0]) and _cached(cache) <= max(sizes.values())
    assert max(on_disk(cache)) <= least


def _least_limit(url: str, cache: Path) -> tuple[int, int]:
    """The least cache_limit that works for ``url`` in ``cache`` (one unit, and what the cache keeps
    of the version: the refusal of a limit of one byte names both), and the latter."""
    with pytest.raises(DatasetError) as refused:
        ShardDataset(url, cache_dir=cache, cache_limit=1)
    found = re.search(r"at least (\d+) bytes would work .* the versions the cache keeps (\d+)\)", str(refused.value))
    assert found, refused.value
    return int(found.group(1)), int(found.group(2))


def _room(size: int) -> int:
    """The room a cached unit of ``size`` bytes takes as ``du`` counts it: its blocks, and its
    sidecar's (the records it was checked for: a block for a unit of a few records)."""
    return -(-size // 4096) * 4096 + 4096


@pytest.fixture(scope="module")
def small_shards(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A memmap dataset of eighteen shards of four records (the photos four times over)."""
    return photo_copies(raw_photos, tmp_path_factory.mktemp("small"), copies=4, shard_size=4)


def photo_copies(raw_photos: Path, root: Path, *, copies: int, shard_size: int) -> Path:
    """A memmap JPEG dataset under ``root`` of the photos ``copies`` times over, in shards of ``shard_size``."""
    for copy in range(copies):
        shutil.copytree(raw_photos, root / "photos" / f"copy{copy}")
    out = root / "jpeg-memmap"
    build(root / "photos", out, backend="memmap", format="jpeg", workers=1, quiet=True, shard_size=shard_size)
    return out


def _cached(cache: Path) -> int:
    """Bytes the cache's units and downloads take."""
    found = [*cache.glob("*/units/*"), *cache.glob("*/partial/*")]
    return sum(_size(p) for p in found if not p.name.endswith((".rows.npy", ".parts")))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # evicted meanwhile
        return 0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_epoch_in_a_cache_of_three_units(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, context
):
    """Two workers read two epochs through a cache of three shards of nine: the batches equal a local
    run's, and the cache, polled throughout, never exceeds the limit."""
    sizes = _files(small_shards)
    url = s3_server.upload(small_shards, f"evict/{context}")
    cache = tmp_path / "cache"
    limit = _least_limit(url, cache)[0] + 2 * _room(max(sizes.values()))
    remote = ShardDataset(url, crop_size=16, seed=5, cache_dir=cache, cache_limit=limit)
    local = ShardDataset(small_shards, crop_size=16, seed=5)
    highest = [0]
    done = threading.Event()

    def poll() -> None:
        """Under the lock that every count and change of the cache takes: one consistent view. Taken
        as remote takes it: a worker forked while this thread holds it closes its copy at once (one
        opened plainly stays held in the child for good: every reader of the cache waits on it)."""
        while not done.is_set():
            if cache.exists():
                with cache_lock(cache / ".evict.lock"):
                    highest[0] = max(highest[0], _cached(cache))
            time.sleep(0.005)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        sampler = ShardSampler(remote, order="block", block_size=2, window=2, seed=7)
        loader = DataLoader(remote, batch_size=3, sampler=sampler, num_workers=2, multiprocessing_context=context)
        want_sampler = ShardSampler(local, order="block", block_size=2, window=2, seed=7)
        want_loader = DataLoader(local, batch_size=3, sampler=want_sampler)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want_sampler.set_epoch(epoch)
            got, want = list(loader), list(want_loader)
            assert len(got) == len(want) == 24
            for g, w in zip(got, want):
                assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    finally:
        done.set()
        watcher.join()
    assert 0 < highest[0] <= limit
    assert sum(proxy.fetched(name) for name in sizes) > sum(sizes.values())  # it had to evict and fetch again


def test_fetched_unit_opened_before_another_thread_may_let_go_of_it(
    small_shards: Path, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's units download in threads, and one that finds no room lets go of every unit the
    process holds (Remote.release): a kept hold is another thread's to close at once. A fetch
    that opened the descriptor it returns through ``/proc/self/fd/<hold>`` after keeping the hold
    failed with FileNotFoundError when a release came between the two (or opened whatever file had
    taken the number since). Deterministic: every hold is let go of the moment it is kept, as such
    a thread may; every sample still equals the local one, through __getitem__ and a batch."""
    limit = 3 * max(_files(small_shards).values())
    url = s3_server.upload(small_shards, "race/keep")
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache", cache_limit=limit)
    local = ShardDataset(small_shards, crop_size=None, dtype=torch.uint8)
    keep = Remote._keep

    def keep_then_let_go(self: Remote, hold: int, path: Path) -> None:
        keep(self, hold, path)
        self.release()  # another thread's batch, out of room, letting go of this process's units

    monkeypatch.setattr(Remote, "_keep", keep_then_let_go)
    _same(remote, local)
    batch = remote.__getitems__(list(range(0, len(local), 5)))
    assert all(torch.equal(got[0], local[i][0]) for got, i in zip(batch, range(0, len(local), 5), strict=True))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_default_sampler_two_workers_many_evictions(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, context: str
) -> None:
    """The plain recipe (ShardSampler's default order, two workers) through a cache of eight units
    of eighteen: each batch touches most of the cached units, the workers' downloads evict what
    the other just let go of, for two epochs; the batches equal a local run's, and units were
    fetched again (the limit was felt)."""
    sizes = _files(small_shards)
    url = s3_server.upload(small_shards, f"race/loader-{context}")
    remote = ShardDataset(url, crop_size=16, seed=5, cache_dir=tmp_path / "cache", cache_limit=8 * max(sizes.values()))
    local = ShardDataset(small_shards, crop_size=16, seed=5)
    sampler = ShardSampler(remote, seed=0)  # in the store: block order, its window within the limit
    want_sampler = same_order(local, sampler)
    loader = DataLoader(
        remote, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=context, persistent_workers=True
    )
    same_epochs(loader, sampler, local, want_sampler, 18)
    assert sum(proxy.fetched(name) for name in sizes) > sum(sizes.values())


def same_epochs(
    loader: DataLoader, sampler: ShardSampler, local: ShardDataset, want: ShardSampler, batches: int
) -> None:
    """Two epochs of ``loader`` (drawing from ``sampler``), each ``batches`` batches equal to the
    ``local`` dataset's read in ``want``'s order."""
    for epoch in range(2):
        sampler.set_epoch(epoch)
        want.set_epoch(epoch)
        got, wanted = list(loader), list(DataLoader(local, batch_size=loader.batch_size, sampler=want))
        assert len(got) == len(wanted) == batches
        for g, w in zip(got, wanted):
            assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_cache_limit_holds_as_du_sees_it(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, context: str
) -> None:
    """A user checks a cache_limit with ``du``: the cache directory, sampled every few milliseconds
    throughout two epochs of two workers (the default order, a limit of six units of eighteen),
    never holds more than the limit, by the files' sizes or by their blocks, counting everything
    the cache leaves there (downloads, their logs, the records each unit was checked for, the
    version's index and labels, the folders)."""
    sizes = _files(small_shards)
    limit = 6 * max(sizes.values())
    url = s3_server.upload(small_shards, f"du/{context}")
    cache = tmp_path / "cache"
    with du_peak(cache) as highest:
        remote = ShardDataset(url, crop_size=16, seed=5, cache_dir=cache, cache_limit=limit)
        local = ShardDataset(small_shards, crop_size=16, seed=5)
        sampler = ShardSampler(remote, seed=0)  # in the store: block order, its window within the limit
        want_sampler = same_order(local, sampler)
        loader = DataLoader(remote, batch_size=2, sampler=sampler, num_workers=2, multiprocessing_context=context)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want_sampler.set_epoch(epoch)
            got, want = list(loader), list(DataLoader(local, batch_size=2, sampler=want_sampler))
            assert len(got) == len(want) == 36 and all(torch.equal(g[0], w[0]) for g, w in zip(got, want))
    assert sum(proxy.fetched(name) for name in sizes) > sum(sizes.values())  # it evicted
    assert 0 < max(highest) <= limit, (highest, limit)


def test_second_dataset_makes_room_for_its_index(small_shards: Path, s3_server: S3Server, tmp_path: Path) -> None:
    """A dataset opened into a cache that another has filled to the limit evicts the other's units
    for its own manifest, index and labels before it writes them (they count as ``du`` counts
    them), then reads through the same limit."""
    cache = tmp_path / "cache"
    first_url = s3_server.upload(small_shards, "du/first")
    least, _ = _least_limit(first_url, cache)
    first = ShardDataset(first_url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=least * 4)
    local = ShardDataset(small_shards, crop_size=None, dtype=torch.uint8)
    _same(first, local)
    full = max(on_disk(cache))  # the cache now, as the second dataset's limit: not a block to spare
    second = ShardDataset(
        s3_server.upload(small_shards, "du/second"),
        crop_size=None,
        dtype=torch.uint8,
        cache_dir=cache,
        cache_limit=full,
    )
    assert max(on_disk(cache)) <= full
    _same(second, local)
    assert max(on_disk(cache)) <= full


@pytest.mark.parametrize("block_size,window,prefetch", [(1, 2, 4), (1, 4, 2), (1, 1, 8)])
def test_half_dataset_cache_fetches_near_furthest_future(
    small_shards: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, block_size: int, window: int, prefetch: int
):
    """With a cache of half the dataset, an epoch in ShardSampler's block order (blocks smaller than
    a shard: each shard is read at several times) fetches within 1.05x the bytes of the offline
    furthest-future policy for the same batches. Each batch's background fetches are let finish
    before the next batch (a store faster than the reads), so that what is measured is the policy,
    not how a loaded machine schedules its threads against the reads."""
    sizes = _files(small_shards)
    limit = sum(sizes.values()) // 2
    url = s3_server.upload(small_shards, f"evict/half-{block_size}-{window}-{prefetch}")
    _, fixed = _least_limit(url, tmp_path / "cache")
    ds = ShardDataset(url, crop_size=16, seed=5, cache_dir=tmp_path / "cache", cache_limit=limit)
    sampler = ShardSampler(ds, order="block", block_size=block_size, window=window, prefetch=prefetch, seed=3)
    names = data_files(ds.manifest)
    uses = []
    draws = iter(sampler)  # drawn as a DataLoader draws: a batch at a time (the next blocks are fetched as drawn)
    while batch := list(itertools.islice(draws, 3)):
        ds.__getitems__(batch)
        assert ds._remote is not None
        concurrent.futures.wait(list(ds._remote._pending.get().values()))
        uses.append(sorted({names[int(ds.index["shard"][int(d)])] for d in batch}))
    fetched = sum(proxy.fetched(name) for name in sizes)
    # the optimum for the room the units have: the limit less what the cache keeps of the version
    # and one download's log, each unit in whole blocks with its sidecar (as du counts them)
    best = furthest_future_bytes(uses, sizes, limit - fixed - 4096, {n: _room(s) for n, s in sizes.items()})
    assert sum(sizes.values()) <= best and fetched <= 1.05 * best, (fetched, best)
    assert _cached(tmp_path / "cache") <= limit


def test_cli_reads_urls(built, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """info, verify, show and preview take the URL where they take a path (the default cache:
    PACKER_CACHE_DIR); verify fetches and checks every object."""
    from click.testing import CliRunner

    from packer.cli import main

    local = built("lmdb", "raw")
    url = s3_server.upload(local, "cli/lmdb")
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    info = runner.invoke(main, ["info", "--json", url])
    assert info.exit_code == 0, info.output
    here = runner.invoke(main, ["info", "--json", str(local)])
    facts, local_facts = json.loads(info.output), json.loads(here.output)
    assert facts.pop("path") == url and local_facts.pop("path") == str(local)
    assert facts == local_facts
    verified = runner.invoke(main, ["verify", url])
    assert verified.exit_code == 0 and f"packer: {url}: ok, 18 records" in verified.output
    shown = runner.invoke(main, ["show", url, "3"])
    assert shown.exit_code == 0 and shown.output == runner.invoke(main, ["show", str(local), "3"]).output
    sheet = runner.invoke(main, ["preview", url, "-o", str(tmp_path / "sheet.png"), "--n", "4"])
    assert sheet.exit_code == 0 and (tmp_path / "sheet.png").stat().st_size > 0


def test_units_fetched_in_sampler_order(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    """memmap units are ranges of two records (settings.UNIT_BYTES), aligned to ShardSampler's blocks
    of two: the first sample waits for its own unit, not its shard; the next window's unit is
    fetched in the background while the current one is read, so it is cached before its first
    draw; every byte is fetched once, and the samples equal the local ones."""
    local = built("memmap", "raw")  # 3 shards of 7, 7 and 4 records
    here = ShardDataset(local, crop_size=None, dtype=torch.uint8)
    monkeypatch.setattr(settings, "UNIT_BYTES", 2 * int(here.index["length"].mean()))
    url = s3_server.upload(local, "prefetch/memmap")
    proxy.faults.append(Faults(match="shard-", delay=0.3))
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
    units = ds._remote._units
    assert ds._remote.per_unit == 2 and units is not None
    sampler = ShardSampler(ds, order="block", block_size=2, window=1, prefetch=1, seed=1)
    draws = list(ShardSampler(here, order="block", block_size=2, window=1, prefetch=1, seed=1))  # the same order
    drawing = iter(sampler)  # drawn as a DataLoader draws: the first draw announces windows 0 and 1
    assert next(drawing) == draws[0]
    version = next((tmp_path / "cache").glob("*/versions/*"))
    first_unit = int(units.of[int(draws[0])])
    assert torch.equal(ds[draws[0]][0], here[int(draws[0])][0])
    window1 = {int(units.of[int(d)]) for d in draws[2:4]}  # the next block's unit(s)
    first_two = sum(int(units.sizes[u]) for u in {first_unit} | window1)
    assert sum(proxy.fetched(name) for name in _files(local)) <= first_two
    deadline = time.monotonic() + 120  # bounds a hang only: the wait ends as the unit arrives
    assert list(drawing) == draws[1:]  # announcing the later windows
    later = next(u for u in (int(units.of[int(d)]) for d in draws) if u != first_unit)
    while not (version / units.keys[later]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (version / units.keys[later]).exists()  # before any of its draws was read
    for d in draws:
        assert torch.equal(ds[d][0], here[int(d)][0])
    for name, size in _files(local).items():
        assert proxy.fetched(name) == size  # each byte once
    assert any(r != "bytes=0-" and not r.startswith("bytes=0-") for rs in proxy.ranges.values() for r in rs)


def _units_of_two(
    local: Path, s3_server: S3Server, prefix: str, tmp_path: Path, monkeypatch
) -> tuple[ShardDataset, ShardDataset, Any]:
    """The dataset at ``local`` (3 shards of 7, 7 and 4 records), uploaded under ``prefix`` and opened
    from there with memmap units of 2 records: the local dataset, the remote one and its units."""
    here = ShardDataset(local, crop_size=16, seed=2)
    monkeypatch.setattr(settings, "UNIT_BYTES", int(2.5 * sum(_files(local).values()) / len(here)))
    ds = ShardDataset(s3_server.upload(local, prefix), crop_size=16, seed=2, cache_dir=tmp_path / "cache")
    units = ds._remote._units
    assert units is not None and ds._remote.per_unit == 2
    return here, ds, units


def _read_as_local(ds: Any, here: Any, sampler: Callable[[Any], ShardSampler], batches: int, **options: Any) -> Any:
    """A DataLoader of ``ds`` (batches of 2, persistent workers, ``options``) read through, its
    batches checked equal to those of ``here`` read in this process: the loader (its workers alive)."""
    loader = DataLoader(ds, batch_size=2, sampler=sampler(ds), persistent_workers=True, **options)
    got = list(loader)
    want = list(DataLoader(here, batch_size=2, sampler=sampler(here)))
    assert len(got) == len(want) == batches and all(torch.equal(g[0], w[0]) for g, w in zip(got, want))
    return loader


def test_memmap_units_ask_no_head(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch) -> None:
    """A memmap unit's object version comes with its first GET (the manifest gives the size: no
    HEAD, a first-byte wait less before the first batch); the object's other units ask If-Match
    that version, so an object replaced mid-epoch is refused, named, and never spliced in."""
    local = built("memmap", "jpeg")
    here, ds, _ = _units_of_two(local, s3_server, "nohead/memmap", tmp_path, monkeypatch)
    names = data_files(ds.manifest)
    for i in range(7):  # shard 0: records 0-6, units 0-1, 2-3, 4-5, 6
        assert torch.equal(ds[i][0], here[i][0])
    first = f"/packer/nohead/memmap/{names[0]}"
    assert proxy.requests["GET", first] == 4 and proxy.pinned[first] == 3  # the first GET learned the version
    assert not [key for method, key in proxy.requests if method == "HEAD" and "/nohead/memmap/shard-" in key]
    ds[7]  # shard 1's first unit
    key = f"nohead/memmap/{names[1]}"
    body = bytearray((local / names[1]).read_bytes())
    body[-1] ^= 0xFF  # the same size, another version
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
    with pytest.raises(DatasetError, match=rf"{key}: replaced in the store while it was read"):
        ds[9]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_sampler_process_fetches_ahead_not_the_workers(
    built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch, context
):
    """With DataLoader workers, ShardSampler's next blocks are downloaded by the process iterating
    the sampler (its background threads), in the order needed; a batch whose unit is not in flight
    yet is fetched by its reader (the first window's, or one whose prefetch still waits for its
    turn: a prefetch takes its turn before its unit's lock, and leaves a unit another process
    fetches to it). Each unit is fetched once, and the batches equal a local run's."""
    local = built("memmap", "jpeg")
    here, ds, units = _units_of_two(local, s3_server, f"ahead/{context}", tmp_path, monkeypatch)
    proxy.faults.append(Faults(match="shard-", delay=0.05))
    names = data_files(ds.manifest)

    def sampler(d: ShardDataset) -> ShardSampler:
        return ShardSampler(d, order="block", block_size=2, window=1, prefetch=2, seed=4)

    loader = _read_as_local(ds, here, sampler, 9, num_workers=2, multiprocessing_context=context)
    running: Any = loader._iterator  # persistent: its workers alive, their pools open
    workers = [psutil.Process(w.pid) for w in running._workers]
    mine = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")}
    # a forked worker also holds the connections its parent had opened: its own are the others
    theirs = {c.laddr.port for w in workers for c in w.net_connections(kind="tcp")} - mine
    gets = [(k, p) for k, peers in proxy.peers.items() if f"/ahead/{context}/shard-" in k for p in peers]
    assert len(gets) == len(units.keys) and {p for _, p in gets} <= mine | theirs  # one GET per unit, each placed
    order = list(sampler(here))
    assert sum(p in mine for _, p in gets) > 0, gets  # the sampler's process fetched ahead
    needed = list(dict.fromkeys(int(units.of[int(d)]) for d in order))  # units in the order first read
    wanted = [(names[int(units.shard[u])], int(units.starts[u])) for u in needed]
    answered = sorted((a, k, r) for k, r, p, a, _ in proxy.spans if f"/ahead/{context}/shard-" in k and p in mine)
    ours = [(k.rsplit("/", 1)[1], int(r.split("=")[1].split("-")[0])) for _, k, r in answered]
    assert ours == [w for w in wanted if w in ours], ours  # the sampler's process fetched in the order needed
    for name, size in _files(local).items():
        assert proxy.fetched(name) == size  # each byte once


def test_mix_members_fetched_ahead_by_the_sampler_process(
    built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch
):
    """A MixDataset of datasets in object storage: ShardSampler's plan and next blocks reach each
    member as its own records, and are downloaded by the process iterating the sampler, not by the
    workers (those fetched the units of their first batches, and any whose prefetch still waited
    for its turn); each unit once, and the batches equal a local mix's."""
    local = built("memmap", "jpeg")
    here, a, units = _units_of_two(local, s3_server, "mix/a", tmp_path, monkeypatch)
    b = ShardDataset(s3_server.upload(local, "mix/b"), crop_size=16, seed=2, cache_dir=tmp_path / "cache")
    proxy.faults.append(Faults(match="shard-", delay=0.05))
    mix, local_mix = MixDataset([a, b]), MixDataset([here, ShardDataset(local, crop_size=16, seed=2)])

    def sampler(d: MixDataset) -> ShardSampler:
        return ShardSampler(d, order="block", block_size=2, window=1, prefetch=2, seed=4)

    loader = _read_as_local(mix, local_mix, sampler, 18, num_workers=2)
    running: Any = loader._iterator
    mine = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")}
    theirs = {c.laddr.port for w in running._workers for c in psutil.Process(w.pid).net_connections(kind="tcp")}
    theirs -= mine  # a forked worker also holds its parent's connections
    gets = [p for k, peers in proxy.peers.items() if "/mix/" in k and "/shard-" in k for p in peers]
    assert len(gets) == 2 * len(units.keys)  # each unit of each member once
    assert sum(p in mine for p in gets) > 0, gets
    assert a._remote is not None and b._remote is not None
    assert a._remote._next.planned is not None and b._remote._next.planned is not None  # each member told its draws
    read = (a._remote._next.at, b._remote._next.at)  # the draws each member counts read: its own, not the mix's
    assert mix._read[0] > len(a) >= max(read) and 0 < sum(read) <= mix._read[0]


def test_prefetches_take_turns_in_the_order_needed(
    built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch
):
    """The sampler's process downloads its prefetches in the order the sampler reads them, and
    one at a time while one stream is not known to be too slow for the readers (the next one's GET
    when the one before is a first-byte wait from its end): behind a bandwidth cap, the first
    batch's unit does not share it with those needed after it."""
    local = built("memmap", "jpeg")
    here, ds, units = _units_of_two(local, s3_server, "turns/memmap", tmp_path, monkeypatch)
    proxy.faults.append(Faults(match="shard-", delay=0.05, rate=sum(_files(local).values()) / 2))  # 2 s for all
    names = data_files(ds.manifest)

    def sampler(d: ShardDataset) -> ShardSampler:
        return ShardSampler(d, order="block", block_size=2, window=1, prefetch=4, seed=4)

    _read_as_local(ds, here, sampler, 9, num_workers=1)
    needed = []  # the units in the order of their first draw
    for d in sampler(here):
        u = int(units.of[int(d)])
        needed += [] if u in needed else [u]
    wanted = [(names[int(units.shard[u])], int(units.starts[u])) for u in needed]
    ours = [(k, r) for k, r in proxy.gotten if "/turns/memmap/shard-" in k]
    gotten = [(k.rsplit("/", 1)[1], int(r.split("=")[1].split("-")[0])) for k, r in ours]
    assert gotten == wanted  # every unit once, in the order needed
    mine = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")}  # a worker opens its own
    spans = sorted((a, b) for k, _, port, a, b in proxy.spans if "/turns/memmap/shard-" in k and port in mine)
    assert len(spans) >= len(needed) - 2  # the worker fetched its first batch's units at most
    # the next GET goes out a first-byte wait before the first unit's end, as the first's own first-byte
    # time predicts (longer under load than this delay): its body starts after most of the first's
    (a, b), (c, _) = spans[:2]
    assert c - a >= (b - a) / 2, spans  # four at once (no turns) would start together


def test_records_checked_as_their_bytes_arrive(tmp_path: Path) -> None:
    """A memmap unit's records are checked by the CRC-32s of the bytes as a download writes them;
    the check after it reads back only those whose bytes did not all come in order in one stream
    (cut by two parts, in a part already there, written twice), so damage is caught either way."""
    records = [bytes([i]) * (100 + 37 * i) for i in range(6)]
    rows = np.zeros(len(records), checks.ROWS_DTYPE)
    rows["length"] = [len(r) for r in records]
    rows["position"] = np.concatenate([[0], np.cumsum(rows["length"])[:-1]]) + 3  # 3 bytes no row covers
    rows["crc32"] = [zlib.crc32(r) for r in records]
    data = b"pad" + b"".join(records)
    path = tmp_path / "unit"
    path.write_bytes(data)
    expected = (BACKENDS["memmap"], np.arange(len(records)), rows)
    cut = int(rows["position"][3]) + 50  # a part boundary inside record 3
    received = checks.Received(rows)
    for at in range(cut, len(data), 64):  # the second part first, in pieces
        received(at, data[at : at + 64])
    received(0, data[:cut])  # then the first, in one piece
    received(int(rows["position"][1]), records[1])  # record 1 written again
    whole, crcs = received.checked()
    assert whole.tolist() == [True, False, True, False, True, True]  # 1: twice; 3: cut by the parts
    assert (crcs[whole] == rows["crc32"][whole]).all()
    assert checks.unit_problem(path, expected, received) == ""
    path.write_bytes(data[:cut] + b"X" + data[cut + 1 :])  # damage read back: record 3
    assert "record 3: CRC-32 differs" in checks.unit_problem(path, expected, received)
    damaged = checks.Received(rows)
    damaged(0, data[:200] + b"X" + data[201:])  # damage as it arrived: record 1
    assert "record 1: CRC-32 differs" in checks.unit_problem(tmp_path / "unit", expected, damaged)
    assert "record 0 is missing" in checks.unit_problem(tmp_path / "none", expected, checks.Received(rows))


def test_turns_widen_only_where_one_stream_is_too_slow():
    """One prefetch receives at a time (the next waits for it to finish, lower ranks entered before
    first) while one stream alone outpaces the readers; where it does not, as many as their
    consumption needs receive at once, up to PREFETCH_UNITS."""
    turns = remote_turns.Turns()
    turns.alone(100e6)
    turns.consumed(80e6)  # a node's capped bandwidth that one stream fills
    assert turns._width == 1
    for key, rank in (("a", 1), ("b", 2), ("c", 3)):
        turns.enter(("d", key), rank, concurrent.futures.Future)
    turns.turn(("d", "a"), named="a")
    first = turns.arrival(("d", "a"), 10)
    order: list[str] = []

    def take(key: str) -> None:
        turns.turn(("d", key), named=key)
        order.append(key)

    waiting = [threading.Thread(target=take, args=(k,), daemon=True) for k in "cb"]
    try:
        for t in waiting:
            t.start()
        time.sleep(0.2)
        assert order == []  # both wait for the one receiving
        first.end()
        deadline = time.monotonic() + 10
        while not order and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert order == ["b"]  # the lower rank, alone: c waits for it to finish
        turns.consumed(190e6)  # readers held back near two streams' worth: widen
        assert turns._width == 3
        waiting[0].join(10)
        assert order == ["b", "c"]
        turns.consumed(1e9)
        assert turns._width == settings.PREFETCH_UNITS
    finally:
        turns.consumed(1e9)  # none left waiting, whatever failed


def test_https_range_server(built, tmp_path: Path) -> None:
    """A dataset folder served by a plain web server (Range, ETag) reads as the local dataset."""
    local = built("lmdb", "jpeg")
    site = tmp_path / "site"
    shutil.copytree(local, site / "train.lmdb")
    base, server = serve_folder(site)
    try:
        remote = ShardDataset(f"{base}/train.lmdb", crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
        _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))
    finally:
        server.shutdown()


RESUME_CHILD = """
import sys, torch
import packer.store.base as base
base.PART_BYTES, base.PART_THREADS = 32 << 10, 1
from packer import ShardDataset
ds = ShardDataset(sys.argv[1], crop_size=None, dtype=torch.uint8, cache_dir=sys.argv[2])
ds[0]
"""


def _parts_done(listed: Path) -> list[int]:
    """The parts a download's ``.parts`` file lists as written (after its line of the part size)."""
    header, *lines = listed.read_text().splitlines() or [""]
    assert header == f"part_bytes {32 << 10}" or not lines
    return sorted(int(n) for n in lines if n.isdigit())


def test_download_resumed_after_kill(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    """A reader killed (-9) mid-download leaves the parts it finished; the next reader fetches only the
    rest (and its lock was released by the kernel), and the samples equal the local ones."""
    local = built("memmap", "raw")
    url = s3_server.upload(local, "resume/memmap")
    cache = tmp_path / "cache"
    size = _files(local)["shard-00000.bin"]
    proxy.faults.append(Faults(match="shard-00000", rate=256 << 10))
    child = subprocess.Popen([sys.executable, "-c", RESUME_CHILD, url, str(cache)])
    try:
        deadline = time.monotonic() + 120  # bounds a hang only: the wait ends at the third part written
        parts: list[Path] = []
        while time.monotonic() < deadline and not (parts and len(_parts_done(parts[0])) >= 3):
            parts = list(cache.glob("*/partial/shard-00000.bin*.parts"))
            time.sleep(0.05)
        assert parts, "the child never started its download"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    done = _parts_done(parts[0])
    proxy.settle()
    proxy.clear()
    monkeypatch.setattr("packer.store.base.PART_BYTES", 32 << 10)
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
    _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))
    assert proxy.fetched("shard-00000.bin") == size - len(done) * (32 << 10)


def test_silent_server_times_out_and_retries(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path, monkeypatch):
    """A response that never starts is given up after the idle-read timeout and asked again: the
    reader gets its samples. The proxy keeps each stalled GET silent until the client closes it (a
    reader without the timeout would wait there for good: the bound below fails it)."""
    monkeypatch.setattr("packer.store.base.READ_TIMEOUT_S", 3.0)
    monkeypatch.setattr("packer.store.http.READ_TIMEOUT_S", 3.0)
    local = built("memmap", "jpeg")
    url = s3_server.upload(local, "stall/memmap")
    proxy.faults.append(Faults(match="shard-00001", stall=2, stall_s=600.0))

    def read() -> None:
        remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
        _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))

    in_time(read, 120)  # a hang's bound: the two stalls end only by the reader's own timeout
    assert proxy.gets("shard-00001.bin") == 3
    proxy.settle()  # the stalled GETs ended: the reader closed them


@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_local_version_holds_the_version_while_it_is_read_then_lets_go(
    built, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """`packer info` on a URL reads the version's metadata from the cache (local_version): while it
    reads, the version is held (an eviction of it, as a refresh's reader's room would try, is
    refused); once the block ends nothing of it is held, with no help from the garbage collector
    (no flock on its manifest, no descriptor under its folder), and eviction may take it."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))
    url = s3_server.upload(built(backend, "jpeg"), f"local-version/{backend}")
    gc.disable()
    try:
        with local_version(url) as root:
            assert (root / MANIFEST).is_file() and root.parent.name == VERSIONS
            assert not evict_version(root), "evicted while local_version's caller reads it"
        assert not _version_held(root), "local_version still holds the version after its block"
        mine = [f.path for f in psutil.Process().open_files()]
        assert not [p for p in mine if p.startswith(f"{root}{os.sep}")], mine
        assert evict_version(root) and not root.exists()
    finally:
        gc.enable()
