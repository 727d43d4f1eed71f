"""Hostile datasets and folders that are not packer's (issue 21, items 4, 5 and 8): a dataset whose data
files are symlinks (to another dataset's LMDB, to nowhere) or named as other files, a browser
extension's or a webpack build's ``manifest.json``, a manifest over the readers' own limit.

Every refresh here is a real ``python -m packer.cli`` process over real LMDB and memmap files; what
must not change outside the dataset is compared byte for byte.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer import DatasetError, ShardDataset, build, format
from packer.backends.lmdb import LmdbWriter
from packer.backends.memmap import MemmapWriter
from packer.backends.pin import pin
from packer.errors import BuildError
from packer.format import MANIFEST, Manifest
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]


def packer(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKER, *map(str, args)], capture_output=True, text=True, timeout=300)


def image(path: Path, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    """Two class folders of 3 JPEGs each, this test's own (a refresh adds to them)."""
    for i in range(6):
        image(tmp_path / "raw" / "ab"[i % 2] / f"img{i}.jpg", i)
    return tmp_path / "raw"


def digest_tree(root: Path) -> dict[str, str]:
    """sha256 per file under ``root`` (what must not change)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def edit_manifest(root: Path, **fields: object) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    manifest.update(fields)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def only_regular_files(root: Path) -> bool:
    return all(p.is_file() and not p.is_symlink() for p in root.iterdir())


# ------------------------------------------------------------ item 4: data files are the dataset's


@pytest.mark.parametrize("planted", ["symlink to another LMDB", "dangling symlink", "hard link"])
def test_update_never_writes_into_a_file_the_manifest_names_as_its_new_segment(
    raw: Path, tmp_path: Path, planted: str
) -> None:
    """The issue's attack: a manifest whose only data file is ``data-00001.mdb`` (the name the next
    segment gets), there a symlink to another dataset's LMDB, a dangling symlink, or a file another
    dataset (a pinned reader's version) links. The refresh used to link it into staging, then write
    its new segment into it: the victim's keys deleted, or a file created at the symlink's target.
    Now data file 0 must be data.mdb: the manifest is not packer's, OUT neither refreshed nor replaced
    (what the writers do with such a file alone: test_writers_create_their_files_...)."""
    victim = tmp_path / "victim.lmdb"
    build(raw, victim, workers=1, quiet=True)
    before = digest_tree(victim)
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    edit_manifest(out, shards=[{**Manifest.load(out).shards[0], "file": "data-00001.mdb"}])
    target = tmp_path / "elsewhere" / "planted.mdb"
    target.parent.mkdir()
    if planted == "symlink to another LMDB":
        (out / "data.mdb").unlink()
        (out / "data-00001.mdb").symlink_to(victim / "data.mdb")
    elif planted == "dangling symlink":
        (out / "data.mdb").unlink()
        (out / "data-00001.mdb").symlink_to(target)
    else:  # a regular file of the dataset, and of another version of it (hard link)
        (out / "data.mdb").rename(out / "data-00001.mdb")
        os.link(out / "data-00001.mdb", victim / "pinned.mdb")
        before = digest_tree(victim)
    with pytest.raises(DatasetError, match="manifest field shards is invalid"):
        ShardDataset(out)
    image(raw / "a" / "new.jpg", 99)

    for flag in ("--update", "--force"):  # not a dataset packer reads: neither refreshed nor replaced
        run = packer("build", raw, out, flag, "--workers", "1")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert f"{out} exists and is not a packer dataset ({out / MANIFEST}: manifest field shards" in run.stderr
    assert digest_tree(victim) == before  # every key of the victim, byte for byte
    assert not target.exists() and sorted(p.name for p in target.parent.iterdir()) == []


@pytest.mark.parametrize("dangling", [False, True], ids=["same bytes elsewhere", "dangling"])
@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_data_files_that_are_symlinks_are_refused_by_readers_and_never_linked(
    raw: Path, tmp_path: Path, backend: str, dangling: bool
) -> None:
    """data.mdb or a shard replaced by a symlink to the very same bytes elsewhere (every CRC matches),
    or to nothing: readers refuse it by name, and a refresh neither reads, links nor creates it (the
    new OUT's files are all its own), leaving what is behind the link as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=2)
    name = "data.mdb" if backend == "lmdb" else "shard-00001.bin"
    elsewhere.mkdir()
    shutil.move(out / name, elsewhere / name)
    if dangling:
        (elsewhere / name).unlink()
    (out / name).symlink_to(elsewhere / name)
    before = digest_tree(elsewhere)
    for opener in (ShardDataset, pin, verify):
        with pytest.raises(DatasetError, match=f"{name}: is a symbolic link, not a regular file"):
            opener(str(out))
    image(raw / "b" / "new.jpg", 98)

    run = packer("build", raw, out, "--update", "--workers", "1", "--shard-size", "2", "--backend", backend)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "cannot hard-link" in run.stderr and "is a symbolic link" in run.stderr
    assert only_regular_files(out) and verify(out).ok and len(ShardDataset(out)) == 7
    assert digest_tree(elsewhere) == before and (elsewhere / name).exists() != dangling


@pytest.mark.parametrize(
    ("backend", "files"),
    [
        ("lmdb", ["data-00001.mdb"]),  # the name of the segment a refresh writes next
        ("lmdb", ["data.mdb", "data.mdb"]),
        ("lmdb", ["index.npy"]),  # a refresh would link it, then finalize write through the link
        ("lmdb", ["../victim.lmdb/data.mdb"]),
        ("lmdb", ["/tmp/data.mdb"]),
        ("lmdb", ["sub/data.mdb"]),
        ("memmap", ["shard-00001.bin"]),
        ("memmap", ["shard-00000.bin", "manifest.json"]),
        ("memmap", ["shard-00000.bin", "report.jsonl"]),  # a journal file of the staging folder
    ],
)
def test_a_manifest_names_its_data_files_as_packer_writes_them(
    raw: Path, tmp_path: Path, backend: str, files: list[str]
) -> None:
    """Data file k has the name packer's writers give file k: no name of another file of the
    dataset or its staging folder, none twice, none outside it, and none that a refresh's new
    segment takes (it is numbered after the old files)."""
    out = tmp_path / "out"
    build(raw, out, backend=backend, workers=1, quiet=True, shard_size=3)
    listed = Manifest.load(out).shards
    edit_manifest(out, shards=[{**listed[min(k, len(listed) - 1)], "file": f} for k, f in enumerate(files)])
    with pytest.raises(DatasetError, match="manifest field shards is invalid"):
        Manifest.load(out)


def test_writers_create_their_files_and_never_write_through_links(raw: Path, tmp_path: Path) -> None:
    """The writers open what they write themselves: a new data file is created (O_EXCL, so never one
    already there), a resumed one reopened without following a symlink, and either refused when it
    is not a regular file of the staging folder's own (a hard link: a dataset's file)."""
    victim = tmp_path / "victim.lmdb"
    build(raw, victim, workers=1, quiet=True)
    before = digest_tree(victim)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "data-00001.mdb").symlink_to(victim / "data.mdb")
    with pytest.raises(BuildError, match="already exists"):
        LmdbWriter(staging, None, segment=1)
    with pytest.raises(BuildError, match="is a symbolic link; refusing to write through it"):
        LmdbWriter(staging, {"count": 0}, segment=1)
    (staging / "data-00002.mdb").symlink_to(tmp_path / "nowhere.mdb")
    with pytest.raises(BuildError, match="already exists"):
        LmdbWriter(staging, None, segment=2)
    os.link(victim / "data.mdb", staging / "data.mdb")
    with pytest.raises(BuildError, match="a file with 2 links"):
        LmdbWriter(staging, {"count": 1}, segment=0)
    (staging / "shard-00000.bin").symlink_to(victim / "data.mdb")
    with pytest.raises(BuildError, match="is a symbolic link"):
        MemmapWriter(staging, {"shards": [{"file": "shard-00000.bin", "count": 1, "bytes": 0}]})
    assert digest_tree(victim) == before and not (tmp_path / "nowhere.mdb").exists()

    writer = LmdbWriter(staging, None, segment=3)  # what a build does: a file of its own, by its own descriptor
    assert writer.append(b"record") == (3, 0)
    assert writer.close() == [
        {"file": "data-00003.mdb", "count": 1, "bytes": (staging / "data-00003.mdb").stat().st_size}
    ]


def test_a_lock_file_planted_in_a_split_folder_is_not_followed(raw: Path, tmp_path: Path) -> None:
    """A --split folder holds its datasets' lock files (``.train.lmdb.packer-lock``): one that is a
    symlink to a file of the user's is refused, never truncated to take the lock."""
    out, victim = tmp_path / "splits", tmp_path / "bashrc"
    build(raw, out, workers=1, quiet=True, split={"val": 0.3}, backend="lmdb")
    victim.write_text("export PATH=$HOME/bin:$PATH\n")
    (out / ".train.lmdb.packer-lock").symlink_to(victim)
    run = packer("build", raw, out, "--update", "--split", "val=0.3", "--backend", "lmdb", "--workers", "1")
    assert run.returncode == 1 and "a symbolic link is in its place" in run.stderr, run.stderr
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"


# ------------------------------------------------------------ item 5: only packer's folders go


def not_packers(raw: Path, tmp_path: Path) -> dict[str, Path]:
    """A browser extension, a webpack ``dist/`` (each with its manifest.json), a symlink to the first,
    and a folder of one's own files whose manifest.json is a symlink to a real dataset's."""
    ext, dist, borrowed = tmp_path / "extension", tmp_path / "dist", tmp_path / "borrowed"
    ext.mkdir()
    (ext / MANIFEST).write_text(json.dumps({"manifest_version": 3, "name": "mine", "version": "1.0"}))
    (ext / "background.js").write_text("chrome.runtime.onInstalled.addListener(() => {});")
    dist.mkdir()
    (dist / MANIFEST).write_text(json.dumps({"main.js": "main.3f2a.js"}))
    (dist / "main.3f2a.js").write_text("console.log(1);")
    (tmp_path / "link").symlink_to(ext)
    build(raw, tmp_path / "real", workers=1, quiet=True)
    borrowed.mkdir()
    (borrowed / "notes.txt").write_text("mine")
    (borrowed / MANIFEST).symlink_to(tmp_path / "real" / MANIFEST)
    return {"extension": ext, "dist": dist, "link": tmp_path / "link", "borrowed": borrowed}


def test_clean_and_refreshes_leave_folders_that_are_not_packers(raw: Path, tmp_path: Path) -> None:
    """``packer clean DIR`` and ``build --update/--force DIR`` delete or replace only a folder whose
    manifest packer reads (or a --split folder of them), never one that merely has a manifest.json,
    also not through a symlink to it; an empty folder is replaced with --force."""
    folders = not_packers(raw, tmp_path)
    before = {name: digest_tree(p) for name, p in folders.items()}
    for name, path in folders.items():
        cleaned = packer("clean", path)
        assert cleaned.returncode == 1 and "refusing to delete it" in cleaned.stderr, (name, cleaned.stderr)
        for flag in ("--update", "--force", "--resume"):
            run = packer("build", raw, path, flag, "--workers", "1")
            assert run.returncode == 1 and "is not a packer dataset" in run.stderr, (name, flag, run.stderr)
            assert "Traceback" not in run.stderr
    assert {name: digest_tree(p) for name, p in folders.items()} == before
    assert (tmp_path / "link").is_symlink() and (folders["borrowed"] / MANIFEST).is_symlink()

    split = tmp_path / "splits"
    build(raw, split, workers=1, quiet=True, split={"val": 0.3}, backend="lmdb")
    shutil.copytree(folders["extension"], split / "extension")  # beside the split datasets
    assert packer("clean", split).returncode == 1 and (split / "extension" / "background.js").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert packer("build", raw, empty, "--force", "--workers", "1").returncode == 0 and verify(empty).ok
    assert packer("clean", empty).returncode == 0 and not empty.exists()


# ------------------------------------------------------------ item 8: what the writer writes, a reader reads


def test_a_manifest_over_the_readers_limit_fails_the_build_and_leaves_out(raw: Path, tmp_path: Path) -> None:
    """``--classes`` listing 330,000 long names: a manifest of over 64 MiB, which every reader refuses.
    The build fails with one clear line before it decodes anything; the old OUT still opens."""
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    before = digest_tree(out)
    names = tmp_path / "classes.txt"
    with open(names, "w", encoding="utf-8") as f:
        f.write("a\nb\n")
        for i in range(330_000):
            f.write(f"{i:06d}-{'x' * 200}\n")

    run = packer("build", raw, out, "--force", "--workers", "1", "--classes", names)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "330,002 class names and 0 target names take 69.6 MB, over the 64 MiB manifest" in run.stderr, run.stderr
    assert digest_tree(out) == before and len(ShardDataset(out)) == 6


def test_the_build_writes_only_a_manifest_its_readers_accept(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is checked by the reader's own code (``Manifest.parse``) before anything of OUT is
    replaced: here the readers' size limit is lowered under the manifest of 6 one-record shards."""
    out = tmp_path / "out"
    build(raw, out, workers=1, quiet=True)
    before = digest_tree(out)
    monkeypatch.setattr(format, "MAX_MANIFEST", len((out / MANIFEST).read_bytes()) + 200)
    with pytest.raises(BuildError, match=r"readers would refuse its manifest \(.*: manifest is over"):
        build(raw, out, workers=1, quiet=True, force=True, shard_size=1)
    assert digest_tree(out) == before
    monkeypatch.undo()
    assert len(ShardDataset(out)) == 6
