"""packer.Writer / packer.pack: fields beside the image, in records readable without packer."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

import packer
from packer.format import Manifest
from packer.format.fields import declare, split_record
from packer.tools.verify import verify

FIELDS = {
    "label": "label",
    "boxes": "boxes",
    "box_labels": "box_labels",
    "mask": "mask",
    "caption": "text",
    "emb": ("array", "<f4"),
}


def _samples(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        img = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)
        mask = np.zeros((480, 640), np.uint8)
        mask[100:300, 200:400] = i + 1
        out.append(
            {
                "image": img,
                "label": i % 3,
                "boxes": [[200, 100, 400, 300], [0, 0, 64, 48]][: i % 3],
                "box_labels": [7, 8][: i % 3],
                "mask": mask,
                "caption": f"image {i} \u00e9",
                "emb": np.arange(i * 2, dtype=np.float32).reshape(i, 2),
            }
        )
    return out


def _record(out: Path, i: int) -> bytes:
    """Record ``i``'s bytes read without packer (docs/FORMAT.md)."""
    manifest = json.loads((out / "manifest.json").read_text())
    row = np.load(out / "index.npy", allow_pickle=False)[i]
    file = out / manifest["shards"][row["shard"]]["file"]
    if manifest["backend"] == "memmap":
        return np.memmap(file, np.uint8, mode="r")[row["offset"] : row["offset"] + row["length"]].tobytes()
    env = lmdb.open(str(file), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        data = txn.get(b"%010d" % row["offset"])
    env.close()
    assert data is not None
    return data


@pytest.mark.parametrize("backend, fmt", [("memmap", "raw"), ("lmdb", "jpeg")])
def test_pack_writes_fields_beside_the_image(tmp_path: Path, backend: str, fmt: str) -> None:
    out = tmp_path / ("out.lmdb" if backend == "lmdb" else "out")
    samples = [*_samples(), {"image": b"not an image", "label": 0, "source": "broken-one"}]
    report = packer.pack(samples, out, fields=FIELDS, format=fmt, backend=backend)
    assert (report.count, report.skipped, report.scanned) == (4, 1, 5)
    skipped = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    assert [s["path"] for s in skipped] == ["broken-one"] and "not a recognised image" in skipped[0]["reason"]
    manifest = Manifest.load(out)
    assert manifest.format_version == 4 and manifest.declared == declare(FIELDS)
    assert manifest.classes == ["0", "1", "2"] and manifest.class_counts == [2, 1, 1]
    assert verify(out).ok

    index = np.load(out / "index.npy", allow_pickle=False)
    for i, sample in enumerate(samples[:4]):
        data = _record(out, i)
        assert zlib.crc32(data) == index[i]["crc32"]  # the CRC covers the fields
        h, w = int(index[i]["height"]), int(index[i]["width"])
        assert (h, w) == (320, 427)  # short edge 320, boxes and masks scaled by 320 / 480
        lengths = np.frombuffer(data[:48], "<u8")  # image + 5 record fields (the label is in the index)
        assert 48 + lengths.sum() == len(data)
        image, (boxes, box_labels, mask, caption, emb) = split_record(memoryview(data), 5)
        if fmt == "raw":
            assert len(image) == h * w * 3
        else:
            assert bytes(image[:2]) == b"\xff\xd8"
        scale = np.array([w / 640, h / 480] * 2)
        expected = np.asarray(sample["boxes"], np.float64).reshape(-1, 4) * scale
        np.testing.assert_allclose(np.frombuffer(boxes, "<f4").reshape(-1, 4), expected, rtol=1e-6)
        assert np.frombuffer(box_labels, "<i4").tolist() == sample["box_labels"]
        runs = int(np.frombuffer(mask[:4], "<u4")[0])  # run-length encoded (docs/FORMAT.md, "Fields")
        pixels = np.repeat(np.frombuffer(mask, np.uint8, runs, 4 + 4 * runs), np.frombuffer(mask, "<u4", runs, 4))
        m = pixels.reshape(h, w)
        ys, xs = np.nonzero(m)
        assert set(np.unique(m)) == {0, i + 1}
        assert abs(ys.min() - 100 * h / 480) <= 1 and abs(xs.max() + 1 - 400 * w / 640) <= 1
        assert bytes(caption).decode() == sample["caption"]
        ndim = int(np.frombuffer(emb[:4], "<u4")[0])
        shape = tuple(np.frombuffer(emb[4 : 4 + 8 * ndim], "<u8"))
        np.testing.assert_array_equal(np.frombuffer(emb[4 + 8 * ndim :], "<f4").reshape(shape), sample["emb"])
        assert index[i]["label"] == sample["label"]


def test_images_as_paths_bytes_and_pil(tmp_path: Path) -> None:
    """Every kind of image the Writer takes; a path names its sample; EXIF orientation turns the image
    and its boxes are given in the upright image."""
    photo = tmp_path / "p.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view: stored 640 x 480, upright 480 x 640
    Image.new("RGB", (640, 480), (200, 30, 30)).save(photo, exif=exif, quality=95)
    fields = {"boxes": "boxes"}
    box = [[0, 0, 480, 64]]  # the top band of the upright (portrait) image
    samples = [
        {"image": photo, "boxes": box},
        {"image": photo.read_bytes(), "boxes": box, "source": "as-bytes"},
        {"image": Image.open(photo), "boxes": box, "source": "as-pil"},
    ]
    report = packer.pack(samples, tmp_path / "out", fields=fields)
    assert report.count == 3
    index = np.load(tmp_path / "out" / "index.npy", allow_pickle=False)
    assert [(int(r["height"]), int(r["width"])) for r in index] == [(427, 320)] * 3  # portrait
    sources = np.load(tmp_path / "out" / "sources.npy", allow_pickle=False).tobytes().decode()
    assert sources == f"{photo}as-bytesas-pil"
    for i in range(3):
        _, (boxes,) = split_record(memoryview(_record(tmp_path / "out", i)), 1)
        # each axis by its own scale: 320 / 480 across, 427 / 640 down
        np.testing.assert_allclose(np.frombuffer(boxes, "<f4"), [0, 0, 320, 64 * 427 / 640], rtol=1e-6)


def test_a_sample_that_fails_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def samples():
        yield {"image": np.zeros((64, 64, 3), np.uint8), "caption": "x"}
        raise RuntimeError("the user's loop failed")

    with pytest.raises(RuntimeError):
        packer.pack(samples(), out, fields={"caption": "text"})
    assert not out.exists() and not list(tmp_path.iterdir())


def test_bad_samples_and_declarations(tmp_path: Path) -> None:
    with pytest.raises(packer.BuildError, match="kind 'polygon' is not one of"):
        packer.Writer(tmp_path / "a", fields={"x": "polygon"})
    with pytest.raises(packer.BuildError, match="box_labels need a boxes field"):
        packer.Writer(tmp_path / "a", fields={"box_labels": "box_labels"})
    with pytest.raises(packer.BuildError, match="not a plain numpy dtype"):
        packer.Writer(tmp_path / "a", fields={"x": ("array", "O")})
    with pytest.raises(packer.BuildError, match="does not take split"):
        packer.Writer(tmp_path / "a", fields={}, split={"val": 0.1})
    with pytest.raises(packer.BuildError, match="does not take split_seed, on_class_change"):
        packer.Writer(tmp_path / "a", fields={}, split_seed=3, on_class_change="fail")
    img = np.zeros((64, 80, 3), np.uint8)
    samples = [
        {"image": img, "boxes": [[0, 0, 10, 10]], "box_labels": [1, 2], "source": "two-labels"},
        {"image": img, "boxes": [[5, 5, 1, 1]], "source": "inverted"},
        {"image": img, "boxes": [[0, 0, 1, float("nan")]], "source": "nan"},
        {"image": img, "mask": np.zeros((10, 10), np.uint8), "source": "small-mask"},
        {"image": np.zeros((64, 80, 5), np.uint8), "source": "five-channels"},
        {"image": img, "source": "ok"},
    ]
    fields = {"boxes": "boxes", "box_labels": "box_labels", "mask": "mask"}
    for s in samples:
        s.setdefault("mask", np.ones((64, 80), np.uint8))
    report = packer.pack(samples, tmp_path / "b", fields=fields)
    assert (report.count, report.skipped) == (1, 5)
    reasons = {
        s["path"]: s["reason"] for s in map(json.loads, (tmp_path / "b" / "report.jsonl").read_text().splitlines())
    }
    assert "2 labels for 1 boxes" in reasons["two-labels"]
    assert "x0 <= x1" in reasons["inverted"] and "finite" in reasons["nan"]
    assert "the image is 64 x 80" in reasons["small-mask"]
    assert "C 1, 2, 3 or 4 channels" in reasons["five-channels"]
    with pytest.raises(packer.BuildError, match=r"\['boxs'\] are not declared"):
        packer.pack([{"image": img, "boxs": []}], tmp_path / "c", fields=fields)
    assert not (tmp_path / "c").exists()


def test_damaged_fields_are_found_by_verify(tmp_path: Path) -> None:
    out = tmp_path / "out"
    packer.pack(_samples(2), out, fields=FIELDS, format="raw")
    shard = out / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    row = np.load(out / "index.npy", allow_pickle=False)[1]
    start = int(row["offset"])
    data[start + 8 : start + 16] = (10**12).to_bytes(8, "little")  # the boxes' length: hostile
    shard.write_bytes(bytes(data))
    index = np.load(out / "index.npy", allow_pickle=False)
    index[1]["crc32"] = zlib.crc32(bytes(data[start : start + int(row["length"])]))  # a forged CRC too
    np.save(out / "index.npy", index)
    result = verify(out)
    assert not result.ok
    assert any("record 1" in p and "field table says" in p for p in result.problems), result.problems


def test_a_dataset_without_fields_is_version_3(tmp_path: Path) -> None:
    packer.pack([{"image": np.zeros((40, 40, 3), np.uint8)}], tmp_path / "out", fields={})
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and "fields" not in manifest
    assert verify(tmp_path / "out").ok


def test_info_counts_fields(tmp_path: Path) -> None:
    from packer.cli import dataset_info

    packer.pack(_samples(4), tmp_path / "out", fields=FIELDS)
    facts = {f["name"]: f for f in dataset_info(tmp_path / "out")["fields"]}
    assert facts["boxes"]["records"] == 2 and facts["boxes"]["items"] == 3  # 0, 1, 2, 0 boxes
    assert [(b["lo"], b["hi"], b["count"]) for b in facts["boxes"]["per_record_histogram"]] == [
        (0, 0, 2),
        (1, 1, 1),
        (2, 2, 1),
    ]
    assert facts["label"]["records"] == 4 and facts["emb"]["records"] == 3  # the first emb is 0 x 2


def test_compact_keeps_fields_and_a_folder_update_refuses_them(tmp_path: Path, raw_photos: Path) -> None:
    from packer.tools.compact import compact

    out = tmp_path / "out"
    packer.pack(_samples(3), out, fields=FIELDS, format="raw")
    before = packer.ShardDataset(out, crop_size=None)[2]
    compact(out, quiet=True)
    manifest = Manifest.load(out)
    assert manifest.format_version == 4 and manifest.declared == declare(FIELDS) and verify(out).ok
    after = packer.ShardDataset(out, crop_size=None)[2]
    assert after["caption"] == before["caption"] and after["boxes"].tolist() == before["boxes"].tolist()
    with pytest.raises(packer.BuildError, match=r"holds fields beside its images.*cannot update=True or resume=True"):
        packer.build(raw_photos, out, update=True, workers=0, quiet=True)
    assert Manifest.load(out).format_version == 4


class _KillsItsWorker:
    """Unpickled in a worker process, it ends that process (as a decoder crash would)."""

    def __reduce__(self):
        import os

        return os._exit, (3,)


def test_pack_in_worker_processes(tmp_path: Path) -> None:
    """workers=2: the build's worker pool, results in order: the same dataset as in this process; a
    sample that kills its worker is a reported skip, the others packed."""
    samples = _samples(6)
    one = packer.pack(samples, tmp_path / "one", fields=FIELDS, workers=0)
    blocks = {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}
    two = packer.pack(samples, tmp_path / "two", fields=FIELDS, workers=2)  # images and masks in shared memory
    assert one.digest == two.digest and one.count == two.count == 6
    assert {name for name in os.listdir("/dev/shm") if name.startswith("psm_")} <= blocks  # every block freed
    crashing = [*samples[:3], {"image": _KillsItsWorker(), "label": 0, "source": "the-crash"}, *samples[3:]]
    report = packer.pack(crashing, tmp_path / "three", fields=FIELDS, workers=2)
    assert (report.count, report.skipped) == (6, 1) and report.digest == one.digest
    reasons = [json.loads(line) for line in (tmp_path / "three" / "report.jsonl").read_text().splitlines()]
    assert [(r["path"], "crashed its worker" in r["reason"]) for r in reasons] == [("the-crash", True)]


def _count_encoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sources of the samples encoded in this process from now on (the Writer's own encoding,
    counted on its way)."""
    from packer.builder import writer

    packed: list[str] = []
    record = writer._record

    def counted(sample: dict, job: writer.SampleJob) -> tuple:
        packed.append(sample["source"])
        return record(sample, job)

    monkeypatch.setattr(writer, "_record", counted)
    return packed


_RESUMABLE = """
import sys
import time
import time

import numpy as np

import packer

FIELDS = {"label": "label", "boxes": "boxes", "caption": "text"}


def samples(n, pause=0.0):
    rng = np.random.default_rng(7)
    for i in range(n):
        time.sleep(pause)  # the killed run: slow enough to be killed half way
        img = rng.integers(0, 255, (120 + i, 160, 3), dtype=np.uint8)
        if i == 3:
            yield {"image": b"not an image", "label": 0, "source": "broken"}
            continue
        yield {"image": img, "label": i % 2, "boxes": [[i, i, i + 20, i + 30]], "caption": f"n{i}", "source": f"s{i}"}


if __name__ == "__main__":
    out, workers = sys.argv[1], int(sys.argv[2])
    packer.pack(samples(40, 0.05), out, fields=FIELDS, resume=True, checkpoint_seconds=0, workers=workers)
"""


@pytest.mark.parametrize("backend, workers", [("memmap", 2), ("lmdb", 0)])
def test_a_killed_pack_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, workers: int) -> None:
    """A pack killed with SIGKILL half way (a real process) continues from its last checkpoint when
    given the same samples again with resume=True: the samples packed before are checked, not packed
    again, and the dataset is the one an uninterrupted pack writes."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "pack_script.py"
    script.write_text(_RESUMABLE)
    sys.path.insert(0, str(tmp_path))
    monkeypatch.setattr(sys, "path", sys.path)
    import pack_script  # type: ignore[import-not-found]

    out = tmp_path / ("out.lmdb" if backend == "lmdb" else "out")
    progress = tmp_path / f".{out.name}.packer-tmp" / "progress.json"
    child = subprocess.Popen([sys.executable, str(script), str(out), str(workers)])
    deadline, done = time.monotonic() + 120, 0
    while done < 15 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        with contextlib.suppress(OSError, ValueError):
            done = json.loads(progress.read_text())["sources_done"]
    assert done >= 15, "the pack was half way"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not out.exists() and (tmp_path / f".{out.name}.packer-tmp").is_dir()

    packed = _count_encoded(monkeypatch)
    report = packer.pack(pack_script.samples(40), out, fields=pack_script.FIELDS, resume=True, workers=0)
    assert 15 <= report.resumed_from < 40 and report.processed == 40 - report.resumed_from == len(packed)
    assert packed == [f"s{i}" for i in range(report.resumed_from, 40)]  # none packed again
    assert (report.count, report.skipped) == (39, 1)

    other = tmp_path / ("whole.lmdb" if backend == "lmdb" else "whole")
    whole = packer.pack(pack_script.samples(40), other, fields=pack_script.FIELDS, resume=True, workers=0)
    assert report.digest == whole.digest
    for name in ("index.npy", "sources.npy", "report.jsonl"):  # identities, places, lengths, CRCs: all equal
        assert (out / name).read_bytes() == (other / name).read_bytes(), name
    assert Manifest.load(out).field_counts == Manifest.load(other).field_counts
    assert verify(out).ok


def test_resume_refuses_other_samples(tmp_path: Path) -> None:
    """Samples that are not the interrupted pack's (another order, another content) are refused,
    the interrupted work kept; so is a pack that was not made resumable."""
    out = tmp_path / "out"
    samples = [{"image": np.full((40, 40, 3), i, np.uint8), "source": f"s{i}"} for i in range(6)]

    def interrupted(given):
        yield from given[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        packer.pack(interrupted(samples), out, fields={}, resume=True, checkpoint_seconds=0, workers=0)
    assert not out.exists() and (tmp_path / ".out.packer-tmp").is_dir()
    with pytest.raises(packer.BuildError, match=r"sample 1 \(s2\) is not the one the interrupted pack"):
        packer.pack([samples[0], samples[2], samples[1], *samples[3:]], out, fields={}, resume=True, workers=0)
    assert (tmp_path / ".out.packer-tmp").is_dir()
    report = packer.pack(samples, out, fields={}, resume=True, workers=0)
    assert (report.resumed_from, report.processed, report.count) == (4, 2, 6)

    with pytest.raises(KeyboardInterrupt):
        packer.pack(interrupted(samples), tmp_path / "plain", fields={}, checkpoint_seconds=0, workers=0)
    assert not (tmp_path / ".plain.packer-tmp").exists()  # without resume: nothing kept


def _keyed(n: int, seed: int = 0) -> list[dict]:
    """Samples keyed by ``source`` (as a user's image ids), each of its own content."""
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 255, (90, 120, 3), dtype=np.uint8),
            "label": i % 3,
            "boxes": [[i, 2, i + 30, 40]],
            "caption": f"c{i}",
            "source": f"img-{i}",
        }
        for i in range(n)
    ]


