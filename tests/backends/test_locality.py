"""order="block"'s block prefetch: which draws name which blocks, that the readers turn them into
the right byte runs of the real files (the kernel then holds those pages), and that the hint
changes no batch with 0 or 2 DataLoader workers."""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from packer import ShardSampler
from packer.backends import locality
from packer.backends.lmdb import LmdbReader, close_lmdb
from packer.format import lmdb_key
from packer.read.dataset import ShardDataset

from .. import _sampler_run as run
from ..conftest import BACKEND_NAMES

_libc = ctypes.CDLL(None, use_errno=True)


def resident(path: Path, start: int, end: int) -> float:
    """Share of the pages of ``path``'s bytes [start, end) in the page cache (mincore)."""
    page = mmap.PAGESIZE
    first, last = start // page, -(-end // page)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        buf = (ctypes.c_char * len(mm)).from_buffer(mm)
        vec = (ctypes.c_ubyte * (last - first))()
        status = _libc.mincore(ctypes.c_void_p(ctypes.addressof(buf) + first * page), (last - first) * page, vec)
        del buf
    assert status == 0
    return sum(v & 1 for v in vec) / len(vec)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_runs_merge_neighbouring_extents() -> None:
    offsets, lengths = np.array([300, 0, 100, 10_000]), np.array([50, 100, 100, 10])
    assert locality.runs(offsets, lengths, gap=0) == [(0, 200), (300, 350), (10_000, 10_010)]
    assert locality.runs(offsets, lengths, gap=100) == [(0, 350), (10_000, 10_010)]
    assert locality.runs(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []
    assert locality.records([(2, 4), (16, 30)], 18).tolist() == [2, 3, 16, 17]
    assert list(locality.pieces([(0, 10), (20, 25)], 4)) == [(0, 4), (4, 4), (8, 2), (20, 4), (24, 1)]
    assert locality.advice_bytes(os.stat(__file__).st_dev) >= 128 << 10  # sysfs's figure, or the default


def test_each_window_names_the_next_windows_blocks(built) -> None:
    """18 records, blocks of 3, windows of 2 blocks: each rank's first draw of a window names the
    next window's blocks (its first draw: its own window's too), as whole blocks; nothing else does."""
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=run.CROP)
    for world in (1, 2):
        for rank in range(world):
            sampler = ShardSampler(ds, order="block", block_size=3, window=2, num_replicas=world, rank=rank)
            sampler.set_epoch(2)
            sequence, draws = sampler.sequence(), list(sampler)
            windows = [set(sequence[k : k + 6].tolist()) for k in range(0, 18, 6)]
            named = [(d.draw // 6, set(locality.records(d.ahead, 18).tolist())) for d in draws if d.ahead]
            assert named == [(0, windows[0] | windows[1]), (1, windows[2])]
            assert all(lo % 3 == 0 and (hi % 3 == 0 or hi == 18) for d in draws for lo, hi in d.ahead)
            assert [d.draw for d in draws if d.ahead] == [rank, 6 + (rank - 6) % world]
    again = pickle.loads(pickle.dumps(draws[0]))  # as DataLoader sends indices to its workers
    assert (again, again.draw, again.ahead) == (draws[0], draws[0].draw, draws[0].ahead) and again.ahead
    assert not any(d.ahead for d in ShardSampler(ds, order="block", block_size=3, window=2, prefetch=0))
    two = [d for d in ShardSampler(ds, order="block", block_size=3, window=2, prefetch=2) if d.ahead]
    assert [(d.draw, locality.records(d.ahead, 18).size) for d in two] == [(0, 18)]  # 3 windows, all at once
    assert not any(d.ahead for d in ShardSampler(ds))
    resumed = ShardSampler(ds, order="block", block_size=3, window=2)
    resumed.load_state_dict({**resumed.state_dict(), "position": 8})
    first = next(iter(resumed))  # mid-window: its own window's blocks and the next one's
    sequence = resumed.sequence()
    assert set(locality.records(first.ahead, 18).tolist()) == set(sequence[6:18].tolist())


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_prefetch_brings_a_blocks_bytes_into_the_page_cache(built, backend: str) -> None:
    path = built(backend, "raw")
    ds = ShardDataset(path, crop_size=run.CROP)
    reader = ds._reader
    if backend == "lmdb":
        assert isinstance(reader, LmdbReader)
        segments, keys = reader._places(np.arange(3, 9))
        assert set(segments.tolist()) == {0}  # one data file: data.mdb
        data = path / "data.mdb"
        offsets, lengths = reader._env(0).guard.extents(keys)
        close_lmdb(path)  # plain py-lmdb below opens the same file
        with (
            lmdb.open(str(data), readonly=True, lock=False, subdir=False) as env,
            env.begin() as txn,
            open(data, "rb") as fh,
            mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        ):
            for key, at, n in zip(keys.tolist(), offsets.tolist(), lengths.tolist()):
                assert mm[at : at + n] == txn.get(lmdb_key(key))  # the extents are the records' bytes
        files = [(data, offsets, lengths)]
    else:
        rows = ds.index[3:9]
        files = [
            (path / str(ds.manifest.shards[k]["file"]), mine["offset"], mine["length"])
            for k in np.unique(rows["shard"]).tolist()
            for mine in [rows[rows["shard"] == k]]
        ]
    spans = [(file, int(offsets.min()), int((offsets + lengths).max())) for file, offsets, lengths in files]
    for file, start, end in spans:
        evict(file)
        if resident(file, start, end) > 0:
            pytest.skip(f"{file}: this filesystem keeps its pages in memory (tmpfs?): nothing to prefetch")
    reader.prefetch([(3, 9)])
    deadline = time.monotonic() + 10
    while any(resident(*span) < 1 for span in spans) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(resident(*span) == 1 for span in spans)
    assert [bytes(b) for b in reader.get_many(range(3, 9))] == [
        bytes(b) for b in ShardDataset(path)._reader.get_many(range(3, 9))
    ]


def test_the_hint_changes_no_batch(built) -> None:
    """Block order with and without the prefetch, 0 and 2 workers: the same batches."""
    path = str(built("lmdb", "jpeg"))
    results = []
    for workers, prefetch in ((0, 1), (2, 2), (0, 0)):
        loader, sampler = run.make(path, workers, order="block", block_size=4, window=2, prefetch=prefetch)
        results.append(run.batches(loader, sampler, 1))
    assert all(
        len(r) == len(results[0])
        and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(r, results[0]))
        for r in results[1:]
    )
