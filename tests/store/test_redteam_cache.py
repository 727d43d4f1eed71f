"""Red-team of the remote path, part 2: the node cache under attack. Objects replaced, cut or deleted
mid-epoch and mid-transfer; a cache left by an older version of the dataset, or with leftovers an
older run left; two nodes (two cache dirs) on one bucket; fetchers and DataLoader workers killed with
SIGKILL while they hold a unit's lock; a cache dir on a full disk (a small tmpfs). Each attack one
attempt against the real S3 server: the dataset's bytes or one line of a packer error naming the
object, no hang, the limit held as ``du`` counts it, and the cache usable after."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from packer import ShardDataset, build
from packer.read.remote import settings
from packer.store import base

from .proxy import Faults, Proxy
from .redteam import Copy, du, in_time, outcome, read_local, same, samples, upload
from .seaweed import S3Server

UNIT = 60_000  # bytes of a memmap unit here: each shard of ~300 KB is 5 or 6 units
LIMIT = 3 << 20


@pytest.fixture(autouse=True)
def _small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "UNIT_BYTES", UNIT)
    monkeypatch.setattr(base, "BACKOFF_S", 0.001)


@pytest.fixture(scope="module")
def want(built) -> dict[str, list]:
    return {b: read_local(built(b, "jpeg")) for b in ("memmap", "lmdb")}


@pytest.fixture(scope="module")
def rebuilt(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same photos built again at another quality: data files of the same names, other bytes."""
    root = tmp_path_factory.mktemp("rebuilt")
    out = {}
    for backend in ("memmap", "lmdb"):
        out[backend] = root / backend
        build(raw_photos, out[backend], backend=backend, format="jpeg", workers=1, quiet=True, shard_size=7, quality=60)
    return out


def _first_file(local: Path) -> str:
    return str(Copy.of(local, published=False).manifest["shards"][0]["file"])


def _put(server: S3Server, prefix: str, key: str, body: bytes | None) -> None:
    if body is None:
        server.client.delete_object(Bucket=server.bucket, Key=f"{prefix}/{key}")
    else:
        server.client.put_object(Bucket=server.bucket, Key=f"{prefix}/{key}", Body=body)


# --- objects replaced, cut or deleted mid-epoch (after the first sample) and mid-transfer ---------

