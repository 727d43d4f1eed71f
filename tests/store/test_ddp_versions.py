"""DDP ranks that opened different versions of a dataset in object storage: a publish (``packer
build raw/ s3://... --update``) lands between rank 0's open and rank 1's. ShardSampler's agreement
(packer.read.sampler._agree_on_version) reopens rank 0's dataset at the store's current version
(Remote.reopen), so both ranks read one version, with the same units and blocks, and the old
version is let go of (evictable); a reopen that fails on one rank makes both raise VersionsDiffer.
Real processes throughout: 2 gloo ranks (spawned), 2 DataLoader workers each, the SeaweedFS server.

The images are those of tests/behaviour/test_refresh_readers.py (one flat colour per source, so a
sample shows which source it came from); the publish adds 5 larger ones that sort first (every
older record moves by 5, and the records' mean size changes, so the version sets another
``per_unit``: a rank that kept its first version's would draw other blocks)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from packer import ShardDataset, ShardSampler, VersionsDiffer
from packer.format import INDEX
from packer.read.remote import settings
from packer.read.remote.eviction import _version_held, evict_version
from packer.read.remote.paths import VERSIONS
from packer.store import open_store
from packer.store.published import version_key
from packer.tools.publish import publish_build

from ..behaviour.test_refresh_readers import CROP, check, colour, join_within
from ..behaviour.test_refresh_readers import raw as raw  # the fixture: 3 classes x 7 flat-coloured images
from ..read.test_sampler import free_port
from .seaweed import S3Server

UNIT = 16_000  # bytes of a memmap unit: 4 records of the first version (40x32 raw), 2 of the second's mean
OPTIONS: dict[str, Any] = {"format": "raw", "workers": 1, "quiet": True, "shard_size": 10}


def publish_five_larger_first(raw: Path, url: str, backend: str, staging: str) -> None:
    """5 images of 64x48 in class 0 that sort before every other, published as the next version."""
    for j in range(5):
        Image.new("RGB", (64, 48), colour(0, 25 + j)).save(raw / "c0" / f"a{25 + j:02d}.png")
    publish_build(raw, url, backend=backend, update=True, staging=staging, **OPTIONS)


def ranks_across_a_publish(
    rank: int, port: int, raw: str, url: str, backend: str, caches: list[str], contexts: list[str], fail: bool, out: str
) -> None:
    """One of 2 gloo ranks: rank 0 opens the dataset, publishes the next version (barriers order
    it), rank 1 opens it (with ``fail``: then deletes that version's index from the bucket, so that
    rank 0's reopen cannot fetch it), both build ShardSampler(ds) (ranks from torch.distributed)
    and read their draws of one epoch through 2 workers (``contexts[rank]``), each sample checked
    against the source the dataset's index names. Saves what the rank saw, or the error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    settings.UNIT_BYTES = UNIT
    import torch.distributed as dist

    # a hang's bound only: a barrier waits for the other rank's publish (seconds; more on a loaded box)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=180))

    def open_it() -> ShardDataset:
        return ShardDataset(url, crop_size=CROP, train=False, dtype=torch.uint8, cache_dir=caches[rank])

    ds = open_it() if rank == 0 else None
    dist.barrier()
    if rank == 0:
        publish_five_larger_first(Path(raw), url, backend, str(Path(out).parent / "staging"))
    dist.barrier()
    ds = ds or open_it()
    assert ds._remote is not None
    opened = ds._remote.version
    if fail and rank == 1:
        open_store(url).delete(version_key(opened, INDEX))
    dist.barrier()
    try:
        sampler = ShardSampler(ds, drop_last=True)
    except VersionsDiffer as e:
        got: tuple[Any, ...] = ("error", str(e), opened, ds._remote.version, len(ds), ds[0][1])
    else:
        root = ds._remote.home / VERSIONS
        held = (_version_held(root / opened), _version_held(root / ds._remote.version))  # before any worker
        draws = (rank + 2 * np.arange(len(sampler))).tolist()
        records = sampler.sequence()[draws].tolist()
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=contexts[rank])
        steps = 0
        for images, labels in loader:
            check(ds, records[4 * steps : 4 * steps + len(labels)], images, labels)
            steps += 1
        done = torch.tensor([steps])
        dist.all_reduce(done)  # a rank with another step count would not get here in step
        dist.barrier()  # both epochs read: the old version is no reader's
        evicted = evict_version(root / opened) if opened != ds._remote.version else None
        got = ("ok", ds._remote.version, len(ds), len(sampler), steps, ds._remote.per_unit, records, opened, held)
        got += (evicted, ds[0][0])
    torch.save(got, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(
    s3: S3Server, raw: Path, tmp: Path, backend: str, *, shared_cache: bool, contexts: list[str], fail: bool
) -> list[Any]:
    """The first version published, then the 2 ranks (a deadline: never a hang); what each saved."""
    import torch.multiprocessing as mp

    url = f"s3://{s3.bucket}/ddp-versions/{tmp.name}/{backend}" + (".lmdb" if backend == "lmdb" else "")
    publish_build(raw, url, backend=backend, staging=tmp / "staging", **OPTIONS)
    caches = [str(tmp / "node-cache")] * 2 if shared_cache else [str(tmp / f"node{r}-cache") for r in range(2)]
    out = str(tmp / "result")
    ctx = mp.start_processes(
        ranks_across_a_publish,
        (free_port(), str(raw), url, backend, caches, contexts, fail, out),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    join_within(ctx, 480)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("backend,contexts", [("memmap", ["spawn", "fork"]), ("lmdb", ["fork", "spawn"])])
def test_ranks_that_opened_two_versions_in_object_storage_agree_on_the_newest(
    backend: str, contexts: list[str], raw: Path, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 reopens the store's current version: both ranks read it (26 records), with the same
    units, length and steps, and between them every record exactly once (their draws of one
    sequence); its workers (spawned or forked after the agreement) read it too. Rank 0 let go of
    its first version as soon as it reopened (no reader holds it: a node's eviction may take it)."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    got = run_ranks(s3_server, raw, tmp_path, backend, shared_cache=True, contexts=contexts, fail=False)
    assert [g[0] for g in got] == ["ok", "ok"], got
    (_, v0, n0, len0, steps0, unit0, records0, opened0, held0, evicted0, first0) = got[0]
    (_, v1, n1, len1, steps1, unit1, records1, opened1, _, _, first1) = got[1]
    assert opened0 != opened1 == v1 == v0, "rank 0 opened the first version, and reopened the second"
    assert (n0, len0, steps0, unit0) == (n1, len1, steps1, unit1) and n0 == 26 and len0 == 13
    assert (unit0 > 0) == (backend == "memmap")
    assert sorted(records0 + records1) == list(range(26))
    assert held0 == (False, True), "rank 0 still held its first version after reopening"
    assert evicted0 is True, "the first version could not be evicted"
    assert torch.equal(first0, first1)


def test_a_reopen_that_fails_on_one_rank_fails_every_rank(
    raw: Path, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks on two nodes (a cache each): rank 0's reopen cannot fetch the new version's index (it
    was deleted from the bucket after rank 1 cached it). Both raise the same VersionsDiffer, which
    says why rank 0's reopen failed; no hang. Rank 0's dataset still reads the version it opened."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    got = run_ranks(s3_server, raw, tmp_path, "memmap", shared_cache=False, contexts=["fork", "fork"], fail=True)
    assert [g[0] for g in got] == ["error", "error"], got
    assert got[0][1] == got[1][1], "the ranks raised different errors"
    message = got[0][1]
    assert "21 records" in message and "26 records" in message and "barrier" in message
    assert "reopening failed: rank 0: s3://" in message and "index.npy: missing" in message, message
    assert "rank 1:" not in message.partition("reopening failed")[2], message  # rank 1's reopen worked
    (_, _, opened0, version0, n0, label0), (_, _, opened1, version1, n1, _) = got
    assert version0 == opened0 != opened1 == version1 and (n0, n1) == (21, 26)
    assert label0 == 0  # rank 0's record 0 read from its old version: m00.png, class 0
