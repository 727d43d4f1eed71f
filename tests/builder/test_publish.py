"""Publishing to object storage (packer.tools.publish) against the real S3 server (SeaweedFS on
127.0.0.1) through the fault proxy, which counts every request and the bytes each upload sent.

Every image is one flat colour that encodes its class (red) and its own number (green), so a reader
can tell from the pixels alone whether each sample is the source its index names, with that label,
and which files a version holds: a version seen part old and part new would show.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import packer
from packer import BuildError, ShardDataset, URLNotSupported
from packer.store import open_store
from packer.store.base import Store
from packer.store.published import FILES, LEASE, read_files, version_id
from packer.tools.publish import publish_build, publish_compact

from ..store.proxy import Faults, Proxy
from ..store.seaweed import S3Server

CLASSES = 2
PER_CLASS = 5
CROP = 8


def colour(cls: int, number: int) -> tuple[int, int, int]:
    return 40 + 80 * cls, 4 * number % 256, 128


def write(raw: Path, cls: int, number: int) -> None:
    path = raw / f"c{cls}" / f"m{number:03d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 16), colour(cls, number)).save(path)


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    for c in range(CLASSES):
        for k in range(PER_CLASS):
            write(root, c, c * PER_CLASS + k)
    return root


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read cache (and the publish's staging, under it) in this test's folder."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))


def _url(s3_server: S3Server, name: str) -> str:
    return f"s3://{s3_server.bucket}/publish/{name}"


def _publish(raw: Path, url: str, **options: Any):
    return publish_build(raw, url, workers=1, quiet=True, shard_size=4, format="raw", short_edge=16, **options)


def numbers(url: str, cache: Path) -> list[int]:
    """Every record of the current version at ``url`` read (fresh cache ``cache``), each checked:
    label and pixels those of the source its index names; the sources' numbers, in order."""
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
    return read_checked(ds)


def read_checked(ds: ShardDataset) -> list[int]:
    seen = []
    for i in range(len(ds)):
        image, label = ds[i]
        folder, name = ds.source(i).split("/")
        cls, number = int(folder[1:]), int(name[1:4])
        red, green = image.to(torch.float64).mean(dim=(1, 2)).tolist()[:2]
        assert label == cls and (round(red), round(green)) == colour(cls, number)[:2], (i, ds.source(i), red, green)
        seen.append(number)
    return seen


def puts(proxy: Proxy) -> dict[str, int]:
    """Bytes received per object written (PUT, multipart parts included), keys relative to the bucket."""
    return {key: n for key, n in proxy.received.items() if n or ("PUT", key) in proxy.requests}


def writes(proxy: Proxy) -> list[str]:
    return sorted(key for (method, key) in proxy.requests if method in ("PUT", "POST", "DELETE"))


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_publish_update_uploads_the_change(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, backend):
    """A first publish, then --update with two files added: only the new segment's data file and
    the new version's metadata are uploaded; nothing changed: no write at all, one GET of the pointer."""
    url = _url(s3_server, f"update-{backend}" + (".lmdb" if backend == "lmdb" else ""))
    report, (done,) = _publish(raw, url)
    assert report.count == 10 and done.uploaded > 0 and not done.up_to_date
    assert numbers(url, tmp_path / "r1") == list(range(10))
    store = open_store(url)
    first = read_files(store, done.version)
    assert first is not None and all(e.key.startswith(f"versions/{done.version}/") for e in first.values())

    write(raw, 0, 40)
    write(raw, 1, 41)
    proxy.clear()
    report, (done,) = _publish(raw, url, update=True)
    assert report.processed == 2 and report.reused == 10
    files = read_files(store, done.version)
    assert files is not None
    new = {name for name, e in files.items() if e.key.startswith(f"versions/{done.version}/")}
    assert len(new) == 1 and all(files[n] == first[n] for n in files if n not in new)  # old objects reused
    sent = puts(proxy)
    data = [key for key in sent if key.rsplit("/", 1)[-1] in files]
    assert data == [f"/{s3_server.bucket}/publish/{url.rsplit('/', 1)[-1]}/{files[n].key}" for n in new]
    assert sorted(numbers(url, tmp_path / "r2")) == [*range(10), 40, 41]

    proxy.clear()
    report, (done,) = _publish(raw, url, update=True)
    assert report.up_to_date and done.up_to_date and writes(proxy) == []
    assert list(proxy.requests.elements()) == [
        ("GET", f"/{s3_server.bucket}/publish/{url.rsplit('/', 1)[-1]}/manifest.json")
    ]


