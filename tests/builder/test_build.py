"""`packer build` / `packer info` end to end on the real EXIF-orientation photos."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image, ImageOps

from packer import BuildError, build
from packer.backends.lmdb import close_lmdb
from packer.builder.preprocess import target_size
from packer.format import INDEX_DTYPE, Manifest, lmdb_key, load_index, source_path

from ..conftest import COMBOS, PHOTOS


def stored_images(out: Path) -> tuple[Manifest, np.ndarray, np.ndarray, list[np.ndarray]]:
    """Read every record back without packer's reader: plain py-lmdb or numpy.memmap, per docs/FORMAT.md."""
    manifest = Manifest.load(out)
    index, sources = load_index(out, manifest)
    blobs: list[bytes] = []
    if manifest.backend == "lmdb":  # row i: key offset of the data file shards[shard] (one per segment)
        close_lmdb(out)  # packer's shared handles, if an earlier test read this dataset through packer
        envs = [lmdb.open(str(out / s["file"]), subdir=False, readonly=True, lock=False) for s in manifest.shards]
        txns = [env.begin() for env in envs]
        for i, row in enumerate(index):
            value = txns[row["shard"]].get(lmdb_key(int(row["offset"])))
            assert value is not None, f"record {i} is missing"
            blobs.append(value)
        for txn, env in zip(txns, envs):
            txn.abort()
            env.close()
    else:
        maps = [np.memmap(out / s["file"], dtype=np.uint8, mode="r") for s in manifest.shards]
        blobs = [maps[r["shard"]][r["offset"] : r["offset"] + r["length"]].tobytes() for r in index]
    images = []
    for row, blob in zip(index, blobs):
        assert len(blob) == row["length"]
        if manifest.format == "jpeg":
            images.append(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")))
        else:
            images.append(np.frombuffer(blob, np.uint8).reshape(row["height"], row["width"], 3))
    return manifest, index, sources, images


def reference(path: Path) -> np.ndarray:
    """The naive, obviously-right path: full decode, exif_transpose, LANCZOS to short edge 320."""
    im = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    return np.asarray(im.resize(target_size(*im.size, 320), Image.Resampling.LANCZOS))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255**2 / mse)) if mse else float("inf")


@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_records_upright_resized_and_labelled(built, backend: str, fmt: str) -> None:
    out = built(backend, fmt)
    manifest, index, sources, images = stored_images(out)
    assert manifest.count == 18 and manifest.classes == ["landscape", "portrait"]
    assert manifest.class_counts == [9, 9] and manifest.backend == backend and manifest.format == fmt
    assert (manifest.scanned, manifest.skipped, manifest.ignored) == (18, 0, 0)
    for row, img in zip(index, images):
        rel = source_path(sources, row)
        h, w = img.shape[:2]
        assert (h, w) == (row["height"], row["width"])
        assert min(h, w) == 320, rel
        if rel.startswith("landscape/"):
            assert row["label"] == 0 and w > h and Path(rel).name.startswith("Landscape")
        else:
            assert row["label"] == 1 and h > w and Path(rel).name.startswith("Portrait")
        ref = reference(PHOTOS / Path(rel).name)
        assert ref.shape == img.shape
        assert psnr(img, ref) > 30, f"{rel}: stored pixels differ from the tag-corrected original"
    if manifest.backend == "memmap":
        assert [s["count"] for s in manifest.shards] == [7, 7, 4]
        assert sum(s["bytes"] for s in manifest.shards) == int(index["length"].sum())


def test_wrong_orientation_would_be_caught(built) -> None:
    """The PSNR check above has teeth: a mirrored upright image is far from the reference."""
    _, index, sources, images = stored_images(built("memmap", "raw"))
    rel = source_path(sources, index[1])
    assert psnr(images[1][:, ::-1], reference(PHOTOS / Path(rel).name)) < 20


