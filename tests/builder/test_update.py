"""`packer build --update` (incremental refresh), `--split`, and the Makefile's dataset targets."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import packer.builder.preprocess
from packer import BuildError, build
from packer.builder.split import split_of, split_path
from packer.format import INDEX_DTYPE, Manifest, load_index, source_path
from packer.read.reader import open_reader
from packer.tools.verify import verify

from ..conftest import BACKEND_NAMES

REPO = Path(__file__).resolve().parents[2]
PACKER = [sys.executable, "-m", "packer.cli"]


def write_image(path: Path, seed: int, fmt: str = "JPEG") -> None:
    """A small image whose pixels depend on ``seed`` (BMP: the file size depends only on the size)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([(x * (seed % 5 + 1)) % 256, (y * 3 + seed) % 256, (x + y + 7 * seed) % 256], -1)
    pixels = (pixels + rng.integers(0, 16, pixels.shape)).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    """3 classes x 6 small images, a BMP, one undecodable file (skipped) and a text file (ignored)."""
    root = tmp_path / "raw"
    for c, cls in enumerate(("cat", "dog", "ship")):
        for i in range(6):
            write_image(root / cls / f"img{i}.jpg", 10 * c + i)
    write_image(root / "dog" / "pic.bmp", 99, "BMP")
    (root / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    (root / "ship" / "notes.txt").write_text("ignored")
    return root


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths decoded in this process (workers=1 builds decode here), in order."""
    seen: list[str] = []
    real = packer.builder.preprocess.process

    def spy(path: str, opts: packer.builder.preprocess.PreprocessSpec) -> packer.builder.preprocess.Result:
        seen.append(Path(path).relative_to(Path(path).parents[1]).as_posix())
        return real(path, opts)

    monkeypatch.setattr(packer.builder.preprocess, "process", spy)
    return seen


LOGICAL = [name for name in INDEX_DTYPE.names or () if name not in ("shard", "offset")]


def same_dataset(a: Path, b: Path) -> None:
    """Same records, index rows (identities included; where a record lies may differ: a refresh keeps
    old records in their data files), paths, report and manifest facts, and both verify."""
    ma, mb = Manifest.load(a), Manifest.load(b)
    assert ma.digest == mb.digest
    for key in ("count", "classes", "class_counts", "scanned", "skipped", "ignored", "inputs", "options"):
        assert getattr(ma, key) == getattr(mb, key), key
    (ia, sa), (ib, sb) = load_index(a, ma), load_index(b, mb)
    assert all((ia[name] == ib[name]).all() for name in LOGICAL) and (np.asarray(sa) == np.asarray(sb)).all()
    ra, rb = open_reader(a), open_reader(b)
    assert all(bytes(ra.get(i)) == bytes(rb.get(i)) for i in range(ma.count))
    assert (a / "report.jsonl").read_bytes() == (b / "report.jsonl").read_bytes()
    assert verify(a).ok and verify(b).ok


def change_tree(raw: Path) -> None:
    """Add two files, rewrite one (new size and mtime), delete one, relabel one by moving it."""
    write_image(raw / "cat" / "new0.jpg", 500)
    write_image(raw / "ship" / "new1.jpg", 501)
    write_image(raw / "dog" / "img2.jpg", 502)
    (raw / "ship" / "img3.jpg").unlink()
    (raw / "cat" / "img4.jpg").rename(raw / "dog" / "img4-moved.jpg")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_update_decodes_only_changed_files_and_equals_a_full_rebuild(
    raw: Path, tmp_path: Path, decoded: list[str], backend: str
) -> None:
    out = tmp_path / "out"
    first = build(raw, out, backend=backend, workers=1, quiet=True, shard_size=5, update=True)
    assert (first.processed, first.reused, first.count, first.skipped) == (20, 0, 19, 1)
    change_tree(raw)
    decoded.clear()
    report = build(raw, out, backend=backend, workers=1, quiet=True, shard_size=5, update=True)
    # new files, the rewritten one, the moved one (new path) and the skipped one (tried again)
    assert sorted(decoded) == ["cat/broken.jpg", "cat/new0.jpg", "dog/img2.jpg", "dog/img4-moved.jpg", "ship/new1.jpg"]
    assert (report.processed, report.reused, report.count) == (5, 16, 20)
    assert "), 5 processed, 16 reused, " in report.summary()
    full = tmp_path / "full"
    build(raw, full, backend=backend, workers=1, quiet=True, shard_size=5)
    same_dataset(out, full)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging or trash left


def test_update_with_worker_pool_interleaves_in_order(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=2, quiet=True)
    change_tree(raw)
    report = build(raw, out, workers=2, quiet=True, update=True)
    assert (report.processed, report.reused) == (5, 16)
    full = tmp_path / "full.lmdb"
    build(raw, full, workers=2, quiet=True)
    same_dataset(out, full)


def test_unchanged_input_is_up_to_date_and_untouched(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    subprocess.run([*PACKER, "build", str(raw), str(out), "--workers", "1", "--quiet"], check=True)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    inode = out.stat().st_ino
    again = subprocess.run([*PACKER, "build", str(raw), str(out), "--update"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"{out} is up to date (19 records" in again.stderr and "nothing to do" in again.stderr
    assert (out / "manifest.json").stat().st_mtime_ns == stamp and out.stat().st_ino == inode
    report = build(raw, out, quiet=True, update=True)
    assert report.up_to_date and report.processed == 0 and report.seconds < 5


def test_changed_options_invalidate_the_cache(raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    report = build(raw, out, workers=1, quality=70, update=True)
    assert (report.processed, report.reused) == (20, 0)
    assert "cannot reuse its records (quality 90 -> 70): rebuilding every record" in capsys.readouterr().err
    assert Manifest.load(out).quality == 70
    # layout-only options keep the records: same content, another backend and shard size
    moved = build(raw, out, workers=1, quiet=True, quality=70, backend="memmap", shard_size=3, update=True)
    assert (moved.processed, moved.reused) == (1, 19)  # only the skipped file is retried
    assert Manifest.load(out).backend == "memmap"


def test_checksum_sees_a_content_change_that_keeps_size_and_mtime(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True, update=True, checksum=True)
    bmp = raw / "dog" / "pic.bmp"
    st = bmp.stat()
    write_image(bmp, 12345, "BMP")
    os.utime(bmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert bmp.stat().st_size == st.st_size and bmp.stat().st_mtime_ns == st.st_mtime_ns
    blind = build(raw, tmp_path / "blind.lmdb", workers=1, quiet=True)  # reference for --update without it
    shutil.rmtree(tmp_path / "blind.lmdb")
    report = build(raw, out, workers=1, quiet=True, update=True, checksum=True)
    assert (report.processed, report.reused) == (2, 18)  # the BMP and the skipped file
    assert report.digest == blind.digest
    index, _sources = load_index(out, Manifest.load(out))
    assert (index["src_hash"] != 0).all()
    # without --checksum the same edit is invisible: identity is path, size and mtime
    plain = tmp_path / "plain.lmdb"
    build(raw, plain, workers=1, quiet=True)
    write_image(bmp, 777, "BMP")
    os.utime(bmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert build(raw, plain, workers=1, quiet=True, update=True).up_to_date


def test_a_damaged_old_record_is_kept_by_a_linking_refresh_and_decoded_again_by_a_rewrite(
    raw: Path, tmp_path: Path, decoded: list[str]
) -> None:
    """A refresh that links the old data files never reads the records it keeps (that is what makes it
    cheap): damage stays where it is and verify names it. One that rewrites every record (here: the
    shard size changes) checks each against its CRC-32 and decodes a damaged one's file again."""
    out = tmp_path / "out"
    build(raw, out, backend="memmap", workers=1, quiet=True)
    index, sources = load_index(out, Manifest.load(out))
    victim = source_path(sources, index[3])
    shard = out / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[int(index[3]["offset"]) + 100] ^= 0xFF
    shard.write_bytes(bytes(data))
    write_image(raw / "cat" / "new0.jpg", 500)
    decoded.clear()
    report = build(raw, out, backend="memmap", workers=1, quiet=True, update=True)
    assert victim not in decoded and report.reused == 19
    found = verify(out)
    assert found.bad_records == 1 and victim in found.problems[0]
    decoded.clear()
    report = build(raw, out, backend="memmap", workers=1, quiet=True, update=True, shard_size=7)
    assert victim in decoded and report.reused == 19
    full = tmp_path / "full"
    build(raw, full, backend="memmap", workers=1, quiet=True, shard_size=7)
    same_dataset(out, full)


def test_update_refuses_to_replace_what_is_not_a_dataset(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "photos"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BuildError, match="is not a packer dataset"):
        build(raw, out, workers=1, quiet=True, update=True)
    assert (out / "keep.txt").exists()


def splits_of(out: Path) -> dict[str, set[str]]:
    result = {}
    for name in ("train", "val", "test"):
        m = Manifest.load(out / f"{name}.lmdb")
        index, sources = load_index(out / f"{name}.lmdb", m)
        result[name] = {source_path(sources, row) for row in index}
    return result


def test_splits_are_deterministic_stratified_and_stable_when_files_are_added(raw: Path, tmp_path: Path) -> None:
    splits = {"val": 0.25, "test": 0.25}
    out = tmp_path / "out.lmdb"
    report = build(raw, out, workers=1, quiet=True, split=splits, split_seed=3)
    assert list(report.splits) == ["train", "val", "test"]
    manifests = {name: Manifest.load(out / f"{name}.lmdb") for name in report.splits}
    assert all(m.classes == ["cat", "dog", "ship"] for m in manifests.values())
    assert sum(m.scanned for m in manifests.values()) == 21 and sum(m.count for m in manifests.values()) == 19
    assert all(m.scanned == m.count + m.skipped + m.ignored for m in manifests.values())
    before = splits_of(out)
    assert all(before.values()) and set.union(*before.values()) == {
        p.relative_to(raw).as_posix() for p in raw.rglob("*.*") if p.suffix != ".txt" and p.name != "broken.jpg"
    }
    for rels in before.values():
        for rel in rels:
            assert split_of(rel, splits, 3) in before and rel in before[split_of(rel, splits, 3)]

    again = tmp_path / "again"
    build(raw, again, backend="lmdb", workers=1, quiet=True, split=splits, split_seed=3)
    assert splits_of(again) == before  # deterministic
    for i in range(12):
        write_image(raw / ("cat", "dog", "ship")[i % 3] / f"added{i}.jpg", 900 + i)
    update = build(raw, out, workers=1, quiet=True, split=splits, split_seed=3, update=True)
    after = splits_of(out)
    assert all(before[name] <= after[name] for name in before)  # nobody moved
    assert update.reused == 19 and update.processed == 12 + 1  # the added files, the skipped one retried
    assert "up to date" in build(raw, out, workers=1, quiet=True, split=splits, split_seed=3, update=True).summary()


def test_split_assignment_is_stratified_in_expectation() -> None:
    splits = {"val": 0.1, "test": 0.2}
    for cls in ("a", "b", "c"):
        counts = Counter(split_of(f"{cls}/img{i:05d}.jpg", splits, 0) for i in range(4000))
        assert abs(counts["val"] / 4000 - 0.1) < 0.02 and abs(counts["test"] / 4000 - 0.2) < 0.02
    assert split_of("a/x.jpg", splits, 0) == split_of("a/x.jpg", {"val": 0.1, "test": 0.2}, 0)


def test_split_options_are_checked(raw: Path, tmp_path: Path) -> None:
    for bad, why in (
        ({"train": 0.1}, "other than 'train'"),
        ({"val": 0.0}, "between 0 and 1"),
        ({"val": 0.6, "test": 0.5}, "leave some for train"),
        ({"a/b": 0.1}, "plain name"),
    ):
        with pytest.raises(BuildError, match=why):
            build(raw, tmp_path / "s", workers=1, quiet=True, split=bad)
    dataset = tmp_path / "d.lmdb"
    build(raw, dataset, workers=1, quiet=True)
    with pytest.raises(BuildError, match="is a dataset; --split writes a folder"):
        build(raw, dataset, workers=1, quiet=True, split={"val": 0.1}, update=True)
    cli = subprocess.run(
        [*PACKER, "build", str(raw), str(tmp_path / "c"), "--split", "val"], capture_output=True, text=True
    )
    assert cli.returncode == 2 and "NAME=FRACTION" in cli.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_dataset_twice_then_verify_and_clean(raw: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"  # the running interpreter's venv, marked set up so `setup` is a no-op
    venv.mkdir()
    (venv / "bin").symlink_to(Path(sys.executable).parent)
    (venv / ".installed").touch()
    out = tmp_path / "made.lmdb"
    make = ["make", "-s", "-C", str(REPO), f"VENV={venv}", f"RAW={raw}", f"OUT={out}"]
    first = subprocess.run([*make, "dataset"], capture_output=True, text=True)
    assert first.returncode == 0 and "packed 19 of 21" in first.stderr, first.stdout + first.stderr
    second = subprocess.run([*make, "dataset", "dataset-verify"], capture_output=True, text=True)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "is up to date" in second.stderr and f"{out}: ok, 19 records" in second.stdout
    subprocess.run([*make, "dataset-clean"], check=True, capture_output=True)
    assert not out.exists()


def test_verify_notices_an_edited_source_identity(raw: Path, tmp_path: Path) -> None:
    from packer.tools.verify import verify

    out = tmp_path / "out"
    build(raw, out, backend="memmap", workers=1, quiet=True)
    index = np.load(out / "index.npy", mmap_mode="r+")
    index[2]["src_mtime_ns"] += 1  # would make --update decode it again, or worse, reuse a stale record
    index.flush()
    del index
    problems = verify(out).problems
    assert problems == ["index.npy: rows differ from those the build wrote (manifest index_digest; damaged or edited)"]


# ------------------------------------------------------------------ refresh summary, retries, empty datasets


def test_a_refresh_says_what_was_added_changed_deleted_and_retried(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    change_tree(raw)
    report = build(raw, out, workers=1, quiet=True, update=True)
    changes = report.changes
    assert changes is not None
    assert list(changes.added) == ["cat/new0.jpg", "dog/img4-moved.jpg", "ship/new1.jpg"]
    assert list(changes.changed) == ["dog/img2.jpg"]
    assert list(changes.deleted) == ["cat/img4.jpg", "ship/img3.jpg"]
    assert list(changes.retried) == ["cat/broken.jpg"]  # skipped last time: decoded again
    assert report.summary().endswith("; 3 added, 1 changed, 2 deleted, 1 retried")
    assert "5 processed, 16 reused" in report.summary()


def _file_permissions_bind() -> None:
    """preexec_fn: root's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH leave the bounding set, so that a
    file's permissions bind the build as they bind any other user (prctl PR_CAPBSET_DROP)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):
            if libc.prctl(24, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_file_skipped_for_a_passing_reason_is_retried_when_nothing_else_changed(raw: Path, tmp_path: Path) -> None:
    """A file unreadable at the first build (still being copied with its final permissions to come)
    becomes readable without a new size or mtime: --update must decode it, not say "up to date"."""
    out = tmp_path / "out.lmdb"
    late = raw / "dog" / "img0.jpg"
    mtime = late.stat().st_mtime_ns
    late.chmod(0)

    def update() -> subprocess.CompletedProcess:
        args = [*PACKER, "build", str(raw), str(out), "--update", "--workers", "2"]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, preexec_fn=_file_permissions_bind)

    first = update()
    assert first.returncode == 0, first.stderr
    report = {e["path"]: e for e in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert report["dog/img0.jpg"]["reason"] == "unreadable: Permission denied"
    manifest = (out / "manifest.json").read_bytes()
    still = update()  # both skipped files are tried again, skipped again for the same reasons
    assert still.returncode == 0 and "is up to date" in still.stderr, still.stderr
    assert "2 skipped files tried again and still skipped); nothing to do" in still.stderr
    assert (out / "manifest.json").read_bytes() == manifest
    late.chmod(0o644)
    assert late.stat().st_mtime_ns == mtime  # nothing a size-and-mtime comparison could see
    fixed = update()
    assert fixed.returncode == 0 and "up to date" not in fixed.stderr, fixed.stderr
    assert "0 added, 0 changed, 0 deleted, 2 retried" in fixed.stderr
    assert Manifest.load(out).count == 19
    full = tmp_path / "full.lmdb"
    build(raw, full, workers=1, quiet=True)
    same_dataset(out, full)
    assert "1 skipped file tried again and still skipped" in update().stderr


def test_the_first_checksum_refresh_of_a_dataset_built_without_says_why_it_decodes_everything(
    raw: Path, tmp_path: Path, decoded: list[str], capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    decoded.clear()
    build(raw, out, workers=1, update=True, checksum=True)
    assert "stores no content hashes to compare: every file is decoded this once" in capsys.readouterr().err
    assert len(decoded) == 20
    write_image(raw / "ship" / "img5.jpg", 4321)
    decoded.clear()
    report = build(raw, out, workers=1, quiet=True, update=True, checksum=True)
    assert sorted(decoded) == ["cat/broken.jpg", "ship/img5.jpg"] and report.reused == 18


def test_update_of_a_dataset_with_no_records(tmp_path: Path) -> None:
    """Every file skipped the first time (--allow-empty), then one good file: a refresh, no IndexError."""
    raw, out = tmp_path / "raw", tmp_path / "out.lmdb"
    (raw / "cat").mkdir(parents=True)
    (raw / "cat" / "bad.jpg").write_bytes(b"not a jpeg")
    args = [*PACKER, "build", str(raw), str(out), "--update", "--quiet"]
    empty = subprocess.run([*args, "--allow-empty"], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 0 and Manifest.load(out).count == 0, empty.stderr
    write_image(raw / "cat" / "good.jpg", 3)
    refreshed = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refreshed.returncode == 0, refreshed.stderr
    assert Manifest.load(out).count == 1 and verify(out).ok


@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_update_of_an_empty_split_that_gets_its_first_file(tmp_path: Path, backend: str) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    splits = {"test": 0.02}
    names = [f"img{i}.jpg" for i in range(1000)]
    train = [n for n in names if split_of(f"cat/{n}", splits, 0) == "train"][:5]
    first_test = next(n for n in names if split_of(f"cat/{n}", splits, 0) == "test")
    for k, name in enumerate(train):
        write_image(raw / "cat" / name, k)
    args = [*PACKER, "build", str(raw), str(out), "--backend", backend, "--split", "test=0.02", "--update", "--quiet"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    test = split_path(out, "test", backend)
    assert Manifest.load(test).count == 0
    write_image(raw / "cat" / first_test, 99)
    refreshed = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refreshed.returncode == 0, refreshed.stderr
    assert Manifest.load(test).count == 1 and verify(test).ok