REPLACEMENTS: dict[str, Callable[[bytes, bytes], bytes | None]] = {
    "same-bytes-again": lambda old, other: old,
    "same-size-noise": lambda old, other: bytes(np.random.default_rng(1).integers(0, 256, len(old), dtype=np.uint8)),
    "cut-in-half": lambda old, other: old[: len(old) // 2],
    "one-byte-more": lambda old, other: old + b"\0",
    "deleted": lambda old, other: None,
    "other-version": lambda old, other: other,
}


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("kind", list(REPLACEMENTS))
def test_object_replaced_mid_epoch(
    kind: str, backend: str, built, rebuilt, want, s3_server: S3Server, tmp_path: Path
) -> None:
    """The first sample read, then its data object replaced in the bucket: the epoch goes on with
    the dataset's bytes (what the cache has, and the object's own version where it is the same), or
    fails naming the object; a fresh open once the bucket is repaired reads right."""
    local = built(backend, "jpeg")
    prefix = f"redteam-mid/{kind}-{backend}"
    url = upload(s3_server, prefix, Copy.of(local, published=False).objects())
    cache = tmp_path / "cache"
    name = _first_file(local)
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=LIMIT)
    assert torch.equal(ds[0][0], want[backend][0][0])
    _put(
        s3_server, prefix, name, REPLACEMENTS[kind]((local / name).read_bytes(), (rebuilt[backend] / name).read_bytes())
    )
    try:
        got = in_time(lambda: samples(ds))
    except Exception as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{url}/{name}: "), message
        assert backend == "memmap" and kind != "same-bytes-again", message  # LMDB's one unit is in the cache
    else:
        assert same(got, want[backend])  # the units fetched before, or the same bytes again
    assert du(cache) <= LIMIT
    _put(s3_server, prefix, name, (local / name).read_bytes())
    assert outcome(url, cache, want[backend], cache_limit=LIMIT) == "ok"


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("kind", ["same-size-noise", "cut-in-half", "deleted", "other-version"])
def test_object_replaced_mid_transfer(
    kind: str, backend: str, built, rebuilt, want, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A data object's body cut short by the network and the object replaced before the resume: the
    resume is pinned to the first response's ETag, so nothing of the new object is spliced in."""
    local = built(backend, "jpeg")
    prefix = f"redteam-transfer/{kind}-{backend}"
    url = upload(s3_server, prefix, Copy.of(local, published=False).objects())
    name = _first_file(local)
    body = REPLACEMENTS[kind]((local / name).read_bytes(), (rebuilt[backend] / name).read_bytes())
    proxy.faults.append(Faults(match=f"{prefix}/{name}", truncate=1, then=lambda: _put(s3_server, prefix, name, body)))
    cache = tmp_path / "cache"
    got = outcome(url, cache, want[backend])
    assert got.startswith(f"{url}/{name}: ") and ("replaced" in got or "missing" in got or "bytes" in got), got
    proxy.clear()
    _put(s3_server, prefix, name, (local / name).read_bytes())
    assert outcome(url, cache, want[backend]) == "ok"


# --- a cache left by an older version of the dataset, or by an older run ---------------------------


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("published", [False, True], ids=["synced", "published"])
def test_stale_cache_of_an_older_version(
    backend: str, published: bool, built, rebuilt, want, s3_server: S3Server, tmp_path: Path
) -> None:
    """The cache filled from version 1; the bucket then holds version 2, whose data files have the
    same names and other bytes: a fresh open reads version 2's bytes, never a cached byte of 1; a
    dataset opened on version 1 keeps reading version 1 where the bucket keeps it (published)."""
    old, new = built(backend, "jpeg"), rebuilt[backend]
    prefix = f"redteam-stale/{backend}-{published}"
    url = upload(s3_server, prefix, Copy.of(old, published=published).objects())
    cache = tmp_path / "cache"
    assert outcome(url, cache, want[backend], cache_limit=LIMIT) == "ok"
    first = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=LIMIT)
    second = Copy.of(new, published=published)
    objects = second.objects()
    if published:  # the old version's folder stays, as a publish leaves it
        objects |= {k: v for k, v in Copy.of(old, published=True).objects().items() if k.startswith("versions/")}
    upload(s3_server, prefix, objects)
    assert outcome(url, cache, read_local(new), cache_limit=LIMIT) == "ok"
    assert same(samples(first), want[backend])  # cached by now, and pinned
    assert du(cache) <= LIMIT


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_published_copy_replaced_by_a_synced_one_of_the_same_version(
    backend: str, built, want, s3_server: S3Server, tmp_path: Path
) -> None:
    """The cache has a published version (its files.json names keys under versions/); the bucket
    then holds the same version synced as it is (aws s3 sync: no versions/, no layout metadata):
    the first read fails in one line naming the object files.json named, and marks it; the next
    open finds the bucket's version has no files.json and reads the data files at U/NAME."""
    local = built(backend, "jpeg")
    prefix = f"redteam-resynced/{backend}"
    url = upload(s3_server, prefix, Copy.of(local, published=True).objects())
    cache = tmp_path / "cache"
    assert outcome(url, cache, want[backend], cache_limit=LIMIT) == "ok"
    (home,) = [p for p in cache.iterdir() if p.is_dir()]
    _drop_units(home)  # evicted meanwhile: fetched again, from where the cached files.json says
    _put(s3_server, prefix, "manifest.json", None)  # the same bytes without the layout's metadata
    upload(s3_server, prefix, Copy.of(local, published=False).objects())
    failed = outcome(url, cache, want[backend], cache_limit=LIMIT)
    assert failed.startswith(f"{url}/versions/") and "missing" in failed, failed
    assert outcome(url, cache, want[backend], cache_limit=LIMIT) == "ok"
    assert du(cache) <= LIMIT