KEYED = {"label": "label", "boxes": "boxes", "caption": "text"}


@pytest.mark.parametrize("workers", [0, 2])
def test_update_keyed_by_source_keeps_unchanged_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """update=True: a sample with the source and content OUT holds keeps its record (not encoded
    again, left in OUT's linked data file), a changed one is packed again, a removed one dropped, a
    new one added: the dataset a fresh pack of the same samples writes."""

    out = tmp_path / "out"
    v1 = _keyed(10)
    packer.pack(v1, out, fields=KEYED, update=True, workers=workers)
    first_shard = os.stat(out / "shard-00000.bin")
    v2 = [dict(s) for s in v1]
    v2[2]["image"] = v2[2]["image"] // 2  # new pixels
    v2[5]["boxes"] = [[0, 0, 5, 5]]  # new boxes
    del v2[7]
    new = _keyed(12, seed=1)[10:]
    v2 = [*v2[:4], new[0], *v2[4:], new[1]]

    packed = _count_encoded(monkeypatch)
    report = packer.pack(v2, out, fields=KEYED, update=True, workers=0)  # in this process: counted
    assert sorted(packed) == ["img-10", "img-11", "img-2", "img-5"]
    assert (report.count, report.reused, report.processed) == (11, 7, 4)
    assert report.changes is not None
    assert (list(report.changes.added), list(report.changes.changed), list(report.changes.deleted)) == (
        ["img-10", "img-11"],
        ["img-2", "img-5"],
        ["img-7"],
    )
    manifest = Manifest.load(out)
    assert manifest.segments == 2 and manifest.dead_bytes > 0  # the old file linked, its dead record left
    assert os.path.samestat(os.stat(out / "shard-00000.bin"), first_shard)
    assert verify(out).ok

    fresh = packer.pack(v2, tmp_path / "fresh", fields=KEYED, update=True, workers=workers)
    assert report.digest == fresh.digest and manifest.field_counts == Manifest.load(tmp_path / "fresh").field_counts
    a, b = packer.ShardDataset(out, crop_size=None), packer.ShardDataset(tmp_path / "fresh", crop_size=None)
    for i in range(len(v2)):
        assert a.source(i) == b.source(i) == v2[i]["source"]
        x, y = a[i], b[i]
        assert x["image"].equal(y["image"]) and x["boxes"].equal(y["boxes"]) and x["caption"] == y["caption"]

    packed.clear()
    again = packer.pack(v2, out, fields=KEYED, update=True, workers=workers)
    assert again.up_to_date and not packed and Manifest.load(out).digest == report.digest


