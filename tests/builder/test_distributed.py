"""``build --dask``: on a real LocalCluster (2 worker processes) the dataset equals a local build's."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

distributed = pytest.importorskip(
    "distributed", reason="Dask distributed is not installed (pip install 'packer-datasets[dask]')"
)

from packer import BuildError, Labelling, build  # noqa: E402
from packer.builder.dask import FRAGMENTS, build_dask, probe  # noqa: E402
from packer.builder.staging import staging_path  # noqa: E402
from packer.format import LABELS, TARGETS, Manifest, load_index  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402

from ..conftest import ONE_EACH  # noqa: E402
from .test_build import stored_images  # noqa: E402


@pytest.fixture(scope="module")
def client():
    """One cluster for the module: 2 worker processes, 1 thread each, restarted by their nannies."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def mixed_raw(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 18 real photos, 12 generated camera-like JPEGs, one corrupt image and one non-image."""
    raw = tmp_path_factory.mktemp("mixed") / "raw"
    shutil.copytree(raw_photos, raw)
    make_sample(raw, classes=("cat", "dog"), per_class=6, size=(2000, 1500))
    (raw / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (raw / "dog" / "notes.txt").write_text("not an image")
    return raw


def assert_same_dataset(dask_out: Path, local_out: Path) -> None:
    """Same digest, records, labels, sources and report; memmap shard layout may differ (task-sized)."""
    m, ref = Manifest.load(dask_out), Manifest.load(local_out)
    assert m.digest == ref.digest
    assert (m.count, m.class_counts, m.classes) == (ref.count, ref.class_counts, ref.classes)
    assert (m.scanned, m.skipped, m.ignored) == (ref.scanned, ref.skipped, ref.ignored)
    index, sources = load_index(dask_out, m)
    ref_index, ref_sources = load_index(local_out, ref)
    for field in ("length", "label", "height", "width", "crc32", "src_offset", "src_length"):
        assert (index[field] == ref_index[field]).all(), field
    assert (sources == ref_sources).all()
    assert (dask_out / "report.jsonl").read_bytes() == (local_out / "report.jsonl").read_bytes()
    assert not any(p.name.startswith((".", "part-")) for p in dask_out.iterdir())
    _, index, _, images = stored_images(dask_out)  # every record readable without packer, at its offset
    assert [img.shape[:2] for img in images] == [(r["height"], r["width"]) for r in index]


@pytest.mark.parametrize("backend,fmt", ONE_EACH)
def test_digest_equals_local_build(client, mixed_raw: Path, tmp_path: Path, backend: str, fmt: str) -> None:
    local = tmp_path / f"local-{backend}"
    build(mixed_raw, local, backend=backend, format=fmt, workers=1, quiet=True)
    out = tmp_path / f"dask-{backend}"
    report = build_dask(
        mixed_raw, out, address=client.scheduler.address, backend=backend, format=fmt, shard_size=4, quiet=True
    )
    assert_same_dataset(out, local)
    assert (report.count, report.skipped, report.ignored) == (30, 1, 1)
    if backend == "memmap":  # each task's records are one shard (task size 4)
        shards = Manifest.load(out).shards
        assert len(shards) == 8 and sum(s["count"] for s in shards) == 30
        assert sorted({s["count"] for s in shards}) == [3, 4]  # 31 files: the last task and the skip


def test_labels_csv_kinds_equal_local_build(client, mixed_raw: Path, tmp_path: Path) -> None:
    """Multi-label rows and numeric targets from a CSV: the same label arrays and digest as locally."""
    rels = sorted(p.relative_to(mixed_raw).as_posix() for p in mixed_raw.rglob("*.jpg"))
    csv = tmp_path / "labels.csv"
    csv.write_text(
        "path,label,score\n" + "".join(f"{r},{'x;y' if k % 3 else 'y'},{k / 4}\n" for k, r in enumerate(rels)),
        encoding="utf-8",
    )
    labelling = Labelling(multi_label=True, targets=("score",))
    local = tmp_path / "local"
    build(mixed_raw, local, format="raw", labels=str(csv), labelling=labelling, workers=1, quiet=True)
    out = tmp_path / "dask"
    build_dask(
        mixed_raw,
        out,
        address=client.scheduler.address,
        format="raw",
        labels=str(csv),
        labelling=labelling,
        shard_size=4,
        quiet=True,
    )
    assert_same_dataset(out, local)
    m = Manifest.load(out)
    assert (m.label_kind, m.targets, m.labels_digest) == ("multi", ["score"], Manifest.load(local).labels_digest)
    for name in (LABELS, TARGETS):
        assert np.array_equal(np.load(out / name), np.load(local / name)), name


def test_local_cluster_from_address_local(built, raw_photos: Path, tmp_path: Path) -> None:
    """``--dask local`` starts its own LocalCluster; same digest as the session's local build."""
    report = build_dask(raw_photos, tmp_path / "out.lmdb", address="local", workers=2, shard_size=5, quiet=True)
    assert report.digest == Manifest.load(built("lmdb", "jpeg")).digest


def test_worker_killed_mid_build(client, mixed_raw: Path, tmp_path: Path) -> None:
    """SIGKILL one worker while tasks run: its task is redone elsewhere, nothing lost or duplicated."""

    def slow_down(seconds: float) -> None:  # runs in each worker: tasks last long enough to be killed
        import time as t

        import packer.builder.dask as d
        import packer.builder.preprocess as p

        def slow(paths: list[str], opts: p.PreprocessSpec) -> list:
            t.sleep(seconds)
            return p.process_chunk(paths, opts)

        d.process_chunk = slow

    def restore() -> None:
        import packer.builder.dask as d
        import packer.builder.preprocess as p

        d.process_chunk = p.process_chunk

    local = tmp_path / "local.lmdb"
    build(mixed_raw, local, workers=1, quiet=True)
    out = tmp_path / "dask.lmdb"
    fragments = staging_path(out) / FRAGMENTS
    pids = client.run(os.getpid)
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (fragments.is_dir() and any(fragments.glob("part-*.json"))):
            time.sleep(0.02)
        busy = client.run(lambda dask_worker: len(dask_worker.state.executing))
        victim = next((pids[addr] for addr, n in sorted(busy.items()) if n), None)
        if victim is not None:  # a worker that is running a task right now
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    client.run(slow_down, 0.15)
    thread = threading.Thread(target=killer, daemon=True)
    try:
        thread.start()
        report = build_dask(mixed_raw, out, address=client.scheduler.address, shard_size=2, quiet=True)
        thread.join(5)
    finally:
        client.run(restore)
    assert killed, "no worker was killed while running a task"
    assert killed[0] not in client.run(os.getpid).values()
    assert report.count == 30
    assert_same_dataset(out, local)
    client.wait_for_workers(2, timeout=60)  # the nanny restarts it for the next tests


def _last_shard_fails(mixed_raw: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of ``mixed_raw`` whose last file (so the last shard) is garbage: raw/, that file, OUT."""
    raw = tmp_path / "raw"
    shutil.copytree(mixed_raw, raw)
    (raw / "dog" / "notes.txt").unlink()
    (raw / "cat" / "broken.jpg").unlink()
    bad = raw / "portrait" / "zz_bad.jpg"  # sorts last: the last shard fails
    bad.write_bytes(b"garbage")
    return raw, bad, tmp_path / "out.lmdb"


def test_fail_then_resume_reuses_finished_shards(client, mixed_raw: Path, tmp_path: Path) -> None:
    raw, bad, out = _last_shard_fails(mixed_raw, tmp_path)
    kwargs: dict[str, Any] = {"address": client.scheduler.address, "shard_size": 4, "quiet": True, "on_error": "fail"}
    with pytest.raises(BuildError, match=r"zz_bad\.jpg: not a recognised image .*--on-error fail"):
        build_dask(raw, out, **kwargs)
    assert not out.exists() and staging_path(out).is_dir()
    shutil.copyfile(raw / "portrait" / "Portrait_1.jpg", bad)  # fixed in place: same input list
    report = build_dask(raw, out, resume=True, **kwargs)
    assert report.resumed_from > 0 and report.count == 31
    local = tmp_path / "local.lmdb"
    build(raw, local, workers=1, quiet=True)
    assert_same_dataset(out, local)


def test_a_file_re_exported_in_a_finished_shard_is_decoded_again_by_resume(
    client, mixed_raw: Path, tmp_path: Path
) -> None:
    """Issue 21 item 3 for --dask: a fragment holds the scan identities of its files, so a file
    re-exported in place (same path, other pixels) after its shard finished is decoded again."""
    raw, bad, out = _last_shard_fails(mixed_raw, tmp_path)
    kwargs: dict[str, Any] = {"address": client.scheduler.address, "shard_size": 4, "quiet": True, "on_error": "fail"}
    with pytest.raises(BuildError, match="zz_bad"):
        build_dask(raw, out, **kwargs)
    first = sorted((raw / "cat").iterdir())[0]  # in the first shard, which finished
    shutil.copyfile(raw / "portrait" / "Portrait_1.jpg", first)
    shutil.copyfile(raw / "portrait" / "Portrait_2.jpg", bad)
    report = build_dask(raw, out, resume=True, **kwargs)
    assert report.resumed_from > 0
    local = tmp_path / "local.lmdb"
    build(raw, local, workers=1, quiet=True)
    assert_same_dataset(out, local)


def _edit(raw: Path) -> None:
    """One file added, one deleted, one rewritten in place (another size): with the broken file
    (never packed), 3 to decode on --update."""
    photos = sorted((raw / "cat").glob("*.jpg"))
    shutil.copyfile(photos[0], raw / "dog" / "added.jpg")
    photos[1].unlink()
    shutil.copyfile(photos[0], photos[2])


@pytest.mark.parametrize("backend,fmt", ONE_EACH)
def test_update_equals_local_update(client, mixed_raw: Path, tmp_path: Path, backend: str, fmt: str) -> None:
    """--dask --update: the local reuse plan, only the added/changed files sent to tasks, the local
    --update's dataset; then up to date for either engine (their ``inputs`` digests are the same)."""
    raw = tmp_path / "raw"
    shutil.copytree(mixed_raw, raw)
    kw: dict[str, Any] = {"backend": backend, "format": fmt, "shard_size": 4, "quiet": True}
    local, out = tmp_path / "local", tmp_path / "dask"
    build(raw, local, workers=1, **kw)
    build_dask(raw, out, address=client.scheduler.address, **kw)
    _edit(raw)
    build(raw, local, workers=1, update=True, **kw)
    report = build_dask(raw, out, address=client.scheduler.address, update=True, **kw)
    assert_same_dataset(out, local)
    assert (report.processed, report.reused, report.count) == (3, 28, 30)
    assert Manifest.load(out).segments == Manifest.load(local).segments == 2  # old data files kept, linked
    again = build_dask(raw, out, address=client.scheduler.address, update=True, **kw)
    assert again.up_to_date and build(raw, out, workers=1, update=True, **kw).up_to_date


def test_split_and_checksum_equal_local_build(client, mixed_raw: Path, tmp_path: Path) -> None:
    """--dask --split --checksum writes the local build's split datasets; --update after an edit too."""
    raw = tmp_path / "raw"
    shutil.copytree(mixed_raw, raw)
    kw: dict[str, Any] = {"split": {"val": 0.3}, "checksum": True, "shard_size": 4, "quiet": True}
    local, out = tmp_path / "local", tmp_path / "dask"
    build(raw, local, workers=1, **kw)
    report = build_dask(raw, out, address=client.scheduler.address, **kw)
    assert set(report.splits) == {"train", "val"}
    for name in ("train", "val"):
        assert_same_dataset(out / name, local / name)
    _edit(raw)
    build(raw, local, workers=1, update=True, **kw)
    report = build_dask(raw, out, address=client.scheduler.address, update=True, **kw)
    assert report.processed == 3 and report.reused == 28
    for name in ("train", "val"):
        assert_same_dataset(out / name, local / name)
        assert Manifest.load(out / name).options["checksum"] is True


def test_unreachable_scheduler_fails_fast_in_one_line(raw_photos: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(BuildError, match=r"cannot reach the Dask scheduler at tcp://127\.0\.0\.1:1 ") as e:
        build_dask(raw_photos, tmp_path / "out.lmdb", address="tcp://127.0.0.1:1", quiet=True)
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    with pytest.raises(BuildError, match="cannot use Dask scheduler address 'nonsense'"):
        build_dask(raw_photos, tmp_path / "out.lmdb", address="nonsense", quiet=True)


def test_probe_reports_a_worker_that_cannot_see_raw(tmp_path: Path) -> None:
    facts = probe(str(tmp_path / "elsewhere"), str(tmp_path), "cat/a.jpg")
    assert facts["error"].startswith("cannot see raw/") and facts["probe"] is None
    (tmp_path / "raw" / "cat").mkdir(parents=True)
    (tmp_path / "raw" / "cat" / "a.jpg").write_bytes(b"")
    facts = probe(str(tmp_path / "raw"), str(tmp_path), "cat/a.jpg")
    assert facts["error"] is None and (tmp_path / facts["probe"]).is_file()


def test_probe_on_real_workers_checks_their_threads(client, tmp_path: Path) -> None:
    """Dask hands the probe its worker; with packer's C binding built, threads are fine (damage is
    detected per call), without it a multi-threaded worker is refused."""
    from packer.codec import can_decode_region

    (tmp_path / "raw" / "cat").mkdir(parents=True)
    (tmp_path / "raw" / "cat" / "a.jpg").write_bytes(b"")
    facts = client.run(probe, str(tmp_path / "raw"), str(tmp_path), "cat/a.jpg")
    assert len(facts) == 2 and all(f["error"] is None and f["threads"] == 1 for f in facts.values())
    four = probe(str(tmp_path / "raw"), str(tmp_path), "cat/a.jpg", dask_worker=type("W", (), {"nthreads": 4})())
    if can_decode_region():
        assert four["error"] is None
    else:
        assert "runs 4 threads" in four["error"] and "--nthreads 1" in four["error"]


def test_cli_dask_option(client, built, raw_photos: Path, tmp_path: Path) -> None:
    """``packer build --dask ADDRESS``: same digest; a bad address is one line on stderr, exit 1."""
    cli = [sys.executable, "-m", "packer.cli", "build", str(raw_photos)]
    done = subprocess.run(
        [*cli, str(tmp_path / "out.lmdb"), "--dask", client.scheduler.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert Manifest.load(tmp_path / "out.lmdb").digest == Manifest.load(built("lmdb", "jpeg")).digest
    assert Manifest.load(tmp_path / "out.lmdb").options["shard_size"] == 1000  # the Dask default
    retried = subprocess.run(
        [*cli, str(tmp_path / "out.lmdb"), "--dask", client.scheduler.address, "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert retried.returncode == 0 and "is up to date" in retried.stderr, retried.stderr
    both = [str(tmp_path / "split"), "--dask", client.scheduler.address, "--update", "--checksum", "--split", "val=0.3"]
    split = subprocess.run([*cli, *both], capture_output=True, text=True, timeout=120)
    assert split.returncode == 0, split.stderr
    assert (tmp_path / "split" / "val" / "manifest.json").is_file()
    bad = subprocess.run(
        [*cli, str(tmp_path / "bad.lmdb"), "--dask", "nonsense"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "packer: error: cannot use Dask scheduler address 'nonsense': missing port number in address 'nonsense'"
    ]