def test_digest_independent_of_workers(raw_photos: Path, built, tmp_path: Path) -> None:
    for backend, fmt in [("lmdb", "jpeg"), ("memmap", "raw")]:
        out = tmp_path / f"w2-{backend}-{fmt}"
        report = build(raw_photos, out, backend=backend, format=fmt, workers=2, quiet=True, shard_size=7)
        assert report.digest == Manifest.load(built(backend, fmt)).digest
        assert report.count == 18


def test_refuses_to_overwrite_without_force(raw_photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.lmdb"
    first = build(raw_photos, out, workers=1, quiet=True)
    with pytest.raises(BuildError, match="already exists"):
        build(raw_photos, out, workers=1, quiet=True)
    again = build(raw_photos, out, workers=1, quiet=True, force=True, quality=80)
    assert again.digest != first.digest and Manifest.load(out).quality == 80
    assert not list(tmp_path.glob(".*")), "staging or trash folders left beside OUT"


def test_plain_lmdb_reads_a_record_and_index_matches(built) -> None:
    out = built("lmdb", "jpeg")
    close_lmdb(out)
    env = lmdb.open(str(out), readonly=True, lock=False)
    with env.begin() as txn:
        blob = txn.get(b"0000000000")
        assert blob is not None
        assert txn.stat()["entries"] == 18
    env.close()
    index = np.load(out / "index.npy", allow_pickle=False)
    assert index.dtype == INDEX_DTYPE and index[0]["length"] == len(blob)
    assert Image.open(io.BytesIO(blob)).format == "JPEG"


def test_labels_csv_replaces_folder_labels(raw_photos: Path, tmp_path: Path) -> None:
    csv = tmp_path / "labels.csv"
    rows = ["path,label"] + [
        f"{p.relative_to(raw_photos).as_posix()},{'odd' if int(p.stem[-1]) % 2 else 'even'}"
        for p in sorted(raw_photos.rglob("*.jpg"))
    ]
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "csv.lmdb"
    build(raw_photos, out, labels=str(csv), workers=1, quiet=True)
    m = Manifest.load(out)
    assert m.classes == ["even", "odd"] and m.class_counts == [10, 8]


def test_cli_build_and_info_json(raw_photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.lmdb"
    run = subprocess.run(
        [sys.executable, "-m", "packer.cli", "build", str(raw_photos), str(out), "--workers", "2"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "packed 18 of 18 scanned" in run.stderr
    info = subprocess.run(
        [sys.executable, "-m", "packer.cli", "info", str(out), "--json"], capture_output=True, text=True, check=True
    )
    facts = json.loads(info.stdout)
    for key in (
        "count",
        "classes",
        "class_counts",
        "format",
        "backend",
        "short_edge",
        "quality",
        "bytes",
        "digest",
        "scanned",
        "skipped",
        "ignored",
    ):
        assert key in facts
    assert facts["count"] == 18 and facts["class_counts"] == {"landscape": 9, "portrait": 9}
    assert facts["backend"] == "lmdb" and facts["format"] == "jpeg" and facts["quality"] == 90
    again = subprocess.run(
        [sys.executable, "-m", "packer.cli", "build", str(raw_photos), str(out)], capture_output=True, text=True
    )
    assert again.returncode == 1 and "already exists" in again.stderr and "Traceback" not in again.stderr


def test_import_packer_does_not_import_torch() -> None:
    code = "import sys, packer; packer.build; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("caller_threads", [False, True])
def test_forkserver_workers_with_or_without_caller_threads(
    raw_photos: Path, built, tmp_path: Path, caller_threads: bool
) -> None:
    """Cron (no terminal, no thread) and interactive builds (tqdm's thread; a notebook) get the same pool:
    forkserver workers, which do not share the main process's growing scan list; same bytes."""
    import threading

    from packer.builder.workers import _worker_context

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    if caller_threads:
        thread.start()
    try:
        assert _worker_context().get_start_method() == "forkserver"
        report = build(raw_photos, tmp_path / "fs.lmdb", workers=2, quiet=True)
    finally:
        stop.set()
        if caller_threads:
            thread.join()
    assert report.digest == Manifest.load(built("lmdb", "jpeg")).digest