def test_update_refuses_duplicate_sources_and_packs_all_without_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    samples = _keyed(4)
    samples[3]["source"] = "img-1"
    with pytest.raises(packer.BuildError, match=r"samples 1 and 3 both have source 'img-1'"):
        packer.pack(samples, tmp_path / "a", fields=KEYED, update=True, workers=0)
    assert not (tmp_path / "a").exists()
    with pytest.raises(packer.BuildError, match=r"sample 0 has no 'source'"):
        packer.pack([{"image": np.zeros((40, 40, 3), np.uint8)}], tmp_path / "a", fields={}, update=True)

    packer.pack(_keyed(4), tmp_path / "b", fields=KEYED, workers=0)  # no digests taken
    report = packer.pack(_keyed(4), tmp_path / "b", fields=KEYED, update=True, workers=0, quiet=False)
    assert report.reused == 0 and report.processed == 4 and "holds no digest of its samples" in capsys.readouterr().err
    again = packer.pack(_keyed(4), tmp_path / "b", fields=KEYED, update=True, workers=0)
    assert again.up_to_date
    lmdb = packer.pack(_keyed(4), tmp_path / "b", fields=KEYED, update=True, workers=0, backend="lmdb")
    assert (lmdb.reused, lmdb.processed) == (4, 0) and lmdb.digest == again.digest  # copied, not encoded
    assert Manifest.load(tmp_path / "b").backend == "lmdb" and verify(tmp_path / "b").ok


