"""Readers during a refresh: the nightly recipe (docs/REFRESHING.md) rebuilds OUT (``--update`` or
``--force``) while a training job reads it. A ShardDataset keeps reading the version it opened, index and records
together, for its whole life and its workers' (fork, spawn, persistent or not, lazily used memmap
shards, LMDB and memmap, JPEG and raw), or refuses with one clear DatasetReplaced where the old
version cannot be reached any more (a spawned worker after the old files were deleted).

Every image is one flat colour that encodes its class (red) and its own number (green), so each
sample's pixels say which source they came from: a label or a record from another version shows.
The refresh adds 5 files that sort first, shifting every record of the new version by 5.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from packer import DatasetError, DatasetReplaced, ShardDataset, VersionsDiffer, build

from ..conftest import COMBOS, ONE_EACH

CLASSES = 3
PER_CLASS = 7
CROP = 16


def colour(cls: int, number: int) -> tuple[int, int, int]:
    return 40 + 80 * cls, 8 * number, 128


def write(path: Path, cls: int, number: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 32), colour(cls, number)).save(path)


def source_colour(source: str) -> tuple[int, int]:
    """(class, number) a source path was painted with (see :func:`colour`)."""
    folder, name = source.split("/")
    return int(folder[1:]), int(name[1:3])


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    for c in range(CLASSES):
        for k in range(PER_CLASS):
            number = c * PER_CLASS + k
            write(root / f"c{c}" / f"m{number:02d}.png", c, number)
    return root


def add_five_first(raw: Path) -> None:
    """5 new files in class 0 that sort before every other: each later record moves by 5."""
    for j in range(5):
        write(raw / "c0" / f"a{25 + j:02d}.png", 0, 25 + j)


def refresh(raw: Path, out: Path, how: str, backend: str, fmt: str) -> None:
    add_five_first(raw)
    build(
        raw,
        out,
        backend=backend,
        format=fmt,
        workers=1,
        quiet=True,
        shard_size=10,
        update=how == "update",
        force=how == "force",
    )


def check(ds: ShardDataset, indices: list[int], images: torch.Tensor, labels: torch.Tensor) -> None:
    """Each sample's label and pixels are those of the source the dataset's own index names."""
    assert images.shape[1:] == (3, CROP, CROP)
    means = images.to(torch.float64).mean(dim=(2, 3))
    for i, mean, label in zip(indices, means.tolist(), labels.tolist()):
        cls, number = source_colour(ds.source(i))
        assert label == cls, f"record {i} ({ds.source(i)}): label {label}"
        assert abs(mean[0] - colour(cls, number)[0]) < 6 and abs(mean[1] - colour(cls, number)[1]) < 3, (
            f"record {i} ({ds.source(i)}): pixels {mean} are not {colour(cls, number)}"
        )


def epoch(ds: ShardDataset, loader: DataLoader, after_first=None) -> int:
    """One pass in index order, every batch checked; ``after_first`` runs once the first batch is in."""
    seen = 0
    for b, (images, labels) in enumerate(loader):
        check(ds, list(range(seen, seen + len(labels))), images, labels)
        seen += len(labels)
        if b == 0 and after_first is not None:
            after_first()
    return seen


def open_loader(out: Path, ctx: str, persistent: bool) -> tuple[ShardDataset, DataLoader]:
    ds = ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=ctx, persistent_workers=persistent)
    return ds, loader


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_fork_workers_keep_the_version_they_opened(
    raw: Path, tmp_path: Path, backend: str, fmt: str, persistent: bool
) -> None:
    """The refresh lands after the first batch (mid-epoch, memmap shards of 10 not all touched yet);
    that epoch and the next read the old version whole: 21 records, each matching its pixels."""
    out = tmp_path / ("d.lmdb" if backend == "lmdb" else "d")
    build(raw, out, backend=backend, format=fmt, workers=1, quiet=True, shard_size=10)
    ds, loader = open_loader(out, "fork", persistent)
    how = "update" if persistent else "force"
    assert epoch(ds, loader, after_first=lambda: refresh(raw, out, how, backend, fmt)) == 21
    assert ShardDataset(out).manifest.count == 26  # the refresh did replace OUT
    ds.set_epoch(1)
    assert epoch(ds, loader) == 21
    check(ds, [0, 20], torch.stack([ds[0][0], ds[20][0]]), torch.tensor([ds[0][1], ds[20][1]]))  # the parent too


@pytest.mark.parametrize("backend,fmt", ONE_EACH)
def test_spawn_workers_keep_the_version_or_say_it_was_replaced(
    raw: Path, tmp_path: Path, backend: str, fmt: str
) -> None:
    """Spawned workers reopen by path (nothing else crosses exec). Persistent ones opened the old
    version before the refresh (an epoch ran: both are up) and keep it; workers started after it find
    other files there and refuse with one clear error. (A spawned worker still starting when the
    refresh lands refuses the same way.)"""
    out = tmp_path / ("d.lmdb" if backend == "lmdb" else "d")
    build(raw, out, backend=backend, format=fmt, workers=1, quiet=True, shard_size=10)
    ds, persistent = open_loader(out, "spawn", True)
    fresh = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    assert epoch(ds, persistent) == 21
    refresh(raw, out, "update", backend, fmt)
    assert epoch(ds, persistent) == 21
    with pytest.raises(DatasetError, match=r"replaced since it was opened.*create a new ShardDataset"):
        next(iter(fresh))
    again = ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8)
    assert epoch(again, DataLoader(again, batch_size=4)) == 26


def test_two_datasets_on_one_lmdb_path_read_their_own_versions(raw: Path, tmp_path: Path) -> None:
    """One process, the old and the new version of one path open at once, reads interleaved, in the
    main thread and the fetch threads. They share data.mdb (the refresh linked it, and wrote the new
    records into data-00001.mdb): one environment for it, its page guard covering both versions' keys."""
    out = tmp_path / "d.lmdb"
    build(raw, out, workers=1, quiet=True)
    old = ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8)
    first = old.__getitems__(list(range(21)))
    refresh(raw, out, "update", "lmdb", "jpeg")
    new = ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8)
    for ds, n in ((old, 21), (new, 26), (old, 21), (new, 26)):
        batch = ds.__getitems__(list(range(n)))
        check(ds, list(range(n)), torch.stack([s.image for s in batch]), torch.tensor([s.label for s in batch]))
    assert [torch.equal(a.image, b.image) for a, b in zip(first, old.__getitems__(list(range(21))))] == [True] * 21