def _leftover(kind: str, cache: Path) -> None:
    """What an older run (killed, or of an older packer) may leave in a dataset's cache folder."""
    (home,) = [p for p in cache.iterdir() if p.is_dir()]
    partial, units = home / "partial", home / "units"
    if kind == "garbage-partial-listed-done":  # a part a killed download logged done, with other bytes
        for unit in list(units.iterdir()):
            if not unit.name.endswith(".rows.npy"):
                part = partial / unit.name
                part.write_bytes(os.urandom(unit.stat().st_size))
                (partial / (unit.name + ".parts")).write_bytes(b"part_bytes 8388608\n0\n1\n2\n")
        _drop_units(home)
    elif kind == "parts-log-of-another-part-size":
        for unit in list(units.iterdir()):
            if not unit.name.endswith(".rows.npy"):
                (partial / unit.name).write_bytes(b"\0" * unit.stat().st_size)
                (partial / (unit.name + ".parts")).write_bytes(b"part_bytes 7\n0\n")
        _drop_units(home)
    elif kind == "sidecars-garbage":
        for side in units.glob("*.rows.npy"):
            side.write_bytes(b"\x93NUMPY garbage")
        _unlink_version_links(home)
    elif kind == "sidecars-of-other-records":
        for side in units.glob("*.rows.npy"):
            rows = np.load(side)
            rows["crc32"] ^= 1
            np.save(side, rows)
        _unlink_version_links(home)
    elif kind == "sidecars-missing":
        for side in units.glob("*.rows.npy"):
            side.unlink()
        _unlink_version_links(home)
    elif kind == "stray-files":
        for d in (units, partial, home / "locks", home / "versions"):
            (d / "stray.tmp").write_bytes(b"x" * 5000)
    elif kind == "version-folder-without-manifest":
        for v in (home / "versions").iterdir():
            (v / "manifest.json").unlink()
    elif kind == "staging-of-a-dead-open":
        (partial / "0123456789abcdef0123456789abcdef.99999").mkdir()
        (partial / "0123456789abcdef0123456789abcdef.99999" / "index.npy").write_bytes(b"\0" * 4096)
    elif kind == "locks-left":
        for name in ("unit-shard-00000.bin", "unit-data.mdb", "version-x"):
            (home / "locks" / name).write_bytes(b"")
    else:
        raise AssertionError(kind)


def _drop_units(home: Path) -> None:
    for unit in (home / "units").iterdir():
        unit.unlink()
    _unlink_version_links(home)


def _unlink_version_links(home: Path) -> None:
    for v in (home / "versions").iterdir():
        for f in v.iterdir():
            if f.name.startswith(("shard-", "data")):
                f.unlink()


LEFTOVERS = [
    "garbage-partial-listed-done",
    "parts-log-of-another-part-size",
    "sidecars-garbage",
    "sidecars-of-other-records",
    "sidecars-missing",
    "stray-files",
    "version-folder-without-manifest",
    "staging-of-a-dead-open",
    "locks-left",
]


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("kind", LEFTOVERS)
def test_leftovers_of_an_older_run(kind: str, backend: str, built, want, s3_server: S3Server, tmp_path: Path) -> None:
    """A cache with what a killed or older run left: the next open reads the dataset's bytes (a
    leftover download's parts are checked before use, not trusted) within the limit."""
    local = built(backend, "jpeg")
    url = upload(s3_server, f"redteam-left/{kind}-{backend}", Copy.of(local, published=False).objects())
    cache = tmp_path / "cache"
    assert outcome(url, cache, want[backend]) == "ok"
    _leftover(kind, cache)
    assert outcome(url, cache, want[backend], cache_limit=LIMIT) == "ok"
    assert du(cache) <= LIMIT