def test_an_interrupted_update_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """update=True with resume=True: an interrupted refresh continues with the plan it recorded (the
    old data files it linked); resumed without update it is refused; the result is a fresh pack's."""
    out = tmp_path / "out"
    v1 = _keyed(8)
    packer.pack(v1, out, fields=KEYED, update=True, workers=0)
    v2 = [*v1[:3], *_keyed(10, seed=2)[8:], *v1[3:7]]  # two new in the middle, the last one dropped
    v2[1] = {**v2[1], "caption": "changed"}

    def interrupted():
        yield from v2[:5]
        raise KeyboardInterrupt

    options: dict[str, Any] = {"fields": KEYED, "update": True, "resume": True, "checkpoint_seconds": 0}
    with pytest.raises(KeyboardInterrupt):
        packer.pack(interrupted(), out, workers=0, **options)
    # named as packer.Writer's keywords, not the CLI's flags
    with pytest.raises(packer.BuildError, match=r"pack refreshed .* reusing its records; resume it with update=True "):
        packer.pack(v2, out, fields=KEYED, resume=True, workers=0)
    packed = _count_encoded(monkeypatch)
    report = packer.pack(v2, out, workers=0, **options)
    assert report.resumed_from == 5 and packed == [] and report.reused == 4  # the last four, kept
    assert report.changes is not None and list(report.changes.deleted) == ["img-7"]
    assert sorted(report.changes.added) == ["img-8", "img-9"] and list(report.changes.changed) == ["img-1"]
    fresh = packer.pack(v2, tmp_path / "fresh", fields=KEYED, workers=0)
    assert report.digest == fresh.digest and verify(out).ok