def test_a_pickled_copy_of_a_replaced_dataset_refuses_to_read(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    build(raw, out, workers=1, quiet=True, shard_size=10)
    ds = ShardDataset(out, crop_size=CROP)
    copy = pickle.loads(pickle.dumps(ds))
    assert len(copy) == 21 and torch.equal(copy[3][0], ds[3][0])
    refresh(raw, out, "force", "memmap", "jpeg")
    stale = pickle.loads(pickle.dumps(ds))
    with pytest.raises(DatasetReplaced, match="replaced since it was opened"):
        stale[0]
    assert copy[3][1] == ds[3][1] == 0 and len(ds) == 21  # the copy made before still reads the old version


def ranks_open_across_a_refresh(rank: int, port: int, raw: str, out: str, first: int, other: str, result: str) -> None:
    """One of 2 gloo ranks (torch.multiprocessing.spawn): rank ``first`` opens OUT, the refresh lands
    (barriers order it), the other rank opens OUT, then each builds a ShardSampler (rank and world
    size from torch.distributed) over it, or with ``other`` over a MixDataset of OUT and ``other``.
    Saves what the rank then reads, or the error it raised."""
    import datetime
    import os

    import torch.distributed as dist

    from packer.read.mix import MixDataset
    from packer.read.sampler import ShardSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    ds = ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8) if rank == first else None
    dist.barrier()
    if rank == first:
        refresh(Path(raw), Path(out), "update", "memmap", "jpeg")
    dist.barrier()
    ds = ds or ShardDataset(out, crop_size=CROP, train=False, dtype=torch.uint8)
    mixed = MixDataset([ds, ShardDataset(other, crop_size=CROP, train=False, dtype=torch.uint8)]) if other else None
    try:
        sampler = ShardSampler(mixed or ds, shuffle=False)
    except VersionsDiffer as e:
        torch.save(("error", type(e).__name__, str(e)), f"{result}.{rank}")
    else:
        loader = DataLoader(mixed or ds, batch_size=4, sampler=sampler, num_workers=2)
        draws = [int(d) for d in sampler]  # this rank's records, in the loader's order
        steps = 0
        for images, labels in loader:  # each sample is the record its (agreed) index names
            batch = draws[4 * steps : 4 * steps + len(labels)]
            at = [j for j, d in enumerate(batch) if d < len(ds)]  # OUT's records (a mix's first member)
            check(ds, [batch[j] for j in at], images[at], labels[at])
            steps += 1
        done = torch.tensor([steps])
        dist.all_reduce(done)  # a rank with another step count would not get here in step
        records = [(mixed or ds).source(i) for i in range(len(mixed or ds))]
        torch.save(("ok", len(ds), len(sampler), steps, records, ds[0][0]), f"{result}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "first,mix", [(1, False), (1, True), (0, False)], ids=["rank0-opens-the-new", "mix", "rank0-opens-the-old"]
)
def test_ddp_ranks_opened_across_a_refresh_agree(raw: Path, tmp_path: Path, first: int, mix: bool) -> None:
    """A refresh lands between two DDP ranks' opens, whichever rank opened first: the ranks reopen
    the newest version and agree (same length, steps and records on both; in a MixDataset, the mix's
    sizes too). Never a hang (a deadline)."""
    import torch.multiprocessing as mp

    from ..read.test_sampler import free_port

    out = tmp_path / "out"
    build(raw, out, backend="memmap", format="jpeg", workers=1, quiet=True, shard_size=10)
    other = tmp_path / "other"
    if mix:
        build(raw, other, backend="memmap", format="raw", workers=1, quiet=True)
    result = str(tmp_path / "result")
    ctx = mp.start_processes(
        ranks_open_across_a_refresh,
        (free_port(), str(raw), str(out), first, str(other) if mix else "", result),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    join_within(ctx, 120)
    got = [torch.load(f"{result}.{r}", weights_only=False) for r in range(2)]
    assert [g[0] for g in got] == ["ok", "ok"], got  # both on the refreshed version (26 records)
    assert got[0][1:5] == got[1][1:5] and got[0][1] == 26
    assert len(got[0][4]) == 26 + 21 * mix
    assert torch.equal(got[0][5], got[1][5])


def join_within(ctx: Any, seconds: float) -> None:
    """Wait for torch.multiprocessing's ranks; kill them and fail the test once ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks hung")


def ranks_of_other_lengths(rank: int, port: int, result: str) -> None:
    """One of 2 gloo ranks whose datasets (not packer's: nothing to reopen) differ in length: saves
    the error ShardSampler raised, or that it raised none."""
    import datetime
    import os

    import torch.distributed as dist

    from packer.read.sampler import ShardSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        ShardSampler(torch.utils.data.TensorDataset(torch.arange(20 + rank)))
    except VersionsDiffer as e:
        torch.save(("error", str(e)), f"{result}.{rank}")
    else:
        torch.save(("ok", ""), f"{result}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_ranks_that_cannot_agree_both_refuse(tmp_path: Path) -> None:
    """Ranks whose datasets differ and cannot be reopened at one version (here not packer's) raise
    the same VersionsDiffer on both ranks, naming each rank's length: no hang, no rank left alone."""
    import torch.multiprocessing as mp

    from ..read.test_sampler import free_port

    result = str(tmp_path / "result")
    join_within(mp.start_processes(ranks_of_other_lengths, (free_port(), result), nprocs=2, join=False), 60)
    got = [torch.load(f"{result}.{r}", weights_only=False) for r in range(2)]
    assert [g[0] for g in got] == ["error", "error"] and got[0][1] == got[1][1], got
    assert "20 records" in got[0][1] and "21 records" in got[0][1] and "barrier" in got[0][1]