# --- two nodes: two cache dirs on one bucket ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_two_nodes_on_one_bucket(backend: str, built, want, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """Two node caches read one bucket at once: both read the dataset's bytes, each node fetches each
    data file once (twice in all), and neither's limit counts the other's files."""
    local = built(backend, "jpeg")
    url = upload(s3_server, f"redteam-nodes/{backend}", Copy.of(local, published=False).objects())
    proxy.faults.append(Faults(delay=0.01))
    results: dict[int, str] = {}
    threads = [
        threading.Thread(
            target=lambda n=n: results.__setitem__(
                n, outcome(url, tmp_path / f"node{n}", want[backend], cache_limit=LIMIT)
            )
        )
        for n in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: "ok", 1: "ok"}
    for name in Copy.of(local, published=False).data:
        assert proxy.fetched(name) == 2 * (local / name).stat().st_size, name
    assert all(du(tmp_path / f"node{n}") <= LIMIT for n in range(2))


# --- fetchers and DataLoader workers killed (SIGKILL) while they hold a unit's lock -------------------


def _fetcher(url: str, cache: Path, limit: int | None, workers: bool) -> None:
    """A reader of the whole dataset (a forked process: no interpreter to start), in its own
    process group, so that the test kills it with its DataLoader workers."""
    os.setsid()
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=limit)
    if workers:
        for _ in DataLoader(ds, batch_size=4, num_workers=2):
            pass
    else:
        for i in range(len(ds)):
            ds[i]


def _dead(process: psutil.Process) -> bool:
    """Whether ``process`` has ended (a zombie its parent has not reaped yet, or gone)."""
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _downloading(cache: Path) -> bool:
    return any(p.stat().st_size for p in cache.glob("*/partial/*") if p.is_file() and not p.name.endswith(".parts"))


@pytest.mark.parametrize("limit", ["none", "limit"])
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("who", ["fetcher", "worker"])
def test_killed_while_holding_a_unit_lock(
    who: str, backend: str, limit: str, built, want, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A reader process (or one of its DataLoader workers) killed with SIGKILL mid-download, holding
    the unit's lock and its reserved room: the next reader of the node cache takes the lock (the
    kernel released it), resumes or refetches, and reads the dataset's bytes within the limit."""
    local = built(backend, "jpeg")
    url = upload(s3_server, f"redteam-kill/{who}-{backend}-{limit}", Copy.of(local, published=False).objects())
    cache = tmp_path / "cache"
    proxy.faults.append(Faults(rate=300_000))  # slow: the download is in flight when the kill comes
    args = (url, cache, LIMIT if limit == "limit" else None, who == "worker")
    child = mp.get_context("fork").Process(target=_fetcher, args=args)
    child.start()
    assert child.pid is not None
    try:
        deadline = time.monotonic() + 120  # bounds a hang only: the wait ends as the download starts
        while not _downloading(cache) and time.monotonic() < deadline and child.is_alive():
            time.sleep(0.02)
        assert _downloading(cache), "no download started"
        if who == "worker":
            workers = [p for p in psutil.Process(child.pid).children() if p.status() != psutil.STATUS_ZOMBIE]
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60  # the workers dead (a zombie or reaped) before their parent
            while not all(_dead(w) for w in workers):
                assert time.monotonic() < deadline, "a worker killed with SIGKILL still runs after 60 s"
                time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.join(10)
    proxy.settle()
    proxy.clear()
    kw = {"cache_limit": LIMIT} if limit == "limit" else {}
    assert outcome(url, cache, want[backend], **kw) == "ok"
    if limit == "limit":
        assert du(cache) <= LIMIT


# --- a cache dir on a full disk ----------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of a given size mounted on a fresh folder (unmounted after): a real full disk."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("size", [8 << 10, 64 << 10, 400 << 10, 1 << 20])
@pytest.mark.parametrize("limit", [None, LIMIT], ids=["unlimited", "limit-above-the-disk"])
def test_cache_on_a_full_disk(
    size: int, backend: str, limit: int | None, built, want, s3_server: S3Server, small_disk, tmp_path: Path
) -> None:
    """The cache dir on a disk smaller than the dataset: the read fails in one line naming the
    object and the cache dir (or reads right, where the disk holds the units read at once), and the
    same cache on a disk with room afterwards reads right."""
    local = built(backend, "jpeg")
    url = upload(s3_server, f"redteam-disk/{backend}-{size}-{limit}", Copy.of(local, published=False).objects())
    disk = small_disk(size)
    cache = disk / "cache"
    got = outcome(url, cache, want[backend], cache_limit=limit)
    if got != "ok":
        assert got.startswith(url) and f"the disk of the cache {cache} is full (No space left on device)" in got, got
    # room again: the same cache, its leftovers and all, copied onto a disk with room
    roomy = tmp_path / "roomy"
    shutil.copytree(cache, roomy, symlinks=True) if cache.exists() else roomy.mkdir()
    assert outcome(url, roomy, want[backend], cache_limit=limit) == "ok"