def test_resuming_an_interrupted_force_pack_needs_force_again(tmp_path: Path) -> None:
    """An interrupted ``force=True`` pack over a complete dataset is continued only by a call that
    says force=True again: resumed without it, the complete dataset at OUT is not replaced (as a
    folder build's --resume never replaces one), and the interrupted work is kept for the next run."""
    out = tmp_path / "out"
    old = [{"image": np.full((40, 40, 3), 200 - i, np.uint8), "source": f"old{i}"} for i in range(3)]
    new = [{"image": np.full((40, 40, 3), i, np.uint8), "source": f"s{i}"} for i in range(6)]
    first = packer.pack(old, out, fields={}, workers=0)

    def interrupted(given):
        yield from given[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        packer.pack(interrupted(new), out, fields={}, force=True, resume=True, checkpoint_seconds=0, workers=0)
    staging = tmp_path / ".out.packer-tmp"
    assert staging.is_dir() and Manifest.load(out).digest == first.digest
    with pytest.raises(packer.BuildError, match=r"complete dataset.*force=True"):
        packer.pack(new, out, fields={}, resume=True, workers=0)
    assert Manifest.load(out).digest == first.digest and staging.is_dir()  # both as they were
    report = packer.pack(new, out, fields={}, force=True, resume=True, workers=0)
    assert (report.resumed_from, report.processed, report.count) == (4, 2, 6)
    assert [packer.ShardDataset(out).source(i) for i in range(6)] == [f"s{i}" for i in range(6)]


def test_a_structured_array_is_judged_alike_with_workers(tmp_path: Path) -> None:
    """A big array of a structured dtype (not a plain numeric one) is the same reported skip whether
    the sample is encoded here or in a worker: shared memory (packer.builder.shared) carries only
    dtypes whose name tells them whole, so the worker sees the fields the sample's array has."""
    rec = np.zeros(20000, dtype=[("a", "<i4"), ("b", "<f4")])  # 160 KB: past shared.MIN_SHARED
    reasons = []
    for workers in (0, 2):
        samples = [{"image": np.full((40, 40, 3), i, np.uint8), "emb": rec, "source": f"s{i}"} for i in range(2)]
        samples.append({"image": np.zeros((40, 40, 3), np.uint8), "emb": np.zeros(3, np.float32), "source": "ok"})
        out = tmp_path / f"w{workers}"
        report = packer.pack(samples, out, fields={"emb": ("array", "float32")}, workers=workers)
        assert (report.count, report.skipped) == (1, 2)
        reasons.append([json.loads(line)["reason"] for line in (out / "report.jsonl").read_text().splitlines()])
    assert reasons[0] == reasons[1] and "not a plain numeric array" in reasons[0][0]


def test_shared_blocks_are_reused_once_their_chunk_is_done(tmp_path: Path) -> None:
    """packer.builder.shared keeps a chunk's block for a later chunk once its samples' results are
    taken (no fresh pages per chunk), never while one is pending, replaces a kept block too small,
    and unlinks every block at the end; a pack through it over chunks of varied sizes is the one
    packed in this process, byte for byte."""
    from packer.builder.shared import Blocks, Shared

    def chunk(side: int) -> list[dict]:
        return [{"image": np.full((side, side, 3), k, np.uint8)} for k in range(4)]

    blocks = Blocks()
    first = blocks.share(chunk(200))
    name = first[0]["image"].block
    second = blocks.share(chunk(200))
    assert second[0]["image"].block != name  # the first chunk's samples are pending
    for _ in range(4):
        blocks.taken()
    assert blocks.share(chunk(190))[0]["image"].block == name  # done: kept, and big enough
    for _ in range(8):
        blocks.taken()
    bigger = blocks.share(chunk(900))[0]["image"]
    assert isinstance(bigger, Shared) and bigger.block not in (name, second[0]["image"].block)
    blocks.close()
    assert not any(Path("/dev/shm", n).exists() for n in (name, second[0]["image"].block, bigger.block))

    rng = np.random.default_rng(3)
    samples = [{"image": rng.integers(0, 255, (150 + 7 * i, 220, 3), np.uint8)} for i in range(30)]
    here = packer.pack(samples, tmp_path / "here", fields={}, workers=0)
    there = packer.pack(samples, tmp_path / "there", fields={}, workers=2)
    assert here.digest == there.digest and (here.count, there.count) == (30, 30)


@pytest.mark.parametrize("workers", [0, 2])
def test_field_values_that_would_be_altered_are_reported_skips(tmp_path: Path, workers: int) -> None:
    """A mask of NaN, fractions or ids beyond 0..255, complex boxes, an array beyond its dtype: each a
    skip naming the sample, checked on the mask as given (the resize to the short edge would drop most
    of its pixels); a float mask of whole ids is stored as those ids."""
    img = np.zeros((640, 800, 3), np.uint8)
    ids = np.zeros((640, 800))
    ids[100:200, 100:300] = 9.0

    def bad(pixel: float) -> np.ndarray:
        m = ids.copy()
        m[0, 0] = pixel  # under no pixel the resize keeps (it samples rows and columns 1, 3, ...)
        return m

    samples = [
        {"image": img, "mask": bad(np.nan), "source": "nan-mask"},
        {"image": img, "mask": bad(2.5), "source": "fraction-mask"},
        {"image": img, "mask": bad(300), "source": "big-mask"},
        {"image": img, "mask": ids, "boxes": [[0, 0, 1j, 1]], "source": "complex-boxes"},
        {"image": img, "mask": ids, "emb": np.array([1e300]), "source": "big-emb"},
        {"image": img, "mask": ids, "source": "ok"},
    ]
    fields = {"boxes": "boxes", "mask": "mask", "emb": ("array", "<f4")}
    for s in samples:
        s.setdefault("emb", np.zeros(2, np.float32))
    report = packer.pack(samples, tmp_path / "b", fields=fields, workers=workers)
    assert (report.count, report.skipped) == (1, 5)
    reasons = {
        s["path"]: s["reason"] for s in map(json.loads, (tmp_path / "b" / "report.jsonl").read_text().splitlines())
    }
    assert "not whole numbers" in reasons["nan-mask"] and "not whole numbers" in reasons["fraction-mask"]
    assert "outside 0..255" in reasons["big-mask"] and "real numbers" in reasons["complex-boxes"]
    assert "would become inf" in reasons["big-emb"]
    mask = np.asarray(packer.ShardDataset(tmp_path / "b", crop_size=None)[0]["mask"])
    assert mask.shape == (320, 400) and set(np.unique(mask).tolist()) == {0, 9}
    with pytest.raises(packer.BuildError, match=r"nan-mask.*not whole numbers"):
        packer.pack(samples[:1], tmp_path / "c", fields=fields, workers=workers, on_error="fail")
    assert not (tmp_path / "c").exists()


def _paletted(indices: np.ndarray, colours: list[tuple[int, int, int]], transparent: int | None = None) -> Image.Image:
    """A "P" image of ``indices`` into ``colours`` (and, where given, its transparent index)."""
    im = Image.fromarray(indices, "P")
    im.putpalette([c for colour in colours for c in colour])
    if transparent is not None:
        im.info["transparency"] = transparent
    return im


def test_update_sees_a_palette_or_transparency_change(tmp_path: Path) -> None:
    """A "P" image's pixels are indices: a sample whose palette, or transparent index, changed is
    packed again by update=True (its record shows the new colours), not kept as up to date."""
    indices = np.zeros((40, 60), np.uint8)
    indices[:, 30:] = 1
    red_blue = [(255, 0, 0), (0, 0, 255)]
    v1 = [
        {"image": _paletted(indices, red_blue), "source": "palette"},
        {"image": _paletted(indices, red_blue, transparent=1), "source": "transparency"},
        {"image": _paletted(indices, red_blue), "source": "same"},
    ]
    out = tmp_path / "out"
    packer.pack(v1, out, update=True, format="raw", workers=0)
    v2 = [
        {"image": _paletted(indices, [(0, 255, 0), (0, 0, 255)]), "source": "palette"},  # red -> green
        {"image": _paletted(indices, red_blue, transparent=0), "source": "transparency"},
        v1[2],
    ]
    report = packer.pack(v2, out, update=True, format="raw", workers=0)
    assert not report.up_to_date and (report.reused, report.processed) == (1, 2)
    assert report.changes is not None and sorted(report.changes.changed) == ["palette", "transparency"]
    ds = packer.ShardDataset(out, crop_size=None, dtype=torch.uint8)
    assert ds[0][0][:, 0, 0].tolist() == [0, 255, 0]  # the new palette's colour
    left, right = ds[1][0][:, 0, 0].tolist(), ds[1][0][:, 0, -1].tolist()
    assert (left, right) == ([255, 255, 255], [0, 0, 255])  # index 0 now transparent: on white


def test_sample_digests_of_images_without_a_palette_stay_as_they_were() -> None:
    """The identities update=True compares, for images that have no palette nor transparency, are
    those packer 0.x took before the palette was digested (values recorded then): the datasets
    packed then keep their records on a refresh."""
    from packer.builder.writer import sample_identity

    rng = np.random.default_rng(5)
    a = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    samples = {
        "array": (a, 1828, 15918375281971504364),
        "rgb": (Image.fromarray(a), 1826, 2822560011832671453),
        "L": (Image.fromarray(a[..., 0]), 624, 11734614407450098147),
        "RGBA": (Image.fromarray(np.dstack([a, a[..., :1]])), 2427, 10037189989031152137),
        "bytes": (b"\x89PNG not really", 29, 801135933631703747),
    }
    fields = declare({"caption": "text"})
    for name, (image, size, digest) in samples.items():
        identity = sample_identity({"image": image, "caption": "x"}, fields)
        assert (int(identity["src_size"]), int(identity["src_hash"])) == (size, digest), name


def _cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer.cli", *map(str, args)], capture_output=True, text=True)


def _coco_file(tmp_path: Path, images: list[str]) -> tuple[Path, Path]:
    """images/ with a photo per name listed, and a COCO file listing them (no annotations)."""
    folder = tmp_path / "images"
    folder.mkdir(exist_ok=True)
    entries = []
    for k, name in enumerate(images):
        Image.new("RGB", (80, 60), (10 * k, 90, 200)).save(folder / name)
        entries.append({"id": k + 1, "file_name": name, "width": 80, "height": 60})
    path = tmp_path / f"coco-{len(images)}.json"
    path.write_text(json.dumps({"images": entries, "annotations": [], "categories": [{"id": 1, "name": "x"}]}))
    return folder, path


def test_an_empty_input_never_replaces_a_dataset(tmp_path: Path) -> None:
    """No samples (force=True, update=True, a --coco file listing no images), or every one skipped,
    is refused as a folder build refuses no images, OUT left as it was, in the caller's words;
    allow_empty=True (--allow-empty) writes the empty dataset."""
    out = tmp_path / "out"
    first = packer.pack(_keyed(3), out, fields=KEYED, update=True, workers=0)
    for options in ({"force": True}, {"update": True}):
        with pytest.raises(
            packer.BuildError, match=r"no samples to pack: .*out is left as it was \(pass allow_empty=True"
        ):
            packer.pack([], out, fields=KEYED, workers=0, **options)
        assert Manifest.load(out).digest == first.digest
    with pytest.raises(packer.BuildError) as refused:
        packer.pack([{"image": b"not an image", "source": "a"}], out, fields=KEYED, force=True, workers=0)
    assert "packed 0 of 1 samples: every one was skipped" in str(refused.value)
    assert "pass allow_empty=True" in str(refused.value) and "--allow-empty" not in str(refused.value)
    assert Manifest.load(out).digest == first.digest
    with pytest.raises(packer.BuildError, match=r"no samples to pack: nothing written to"):
        packer.pack([], tmp_path / "new", workers=0)
    assert not (tmp_path / "new").exists()
    empty = packer.pack([], tmp_path / "new", fields=KEYED, allow_empty=True, workers=0)
    assert empty.count == 0 and verify(tmp_path / "new").ok

    images, listed = _coco_file(tmp_path, ["a.png", "b.png"])
    coco_out = tmp_path / "coco"
    assert _cli("build", images, coco_out, "--coco", listed).returncode == 0
    before = Manifest.load(coco_out).digest
    _, nothing = _coco_file(tmp_path, [])
    run = _cli("build", images, coco_out, "--coco", nothing, "--force")
    assert run.returncode == 1 and "no files to pack" in run.stderr and "(pass --allow-empty" in run.stderr
    assert Manifest.load(coco_out).digest == before
    run = _cli("build", images, coco_out, "--coco", nothing, "--force", "--allow-empty")
    assert run.returncode == 0 and Manifest.load(coco_out).count == 0


def test_errors_name_the_callers_options_and_an_up_to_date_update_reused_all(tmp_path: Path) -> None:
    """--coco --resume on a complete OUT names the CLI's flags (not packer.pack's keywords); an
    update that finds every sample up to date reports them reused, none processed."""
    images, listed = _coco_file(tmp_path, ["a.png", "b.png"])
    out = tmp_path / "coco"
    assert _cli("build", images, out, "--coco", listed).returncode == 0
    run = _cli("build", images, out, "--coco", listed, "--resume")
    assert run.returncode == 1 and "nothing to resume (--update refreshes it, --force replaces it)" in run.stderr
    assert "=True" not in run.stderr
    with pytest.raises(packer.BuildError, match=r"nothing to resume \(update=True refreshes it, force=True replaces"):
        packer.build(images, out, coco=listed, resume=True, quiet=True)

    packer.pack(_keyed(5), tmp_path / "keyed", fields=KEYED, update=True, workers=0)
    again = packer.pack(_keyed(5), tmp_path / "keyed", fields=KEYED, update=True, workers=0)
    assert again.up_to_date and (again.reused, again.processed) == (5, 0)


class _Wrapping(torch.utils.data.Dataset):
    """A map-style dataset whose index wraps (``i % n``): it never raises IndexError past its end."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.reads += 1
        assert self.reads <= 2 * self.n, "read far past its len()"  # (a test that fails, not one that hangs)
        return {"image": np.full((40, 50, 3), i % self.n, np.uint8), "source": f"s{i % self.n}"}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torch_dataset_is_read_to_its_len_and_fields_are_optional(tmp_path: Path, workers: int) -> None:
    data = _Wrapping(5)
    report = packer.pack(data, tmp_path / "out", workers=workers)  # no fields=: none
    assert (report.count, data.reads) == (5, 5)
    assert [packer.ShardDataset(tmp_path / "out").source(i) for i in range(5)] == [f"s{i}" for i in range(5)]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_pixels_torch_users_hand_over(tmp_path: Path, workers: int) -> None:
    """uint8 tensors C x H x W (torchvision's read_image) and H x W x C, numpy H x W grey, RGBA
    (alpha over white, as the folder build), floats in 0..1 (ToTensor's) are each the record that
    the same picture as a file or an H x W x 3 array makes; floats outside 0..1 and other dtypes are
    reported skips saying what to pass; a 3 x 3 x 3 array is channels-last."""
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (160, 190, 3), dtype=np.uint8)  # under the short edge: no resize
    rgba = np.dstack([rgb, rng.integers(0, 256, (160, 190), dtype=np.uint8)])
    grey = rgb[..., 1].copy()
    for name, a in (("rgb.png", rgb), ("rgba.png", rgba), ("grey.png", grey)):
        Image.fromarray(a).save(tmp_path / name)
    chw = torch.from_numpy(rgb).permute(2, 0, 1)
    samples = [
        {"image": chw, "source": "chw"},
        {"image": torch.from_numpy(rgb), "source": "hwc"},
        {"image": chw.float().div(255).requires_grad_(), "source": "unit-float"},
        {"image": rgba, "source": "rgba"},
        {"image": torch.from_numpy(rgba).permute(2, 0, 1), "source": "rgba-chw"},
        {"image": grey, "source": "grey"},
        {"image": torch.from_numpy(grey)[None], "source": "grey-chw"},
        {"image": chw.float(), "source": "0-255-float"},
        {"image": rgb.astype(np.uint16), "source": "uint16"},
        {"image": np.arange(27, dtype=np.uint8).reshape(3, 3, 3), "source": "3x3x3"},
    ]
    # (with workers: arrays over 64 KiB, these, reach them through shared memory)
    report = packer.pack(samples, tmp_path / "out", fields={}, format="raw", min_size=1, workers=workers)
    assert (report.count, report.skipped) == (8, 2)
    reasons = {
        r["path"]: r["reason"] for r in map(json.loads, (tmp_path / "out" / "report.jsonl").read_text().splitlines())
    }
    assert "values 0..255: float pixels must lie in 0..1" in reasons["0-255-float"]
    assert "give uint8 pixels" in reasons["uint16"]
    files = packer.pack(
        [{"image": tmp_path / n} for n in ("rgb.png", "rgba.png", "grey.png")], tmp_path / "files", format="raw"
    )
    assert files.count == 3
    ds = packer.ShardDataset(tmp_path / "out", crop_size=None)
    got = {ds.source(i): _record(tmp_path / "out", i) for i in range(len(ds))}
    wanted = [_record(tmp_path / "files", i) for i in range(3)]
    assert got["chw"] == got["hwc"] == got["unit-float"] == wanted[0] == rgb.tobytes()
    assert got["rgba"] == got["rgba-chw"] == wanted[1]
    assert got["grey"] == got["grey-chw"] == wanted[2] == np.repeat(grey[..., None], 3, axis=2).tobytes()
    assert got["3x3x3"] == np.arange(27, dtype=np.uint8).tobytes()


_INTERRUPTED = """
import sys
import time
import time
from pathlib import Path

import numpy as np

import packer


def samples(flag=None):
    for i in range(12):
        if i == 6 and flag is not None:
            Path(flag).write_text("6 given")  # the test's cue: interrupt now
            time.sleep(600)  # where Ctrl-C lands (the test's deadline ends it otherwise)
        yield {"image": np.full((40, 50, 3), i, np.uint8), "source": f"s{i}"}


if __name__ == "__main__":
    out, flag, workers, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    packer.pack(samples(flag), out, fields={}, force=True, resume=resume, checkpoint_seconds=0, workers=workers)
"""


@pytest.mark.parametrize("workers, resume", [(0, True), (2, False)])
def test_ctrl_c_of_a_pack_says_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, resume: bool
) -> None:
    """SIGINT in the middle of a real pack process (cued by a file its samples write, not a
    sleep): it ends with one line saying OUT is left as it was and whether resume=True continues,
    no traceback from inside the pack; the dataset on disk is unchanged, and with resume=True the
    same call continues the work kept."""
    import signal

    script = tmp_path / "interrupted_pack.py"
    script.write_text(_INTERRUPTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import interrupted_pack  # type: ignore[import-not-found]

    out, flag = tmp_path / "out", tmp_path / "flag"
    first = packer.pack([{"image": np.zeros((40, 50, 3), np.uint8), "source": "old"}], out, fields={}, workers=0)
    returncode, err = _interrupted_at_cue(
        [sys.executable, str(script), str(out), str(flag), str(workers), "1" if resume else "0"], flag
    )
    assert returncode == -signal.SIGINT
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"KeyboardInterrupt: {out} is left as it was; "), err
    assert "write_all" not in err and "sleep" not in err  # no frames from inside the pack
    assert Manifest.load(out).digest == first.digest
    staging = tmp_path / ".out.packer-tmp"
    if not resume:
        assert "nothing was kept" in last and "resume=True from its start" in last and not staging.exists()
        return
    assert f"the work so far is kept in {staging}: pack again with resume=True to continue" in last
    report = packer.pack(interrupted_pack.samples(), out, fields={}, force=True, resume=True, workers=0)
    assert (report.resumed_from, report.count) == (6, 12)


def _interrupted_at_cue(command: list[str], cue: Path) -> tuple[int, str]:
    """Run ``command``, SIGINT it once it writes ``cue`` (an event, not a delay), and return its exit
    status and stderr."""
    import signal

    child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not cue.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cue.exists(), f"the child never wrote its cue {cue}"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    return child.returncode, err


_CUED_CLI = """
import sys
import time
from pathlib import Path

from packer.builder import writer
from packer.cli import main

given = writer._each


def cued(samples):
    for k, sample in enumerate(given(samples)):
        if k == 2:
            Path(sys.argv[1]).write_text("2 given")  # the test's cue: interrupt now
            time.sleep(600)
        yield sample


writer._each = cued  # the samples --coco hands its Writer, with a cue after the second
main(sys.argv[2:], prog_name="packer")
"""


@pytest.mark.parametrize("resume", [False, True])
def test_ctrl_c_of_a_coco_build_says_whether_resume_continues_it(tmp_path: Path, resume: bool) -> None:
    """SIGINT in the middle of `packer build --coco` (a real process; cued by a file written as its
    third image is asked for): exit 130 and one line in the CLI's words, true of a --coco build:
    without --resume nothing was kept; with it, the same command with --resume continues."""

    images, listed = _coco_file(tmp_path, [f"{k}.png" for k in range(4)])
    script, flag, out = tmp_path / "cued.py", tmp_path / "flag", tmp_path / "out"
    script.write_text(_CUED_CLI)
    args = ["build", str(images), str(out), "--coco", str(listed), "--checkpoint-seconds", "0", "--workers", "0"]
    returncode, err = _interrupted_at_cue(
        [sys.executable, str(script), str(flag), *args, *(["--resume"] if resume else [])], flag
    )
    assert returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"packer: interrupted; nothing written to {out}; "), err
    assert not out.exists() and "=True" not in err
    if not resume:
        assert last.endswith(
            "nothing was kept (a build continues after an interruption only if it had --resume from its start)"
        )
        return
    assert last.endswith("build again with --resume to continue")
    run = _cli(*args, "--resume")
    assert run.returncode == 0 and "packed 4 of 4" in run.stderr, run.stderr
