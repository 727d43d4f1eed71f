"""Red-team of the remote path, part 4: refreshes published while training reads. One epoch of 2 DDP
ranks (processes, ShardSampler(num_replicas=2, rank=r)) x 2 DataLoader workers each (forked, or
spawned: they reopen the pinned version from the cache) on one node cache with a cache_limit,
while ``packer build raw/ s3://... --update`` (publish_build) publishes 10 refreshes (append-only
segments: files added first and last, one changed, one deleted) in lockstep with the ranks'
batches, and a fresh reader opens each new version on the same cache.

What the docs promise (docs/OBJECT-STORAGE.md, "Refreshing a bucket every night"): every rank and
worker keeps the version it opened, so every sample a rank is served is byte for byte the record
its sampler drew from that version (compared with the publish's own staged copy of it), and a fresh
open reads the newest version right; nothing hangs (every wait is bounded), the cache never takes
more than its limit as ``du`` counts it, and it stays usable after."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from packer import ShardDataset, ShardSampler
from packer.format import MANIFEST
from packer.read.remote import settings
from packer.read.remote.eviction import BLOCK
from packer.store.published import version_id
from packer.tools.publish import publish_build

from .du import du_peak, on_disk
from .seaweed import S3Server

PUBLISHES = 10
FIRST = 16  # photos per class in the first version (2 classes): 16 batches of 1 per rank
UNIT = 4_000  # bytes of a memmap unit: 4 raw 20x16 records
WAIT_S = 120.0  # the longest any side waits for the other (a hang fails, it does not block the suite)


def _paint(raw: Path, cls: int, name: str, shade: int = 128) -> None:
    path = raw / f"c{cls}" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    number = sum(map(ord, name)) % 64
    Image.new("RGB", (20, 16), (40 + 80 * cls, 4 * number, shade)).save(path)


def _change(raw: Path, k: int) -> None:
    """Refresh ``k``'s change of raw/: files added that sort first (every later record moves), added
    last, one changed in place, one deleted."""
    if k == 4:
        _paint(raw, 0, "m003", shade=7)
    elif k == 7:
        (raw / "c1" / "m005.png").unlink()
    elif k % 2:
        _paint(raw, k % 2, f"a{k:02}")
        _paint(raw, 0, f"a{k:02}")
    else:
        _paint(raw, 1, f"z{k:02}")


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()


def _snapshot(staging: Path) -> tuple[str, list[tuple[str, int]]]:
    """The version the publish just made current, from its own staged copy: its id and every
    record's (pixels' sha256, label)."""
    (manifest,) = [p for p in staging.glob(f"*/*/{MANIFEST}") if not p.parent.name.startswith(".")]
    local = ShardDataset(manifest.parent, crop_size=None, dtype=torch.uint8)
    return version_id(manifest.read_bytes()), [(_digest(x), int(y)) for x, y in (local[i] for i in range(len(local)))]


def _signal(folder: Path, name: str, value: Any) -> None:
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, folder / name)


def _value(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text())
    except FileNotFoundError:
        return None


def _rank(url: str, cache: str, limit: int, rank: int, context: str, env: dict[str, str], folder: str) -> None:
    """One DDP rank (a process of its own, opening the dataset itself): its epoch through 2
    workers, one draw per batch; after batch b it says so and waits for refresh b (up to the
    last), so that the refreshes are published between its batches. Writes the version it
    pinned, its draws and each sample it was served, or the one line of the error it failed with."""
    os.environ.update(env)
    settings.UNIT_BYTES = UNIT
    here = Path(folder)
    out: dict[str, Any] = {"samples": []}
    try:
        ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=limit)
        sampler = ShardSampler(ds, seed=3, num_replicas=2, rank=rank, drop_last=True)
        positions = rank + 2 * np.arange(len(sampler))
        out |= {"version": ds._remote.version, "records": sampler.sequence()[positions].tolist()}
        loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=2, multiprocessing_context=context)
        _signal(here, f"rank{rank}", 0)
        for b, (images, labels) in enumerate(loader):
            out["samples"] += [(_digest(x), int(y)) for x, y in zip(images, labels)]
            _signal(here, f"rank{rank}", b + 1)
            deadline = time.monotonic() + WAIT_S
            while (_value(here, "published") or 0) < min(b + 1, PUBLISHES) and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception as e:  # reported to the test, which asserts what it may be
        out["error"] = f"{type(e).__name__}: {e}"
    _signal(here, f"result{rank}", out)


def _wait_ranks(folder: Path, ranks: list[Any], at_least: int) -> None:
    """Until both ranks have read ``at_least`` batches (or ended: the test then reads their result)."""
    deadline = time.monotonic() + WAIT_S
    while not all((_value(folder, f"rank{r}") or 0) >= at_least or not p.is_alive() for r, p in enumerate(ranks)):
        assert time.monotonic() < deadline, f"the ranks did not reach batch {at_least} in {WAIT_S:.0f} s"
        time.sleep(0.01)


#: Each rank's DataLoader workers: forked, or spawned (a pickled copy reopens the pinned version).
@pytest.mark.parametrize("backend,contexts", [("memmap", ("fork", "spawn")), ("lmdb", ("spawn", "fork"))])
def test_ten_refreshes_during_one_ddp_epoch(
    backend: str, contexts: tuple[str, str], s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    monkeypatch.setattr(settings, "UNIT_BYTES", UNIT)
    raw, staging, cache, folder = (tmp_path / n for n in ("raw", "staging", "node-cache", "signals"))
    folder.mkdir()
    for c in range(2):
        for j in range(FIRST):
            _paint(raw, c, f"m{j:03}")
    url = f"s3://{s3_server.bucket}/redteam-refresh/{backend}" + (".lmdb" if backend == "lmdb" else "")
    options: dict[str, Any] = {"workers": 1, "quiet": True, "shard_size": 8, "format": "raw", "short_edge": 16}
    options["staging"] = staging
    publish_build(raw, url, backend=backend, **options)
    versions = dict([_snapshot(staging)])
    newest = next(iter(versions))

    def fresh(limit: Optional[int], where: Path = cache) -> list[tuple[str, int]]:
        ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=where, cache_limit=limit)
        assert ds._remote.version == newest
        return [(_digest(x), int(y)) for x, y in (ds[i] for i in range(len(ds)))]

    # the limit, measured on a cache of the first version read whole: what the cache keeps of 3
    # versions, and a third of the memmap units; or LMDB's files twice and room for the 10 segments
    # the refreshes add (an LMDB reader holds every file it opened)
    probe = tmp_path / "probe"
    assert fresh(None, probe) == versions[newest]
    units = sum(on_disk(p)[1] for p in probe.glob("*/units"))
    fixed = on_disk(probe)[1] - units
    limit = 3 * fixed + (units // 3 if backend == "memmap" else 2 * units + PUBLISHES * 4 * BLOCK)
    ranks = [
        mp.get_context("fork").Process(
            target=_rank, args=(url, str(cache), limit, r, contexts[r], dict(os.environ), str(folder))
        )
        for r in range(2)
    ]
    for r in ranks:
        r.start()
    try:
        with du_peak(cache) as peak:
            for k in range(1, PUBLISHES + 1):
                _wait_ranks(folder, ranks, k)
                _change(raw, k)
                publish_build(raw, url, backend=backend, update=True, **options)
                version, records = _snapshot(staging)
                assert version not in versions, f"refresh {k} published no new version"
                versions[version], newest = records, version
                _signal(folder, "published", k)
                assert fresh(limit) == records, f"a fresh open after refresh {k} did not read it right"
            for r in ranks:
                r.join(WAIT_S)
                assert not r.is_alive(), f"a rank hung ({WAIT_S:.0f} s)"
    finally:
        for r in ranks:
            r.kill()
    assert peak[1] <= limit, f"the cache took {peak[1]} bytes, over its limit {limit}"
    first = next(iter(versions))
    for rank in range(2):
        result = _value(folder, f"result{rank}")
        assert result is not None and "error" not in result, result and result.get("error")
        assert result["version"] == first, "a rank opened before the refreshes did not keep its version"
        want = [versions[first][i] for i in result["records"]]
        assert len(result["samples"]) == len(want) > PUBLISHES
        wrong = [i for i, (got, exp) in enumerate(zip(result["samples"], want)) if tuple(got) != tuple(exp)]
        assert not wrong, f"rank {rank} was served other bytes than its version's at draws {wrong}"
    # the cache usable after: a fresh open reads the newest version right, within the limit, and
    # the metadata of the versions no reader holds any more was evicted for it
    assert fresh(limit) == versions[newest]
    assert on_disk(cache)[1] <= limit
    assert len(list(cache.glob("*/versions/*"))) < len(versions)
