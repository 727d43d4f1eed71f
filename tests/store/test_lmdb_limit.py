"""An LMDB dataset of several segments (one data file each) read from a real S3 server through a
cache_limit of about two of its files: each process lets go of its batch's files after the batch,
so epochs complete with and without DataLoader workers, the cache never exceeds the limit as ``du``
sees it, files are evicted and fetched again, and no process keeps an evicted file's disk space."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from packer import ShardDataset, ShardSampler, build
from packer.backends import data_files
from packer.format import DatasetError, Manifest

from ..conftest import PHOTOS
from .du import du_peak, on_disk
from .proxy import Proxy
from .seaweed import S3Server
from .test_s3 import _least_limit

SEGMENTS = 4


@pytest.fixture(scope="module")
def segmented(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An LMDB dataset of four segments of 18 raw records (~8 MB each): built, then refreshed three
    times over a raw folder that gains a copy of the photos each time (``build --update``)."""
    root = tmp_path_factory.mktemp("segmented")
    raw, out = root / "raw", root / "raw.lmdb"
    for k in range(SEGMENTS):
        for photo in sorted(PHOTOS.glob("*.jpg")):
            folder = raw / ("landscape" if photo.name.startswith("Landscape") else "portrait")
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(photo, folder / f"s{k}-{photo.name}")
        build(raw, out, backend="lmdb", format="raw", workers=1, quiet=True, update=k > 0)
    assert len(data_files(Manifest.load(out))) == SEGMENTS
    return out


def _sizes(local: Path) -> dict[str, int]:
    return {name: (local / name).stat().st_size for name in data_files(Manifest.load(local))}


def _fixed_room(url: str, cache: Path) -> int:
    """What the cache keeps of ``url``'s version (manifest, index, labels, folders) as ``du`` counts
    it: the room no eviction frees."""
    ShardDataset(url, cache_dir=cache, cache_limit=1 << 40)
    return max(on_disk(cache))


def _deleted_in(cache: Path, pids: list[int]) -> list[str]:
    """Files under ``cache`` that are deleted but still mapped or open in one of ``pids``: their
    disk space is not freed although ``du`` no longer counts them."""
    kept = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, ProcessLookupError):  # a worker gone meanwhile
            continue
        for where in [line.split(maxsplit=5)[-1] for line in maps] + fds:
            if where.startswith(str(cache)) and where.endswith("(deleted)"):
                kept.append(f"{pid}: {where}")
    return kept


@pytest.mark.parametrize("context", [None, "fork", "spawn"])
def test_segments_through_a_cache_of_two_files(
    segmented: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, context: Optional[str]
) -> None:
    """Two epochs (no workers; two workers under fork, under spawn) through a limit of two data
    files of four: every epoch completes with the local copy's batches, bit for bit; ``du`` of the
    cache, sampled throughout, never exceeds the limit; files were evicted and fetched again; and
    after each epoch no process (this one, the persistent workers) keeps an evicted file mapped or
    open."""
    sizes = _sizes(segmented)
    url = s3_server.upload(segmented, f"lmdb-limit/{context}")
    cache = tmp_path / "cache"
    # two files, each with its sidecar and its download's log page: both workers may be fetching at once
    limit = _fixed_room(url, cache) + 2 * (-(-max(sizes.values()) // 4096) * 4096 + 2 * 4096)
    assert limit < 3 * min(sizes.values())  # not three files
    with du_peak(cache) as highest:
        remote = ShardDataset(url, crop_size=32, seed=5, cache_dir=cache, cache_limit=limit)
        local = ShardDataset(segmented, crop_size=32, seed=5)
        # blocks of one segment's run of records (the index holds nine per class and segment), one at a time
        sampler = ShardSampler(remote, order="block", block_size=9, window=1, seed=3)
        want = ShardSampler(local, order="block", block_size=9, window=1, seed=3)
        workers = 0 if context is None else 2
        loader = DataLoader(
            remote,
            batch_size=4,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context=context,
            persistent_workers=workers > 0,
        )
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want.set_epoch(epoch)
            got, wanted = list(loader), list(DataLoader(local, batch_size=4, sampler=want))
            assert len(got) == len(wanted) == 18
            for g, w in zip(got, wanted):
                assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
            pids = [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]
            assert not _deleted_in(cache, pids), _deleted_in(cache, pids)
    assert 0 < max(highest) <= limit, (highest, limit)
    assert sum(proxy.fetched(name) for name in sizes) > sum(sizes.values())  # evicted and fetched again


def test_a_limit_below_one_file_is_refused_as_the_dataset_opens(
    segmented: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A cache_limit that cannot hold the largest LMDB file (the manifest lists its size) is refused
    by ShardDataset(...) itself, in one line naming the least limit and why a batch needs its files
    at once; at that limit, one file at a time, batches of one segment each read two epochs equal
    to the local copy's, ``du`` within the limit."""
    sizes = _sizes(segmented)
    url = s3_server.upload(segmented, "lmdb-limit/least")
    cache = tmp_path / "cache"
    least, fixed = _least_limit(url, cache)
    assert max(sizes.values()) < least - fixed <= max(sizes.values()) + 3 * 4096  # the file, its sidecar and log
    with pytest.raises(DatasetError) as refused:
        ShardDataset(url, cache_dir=cache, cache_limit=least - 1)
    assert "\n" not in str(refused.value) and f"at least {least} bytes would work" in str(refused.value)
    assert "needs all its data files in the cache at once" in str(refused.value)
    with du_peak(cache) as highest:
        remote = ShardDataset(url, crop_size=32, seed=5, cache_dir=cache, cache_limit=least)
        local = ShardDataset(segmented, crop_size=32, seed=5)
        # blocks of nine records, one class of one segment each, a batch each
        sampler = ShardSampler(remote, order="block", block_size=9, window=1, seed=3)
        want = ShardSampler(local, order="block", block_size=9, window=1, seed=3)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want.set_epoch(epoch)
            got = list(DataLoader(remote, batch_size=9, sampler=sampler))
            wanted = list(DataLoader(local, batch_size=9, sampler=want))
            assert len(got) == len(wanted) == 8
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, wanted))
    assert 0 < max(highest) <= least, (highest, least)