def test_update_from_the_store_alone(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """Another machine (here: the staging folder deleted) refreshes from the store's manifest and
    index alone: no data file is downloaded, only the new segment is uploaded."""
    url = _url(s3_server, "elsewhere")
    _publish(raw, url, staging=tmp_path / "machine-a")
    write(raw, 1, 42)
    proxy.clear()
    report, (done,) = _publish(raw, url, update=True, staging=tmp_path / "machine-b")
    assert report.processed == 1 and report.reused == 10
    files = read_files(open_store(url), done.version)
    assert files is not None
    downloaded = [key for key, n in proxy.sent.items() if key.rsplit("/", 1)[-1] in files and n]
    assert downloaded == []
    uploaded = [key for key in puts(proxy) if key.rsplit("/", 1)[-1] in files]
    assert len(uploaded) == 1
    assert sorted(numbers(url, tmp_path / "r")) == [*range(10), 42]


def test_refused_clearly(raw: Path, s3_server: S3Server, tmp_path: Path) -> None:
    url = _url(s3_server, "refused")
    _publish(raw, url)
    with pytest.raises(BuildError, match=r"refused already exists \(use force=True to replace it, or update=True"):
        _publish(raw, url)
    cli = _cli(raw, url, env=dict(os.environ, **s3_server.env(), PYTHONPATH=str(Path(__file__).parents[2])))
    _, err = cli.communicate(timeout=120)  # the command line names its flags
    assert (
        cli.returncode == 1 and "refused already exists (use --force to replace it, or --update to refresh it)" in err
    )
    with pytest.raises(URLNotSupported, match="read-only"):
        _publish(raw, "https://127.0.0.1:9/x")
    with pytest.raises(URLNotSupported, match=r"packer\.publish\(RAW, URL\) publish"):
        packer.build(raw, url)  # the local build names the call that publishes
    assert packer.publish is publish_build


def _cli(raw: Path, url: str, *flags: str, env: dict[str, str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "packer.cli", "build", str(raw), url, "--workers", "1", "--quiet"]
    argv += ["--shard-size", "4", "--format", "raw", "--short-edge", "16", *flags]
    return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _env(proxy: Proxy) -> dict[str, str]:
    return dict(os.environ, AWS_ENDPOINT_URL=proxy.url, PYTHONPATH=str(Path(__file__).parents[2]))


def _killed_when(proc: subprocess.Popen, proxy: Proxy, method: str, match: str, how: int = signal.SIGKILL) -> int:
    """kill -9 (or ``how``) the publish once the proxy has seen a ``method`` request for a key
    containing ``match``; its exit status."""
    deadline = time.monotonic() + 60
    while not any(m == method and match in key for (m, key) in list(proxy.requests)):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if how == signal.SIGKILL:
        os.killpg(proc.pid, how)  # its whole process group, workers included
    else:
        proc.send_signal(how)  # the CLI unwinds as on Ctrl-C
    code = proc.wait(timeout=60)
    proxy.settle()
    return code


STEPS = {
    # a data file half sent (each PUT cut off mid-body), then kill -9
    "data-file-half-sent": ("kill", "shard-", Faults(match="shard-", method="PUT", truncate=10**6)),
    # the version's metadata refused: the publish fails (after its retries) before files.json
    "metadata-failed": ("fail", "index.npy", Faults(match="index.npy", method="PUT", fail=10**6)),
    # metadata sent, files.json not: kill -9 while its PUT keeps failing
    "files-json-killed": ("kill", FILES, Faults(match=FILES, method="PUT", fail=10**6)),
    # everything sent but the pointer
    "pointer-failed": ("fail", "POINTER", Faults(match="POINTER", method="PUT", fail=10**6)),
    # SIGTERM while the pointer's PUT keeps failing: the interrupted message, the lease released
    "pointer-terminated": ("term", "POINTER", Faults(match="POINTER", method="PUT", fail=10**6)),
    # killed at files.json, then the staging folder deleted: the rerun starts from the store's version
    "staging-deleted": ("kill", FILES, Faults(match=FILES, method="PUT", fail=10**6)),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_interrupted_publish_keeps_the_old_version(
    raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path, step: str
) -> None:
    """Killed or failed at each upload step: a reader opens the old version, whole; the same command
    run again finishes, uploading only what the interrupted one had not (also with its staging folder
    deleted: it starts again from the store's version, rebuilds the same bytes, and finds the objects
    the interrupted run left)."""
    url = _url(s3_server, f"interrupted-{step}")
    prefix = f"/{s3_server.bucket}/publish/interrupted-{step}"
    _publish(raw, url)
    write(raw, 0, 43)
    how, match, fault = STEPS[step]
    match = fault.match = f"{prefix}/manifest.json" if match == "POINTER" else match
    proxy.clear()
    proxy.faults.append(fault)
    proc = _cli(raw, url, "--update", env=_env(proxy))
    if how == "kill":
        _killed_when(proc, proxy, "PUT", match)
    elif how == "term":
        assert _killed_when(proc, proxy, "PUT", match, signal.SIGTERM) == 128 + signal.SIGTERM
        assert proc.stderr is not None and "interrupted; the dataset in the store is at its previous version" in (
            proc.stderr.read()
        )
    else:
        assert proc.wait(timeout=120) == 1
        assert proc.stderr is not None and "error" in proc.stderr.read()
    if step == "staging-deleted":
        shutil.rmtree(tmp_path / "cache" / "publish")
    store = open_store(url)
    if how == "kill":  # its lease outlives it by the lease's ttl (test_lease.py tests the takeover): skipped here
        store.delete(LEASE)
    landed = {o.key for o in store.list()}
    assert numbers(url, tmp_path / "reader") == list(range(10))  # the old version, whole

    proxy.clear()
    again = _cli(raw, url, "--update", env=_env(proxy))
    assert again.wait(timeout=120) == 0, again.stderr.read() if again.stderr else ""
    version = version_id(store.get("manifest.json"))
    files = read_files(store, version)
    assert files is not None
    new = {o.key for o in store.list()} - landed - {LEASE}  # (a listing may still show a lease just deleted)
    metadata = {f"versions/{version}/{n}" for n in ("manifest.json", "index.npy", "sources.npy", "report.jsonl", FILES)}
    assert new <= {e.key for e in files.values()} | metadata and bool(new) == (not step.startswith("pointer"))
    sent = {key.removeprefix(f"{prefix}/") for key in puts(proxy)} - {LEASE}
    assert sent == new | {"manifest.json"}  # only what was missing, and the pointer
    assert sorted(numbers(url, tmp_path / "after")) == [*range(10), 43]


def test_readers_see_whole_versions_through_refreshes(
    raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A reader opens and reads the dataset over and over while it is refreshed 10 times: every
    version it opens is one that was published, whole; one opened before the first refresh keeps
    reading its own version to the end."""
    url = _url(s3_server, "refreshes")
    _publish(raw, url)
    pinned = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "pinned")
    versions = [list(range(10))]
    seen: list[list[int]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(sorted(numbers(url, tmp_path / "reader")))
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for k in range(10):
            write(raw, k % CLASSES, 50 + k)
            versions.append(sorted([*versions[-1], 50 + k]))
            _publish(raw, url, update=True)
    finally:
        stop.set()
        thread.join()
    assert not failures, failures
    assert len(seen) >= 2 and all(s in versions for s in seen)
    assert read_checked(pinned) == list(range(10))
    loader = DataLoader(pinned, batch_size=4, num_workers=2)  # its workers too: the version it opened
    images, labels = (torch.cat(parts) for parts in zip(*loader))
    red = images.to(torch.float64).mean(dim=(2, 3))[:, 0]
    assert labels.tolist() == [0] * PER_CLASS + [1] * PER_CLASS
    assert [round(r) for r in red.tolist()] == [colour(int(label), 0)[0] for label in labels.tolist()]
    assert sorted(numbers(url, tmp_path / "last")) == versions[-1]


def test_two_publishers_one_wins(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """Two publishes of the same URL at once, from two machines (staging folders): one commits, the
    other fails cleanly; the store holds the winner's version, whole. Then two refreshes at once, the
    second with --wait: it waits for the lease, or fails over to the version the first committed and
    refreshes that, so it always ends current."""
    url = _url(s3_server, "race")
    other = tmp_path / "other"
    write(other, 0, 90)
    write(other, 1, 91)
    write(other, 1, 92)
    proxy.faults.append(Faults(match="shard-", method="PUT", fail=2))  # both still uploading when they meet
    a = _cli(raw, url, "--staging", str(tmp_path / "a"), env=_env(proxy))
    b = _cli(other, url, "--staging", str(tmp_path / "b"), env=_env(proxy))
    codes = sorted([a.wait(timeout=120), b.wait(timeout=120)])
    messages = (a.stderr.read() if a.stderr else "") + (b.stderr.read() if b.stderr else "")
    assert codes == [0, 1], messages
    assert "being built by" in messages or "another writer" in messages, messages
    first = sorted(numbers(url, tmp_path / "r1"))
    assert first in (list(range(10)), [90, 91, 92])

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    shutil.copytree(other if first == [90, 91, 92] else raw, mine)
    shutil.copytree(mine, theirs)
    write(mine, 0, 93)
    write(theirs, 1, 94)
    proxy.clear()
    proxy.faults.append(Faults(match="shard-", method="PUT", fail=2))
    a = _cli(theirs, url, "--update", "--staging", str(tmp_path / "a"), env=_env(proxy))
    b = _cli(mine, url, "--update", "--wait", "--staging", str(tmp_path / "c"), env=_env(proxy))
    assert b.wait(timeout=120) == 0, b.stderr.read() if b.stderr else ""
    a.wait(timeout=120)
    assert sorted(numbers(url, tmp_path / "r2")) == [*first, 93]


def test_compact_url_publishes_a_new_layout(raw: Path, s3_server: S3Server, tmp_path: Path) -> None:
    """``packer compact URL``: the refreshes' segments rewritten into one, published under the new
    version's folder; a reader of the old version keeps its objects."""
    url = _url(s3_server, "compact")
    _publish(raw, url)
    write(raw, 0, 60)
    _publish(raw, url, update=True)
    old = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "old")
    before, after, done = publish_compact(url, quiet=True, staging=tmp_path / "compactor")
    assert before.segments == 2 and after.segments == 1 and after.digest == before.digest
    store: Store = open_store(url)
    files = read_files(store, done.version)
    assert files is not None and all(e.key.startswith(f"versions/{done.version}/") for e in files.values())
    assert sorted(numbers(url, tmp_path / "new")) == [*range(10), 60]
    assert sorted(read_checked(old)) == [*range(10), 60]


def test_rewrite_from_the_store_fetches_through_the_cache(
    raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path
) -> None:
    """A refresh past the dead-bytes threshold on a machine that holds no copy: the records it keeps
    are fetched through the read cache and rewritten into a new layout, under the new version's folder;
    the old version's objects are left as they were (its pinned readers keep reading them)."""
    url = _url(s3_server, "rewrite")
    _publish(raw, url, staging=tmp_path / "a")
    store = open_store(url)
    before = {o.key: o.etag for o in store.list() if o.key != "manifest.json"}  # all but the pointer
    pinned = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "pinned")
    for number in (0, 1, 5, 6):
        (raw / f"c{number // PER_CLASS}" / f"m{number:03d}.png").unlink()
    report, (done,) = _publish(raw, url, update=True, staging=tmp_path / "b")
    assert report.reused == 6 and report.processed == 0
    files = read_files(store, done.version)
    assert files is not None and all(e.key.startswith(f"versions/{done.version}/") for e in files.values())
    assert {k: e for k, e in ((o.key, o.etag) for o in store.list()) if k in before} == before  # none overwritten
    assert sorted(numbers(url, tmp_path / "r")) == [2, 3, 4, 7, 8, 9]
    assert read_checked(pinned) == list(range(10))


def test_split_and_synced_copy(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """--split publishes one dataset per split under the URL; a dataset synced as it is (aws s3
    sync) is refreshed in place of a published one: its objects are reused where they lie."""
    url = _url(s3_server, "split")
    _publish(raw, url, split={"val": 0.3})
    train, val = numbers(f"{url}/train", tmp_path / "t"), numbers(f"{url}/val", tmp_path / "v")
    assert sorted(train + val) == list(range(10)) and val

    from packer import build

    local = tmp_path / "synced"
    build(raw, local, workers=1, quiet=True, shard_size=4, format="raw", short_edge=16)
    synced = s3_server.upload(local, "publish/synced")
    write(raw, 1, 44)
    proxy.clear()
    report, (done,) = _publish(raw, synced, update=True)
    assert report.processed == 1 and report.reused == 10
    files = read_files(open_store(synced), done.version)
    assert files is not None
    reused = {n for n, e in files.items() if e.key == n}
    assert len(reused) == len(files) - 1 and reused  # the synced shards, where they lie
    assert sorted(numbers(synced, tmp_path / "s")) == [*range(10), 44]


def test_dask_publishes_the_same_way(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """``--dask`` to a URL: staged on the cluster, published as a local build is; its --update from
    the store alone uploads only the new segment."""
    pytest.importorskip("distributed", reason="Dask distributed is not installed (pip install 'packer-datasets[dask]')")
    url = _url(s3_server, "dask")
    _publish(raw, url, dask_address="local", staging=tmp_path / "a")
    assert numbers(url, tmp_path / "r1") == list(range(10))
    write(raw, 1, 45)
    proxy.clear()
    report, (done,) = _publish(raw, url, update=True, dask_address="local", staging=tmp_path / "b")
    assert report.processed == 1 and report.reused == 10
    files = read_files(open_store(url), done.version)
    assert files is not None
    assert len([key for key in puts(proxy) if key.rsplit("/", 1)[-1] in files]) == 1
    assert sorted(numbers(url, tmp_path / "r2")) == [*range(10), 45]


def test_store_emptied_publishes_everything_again(raw: Path, s3_server: S3Server, tmp_path: Path) -> None:
    """The dataset deleted from the store under a staged copy that names data files only the store
    had: the next publish builds them again and uploads the whole dataset."""
    url = _url(s3_server, "emptied")
    _publish(raw, url, staging=tmp_path / "a")
    write(raw, 0, 46)
    _publish(raw, url, update=True, staging=tmp_path / "b")  # b's copy: the old shards are the store's
    store = open_store(url)
    for o in list(store.list()):
        store.delete(o.key)
    report, (done,) = _publish(raw, url, update=True, staging=tmp_path / "b")
    assert report.count == 11 and done.uploaded > 0
    assert sorted(numbers(url, tmp_path / "r")) == [*range(10), 46]


def test_resume_of_a_refresh_from_the_store(raw: Path, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """A refresh that keeps the store's data files where they are, stopped by a bad file (--on-error
    fail), then --resume'd once it is fixed: the recorded plan (those files unlinked) is continued,
    and only the new segment is uploaded."""
    url = _url(s3_server, "resumed")
    _publish(raw, url, staging=tmp_path / "a")
    write(raw, 0, 47)
    bad = raw / "c1" / "m048.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(BuildError, match=r"m048\.png"):
        _publish(raw, url, update=True, on_error="fail", staging=tmp_path / "b")
    write(raw, 1, 48)
    proxy.clear()
    report, (done,) = _publish(raw, url, update=True, resume=True, on_error="fail", staging=tmp_path / "b")
    assert report.resumed_from > 0 and report.count == 12
    files = read_files(open_store(url), done.version)
    assert files is not None
    assert len([key for key in puts(proxy) if key.rsplit("/", 1)[-1] in files]) == 1
    assert sorted(numbers(url, tmp_path / "r")) == [*range(10), 47, 48]


def _samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Samples keyed by source, each of its own flat colour, with a caption naming it."""
    import numpy as np

    return [
        {"image": np.full((20, 24, 3), (10 * i + seed, 3 * i, 200), np.uint8), "caption": f"n{i}", "source": f"id-{i}"}
        for i in range(n)
    ]


def test_pack_publishes_like_a_build(s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """packer.pack / packer.Writer to an s3:// URL: written into its local copy, then published the
    way `packer build raw/ URL` publishes; update=True uploads only the new records' data file;
    nothing changed: nothing written."""
    url = _url(s3_server, "packed")
    options: dict[str, Any] = {"fields": {"caption": "text"}, "workers": 0, "format": "raw", "shard_size": 4}
    report = packer.pack(_samples(6), url, **options)
    assert report.out == url and report.count == 6
    local = packer.pack(_samples(6), tmp_path / "local", **options)
    ds = ShardDataset(url, crop_size=None, cache_dir=tmp_path / "r1")
    assert report.digest == local.digest and [ds[i]["caption"] for i in range(6)] == [f"n{i}" for i in range(6)]
    with pytest.raises(BuildError, match=r"packed already exists \(use force=True to replace it, or update=True"):
        packer.pack(_samples(6), url, **options)

    report = packer.pack(_samples(6), url, update=True, **options)  # no digests yet: every sample packed once
    assert report.reused == 0 and report.count == 6
    store = open_store(url)
    first = read_files(store, version_id(store.get("manifest.json")))
    assert first is not None
    changed = _samples(7)
    changed[2] = _samples(3, seed=5)[2]
    proxy.clear()
    with packer.Writer(url, update=True, **options) as w:
        w.write_all(changed)
    assert w.published is not None and not w.published.up_to_date
    assert w.report is not None and (w.report.reused, w.report.processed, w.report.count) == (5, 2, 7)
    files = read_files(store, w.published.version)
    assert files is not None
    new = {name for name, e in files.items() if e.key.startswith(f"versions/{w.published.version}/")}
    assert len(new) == 1 and all(files[n] == first[n] for n in files if n not in new)  # old data objects reused
    data = [key for key in puts(proxy) if key.rsplit("/", 1)[-1] in files]
    assert len(data) == 1 and data[0].endswith(files[next(iter(new))].key)
    ds = ShardDataset(url, crop_size=None, cache_dir=tmp_path / "r2")
    fresh = packer.pack(changed, tmp_path / "fresh", **options)
    assert ds.manifest.digest == fresh.digest and [ds.source(i) for i in range(7)] == [f"id-{i}" for i in range(7)]

    proxy.clear()
    again = packer.pack(changed, url, update=True, **options)
    assert again.up_to_date and writes(proxy) == []


def test_pack_update_from_the_store_alone(s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """Another machine (another staging folder) refreshes a packed dataset from the store: it reads
    the old records it keeps (to count their fields) but uploads only the new segment."""
    url = _url(s3_server, "packed-elsewhere")
    options: dict[str, Any] = {"fields": {"caption": "text"}, "workers": 0, "format": "raw", "shard_size": 4}
    packer.pack(_samples(6), url, update=True, staging=tmp_path / "machine-a", **options)
    proxy.clear()
    report = packer.pack(_samples(7), url, update=True, staging=tmp_path / "machine-b", **options)
    assert (report.reused, report.processed) == (6, 1)
    store = open_store(url)
    files = read_files(store, version_id(store.get("manifest.json")))
    assert files is not None
    assert len([key for key in puts(proxy) if key.rsplit("/", 1)[-1] in files]) == 1
    ds = ShardDataset(url, crop_size=None, cache_dir=tmp_path / "r")
    assert [ds[i]["caption"] for i in range(7)] == [f"n{i}" for i in range(7)]
