"""Labels and targets as users have them: class folders, CSVs (BOM, CRLF, quotes), integer ids kept, a
fixed class list, unlabeled images, several labels per image, numeric targets, and format-1 datasets.

Every dataset is read back through a DataLoader with 2 workers (the batched collate path) and every
record's label and targets are compared with what the input said for its source file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from packer import BuildError, DatasetError, Labelling, ShardDataset, build
from packer.format import LABELS, MANIFEST, TARGETS, Manifest
from packer.format.label_arrays import pack, sample_weights, unpack
from packer.read.dataset import collate_samples
from packer.tools.preview import contact_sheet
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]
V1 = Path(__file__).resolve().parents[1] / "data" / "v1-memmap"


def make_raw(root: Path, rels: list[str]) -> Path:
    """A small JPEG at each path under ``root`` (distinct flat colours)."""
    for k, rel in enumerate(rels):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((24, 32, 3), (k * 37) % 256, np.uint8)).save(path, quality=90)
    return root


def write_csv(path: Path, header: str, rows: list[str]) -> Path:
    """The way spreadsheets save them: a UTF-8 BOM and CRLF line ends."""
    path.write_bytes(("\ufeff" + "\r\n".join([header, *rows]) + "\r\n").encode("utf-8"))
    return path


def read_back(out: Path) -> tuple[ShardDataset, list[list[Any]]]:
    """Every record's label fields (after the image), in record order, through 2 DataLoader workers."""
    ds = ShardDataset(out, crop_size=8, dtype=torch.uint8)
    fields: Optional[list[list[Any]]] = None
    for batch in DataLoader(ds, batch_size=4, num_workers=2):
        assert batch[0].shape[1:] == (3, 8, 8)
        rest = [b.tolist() for b in batch[1:]]
        fields = rest if fields is None else [f + r for f, r in zip(fields, rest)]
    assert fields is not None and all(len(f) == len(ds) for f in fields)
    return ds, fields


def cli(*args: Any) -> subprocess.CompletedProcess:
    return subprocess.run(PACKER + [str(a) for a in args], capture_output=True, text=True, timeout=120)


def report(out: Path) -> dict[str, dict[str, str]]:
    lines = (out / "report.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["path"]: r for r in map(json.loads, lines)}


# --- class ids ------------------------------------------------------------------------------------


def test_folders_keep_imagefolder_order_and_classes_pins_them(tmp_path: Path) -> None:
    rels = [f"{c}/{k}.jpg" for c in ("10", "2", "b", "a") for k in range(2)]
    raw = make_raw(tmp_path / "raw", rels)
    build(raw, tmp_path / "sorted", workers=1, quiet=True)
    ds, (labels,) = read_back(tmp_path / "sorted")
    assert ds.classes == ["10", "2", "a", "b"]  # sorted strings, as torchvision's ImageFolder
    assert labels == [ds.classes.index(ds.source(i).split("/")[0]) for i in range(len(ds))]

    (tmp_path / "classes.txt").write_text("b\n2\n\nunused\n10\na\n", encoding="utf-8")
    build(raw, tmp_path / "pinned", workers=1, quiet=True, labelling=Labelling(classes=str(tmp_path / "classes.txt")))
    ds, (labels,) = read_back(tmp_path / "pinned")
    assert ds.classes == ["b", "2", "unused", "10", "a"] and ds.class_counts().tolist() == [2, 2, 0, 2, 2]
    assert labels == [ds.classes.index(ds.source(i).split("/")[0]) for i in range(len(ds))]
    text = cli("info", tmp_path / "pinned").stdout
    assert "unused         0" in text


def test_csv_integer_labels_keep_their_value(tmp_path: Path) -> None:
    """Labels 0..17 as in the issue: the CSV's label 2 is id 2 (not 4, as sorted strings would give)."""
    rels = [f"img, {k:02d}.jpg" for k in range(18)]  # a comma in the name: the CSV quotes it
    raw = make_raw(tmp_path / "raw", rels)
    ids = {rel: (k * 7) % 18 for k, rel in enumerate(rels)}
    csv = write_csv(tmp_path / "labels.csv", "path,label", [f'"{rel}",{ids[rel]}' for rel in rels if ids[rel] != 5])
    build(raw, tmp_path / "out", labels=str(csv), workers=1, quiet=True)
    ds, (labels,) = read_back(tmp_path / "out")
    assert ds.classes == [str(i) for i in range(18)] and ds.class_counts()[5] == 0  # id 5: no image, kept
    assert len(ds) == 17 and labels == [ids[ds.source(i)] for i in range(len(ds))]
    unlisted = next(rel for rel in rels if ids[rel] == 5)
    assert report(tmp_path / "out") == {
        unlisted: {"path": unlisted, "status": "ignored", "reason": "not listed in the labels file"}
    }


def test_csv_string_labels_are_sorted_and_a_classes_file_maps_them(tmp_path: Path) -> None:
    rels = [f"x/{k}.jpg" for k in range(6)]
    raw = make_raw(tmp_path / "raw", rels)
    names = ["dog", "cat", "007", "dog", "cat", "emu"]  # "007" is a name: not every label is an integer
    csv = write_csv(tmp_path / "l.csv", "label,path", [f"{n},{r}" for n, r in zip(names, rels)])
    build(raw, tmp_path / "a", labels=str(csv), workers=1, quiet=True)
    ds, (labels,) = read_back(tmp_path / "a")
    assert ds.classes == ["007", "cat", "dog", "emu"]
    assert [ds.classes[y] for y in labels] == names
    classes = tmp_path / "c.txt"
    classes.write_bytes("\ufeffemu\r\ndog\r\ncat\r\n007\r\n".encode("utf-8"))
    build(raw, tmp_path / "b", labels=str(csv), workers=1, quiet=True, labelling=Labelling(classes=str(classes)))
    ds, (labels,) = read_back(tmp_path / "b")
    assert ds.classes == ["emu", "dog", "cat", "007"] and [ds.classes[y] for y in labels] == names


def test_label_not_in_classes_is_a_reported_skip_or_with_fail_an_error(tmp_path: Path) -> None:
    raw = make_raw(tmp_path / "raw", ["a/0.jpg", "a/1.jpg", "zebra/2.jpg"])
    classes = tmp_path / "c.txt"
    classes.write_text("a\nb\n", encoding="utf-8")
    got = build(raw, tmp_path / "out", workers=1, quiet=True, labelling=Labelling(classes=str(classes)))
    assert (got.count, got.skipped, got.scanned) == (2, 1, 3)
    assert report(tmp_path / "out")["zebra/2.jpg"]["reason"] == f"class folder 'zebra' is not in --classes {classes}"
    assert Manifest.load(tmp_path / "out").class_counts == [2, 0]
    run = cli("build", raw, tmp_path / "fail", "--classes", classes, "--on-error", "fail")
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "class folder 'zebra' is not in --classes" in run.stderr and not (tmp_path / "fail").exists()


# --- unlabeled ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [["0.jpg", "1.jpg", "2.jpg"], ["0.jpg", "a/1.jpg", "b/c/2.jpg"]])
def test_unlabeled_flat_folder_or_folders_whose_names_are_ignored(tmp_path: Path, layout: list[str]) -> None:
    raw = make_raw(tmp_path / "raw", layout)
    refused = cli("build", raw, tmp_path / "refused")
    if "/" not in "".join(layout):
        assert refused.returncode == 1 and "--unlabeled" in refused.stderr
    run = cli("build", raw, tmp_path / "out", "--unlabeled", "--quiet")
    assert run.returncode == 0, run.stderr
    ds, (labels,) = read_back(tmp_path / "out")
    assert ds.label_kind == "none" and ds.classes == [] and labels == [-1, -1, -1]
    assert sorted(ds.source(i) for i in range(3)) == sorted(layout)
    assert ds.sample_weights().tolist() == [1.0, 1.0, 1.0] and ds.class_counts().tolist() == []
    assert "(unlabeled)" in cli("info", tmp_path / "out").stdout and verify(tmp_path / "out").ok


# --- multi-label and targets ----------------------------------------------------------------------


def test_multi_label_csv_gives_multi_hot_vectors(tmp_path: Path) -> None:
    rels = [f"p/{k}.jpg" for k in range(7)]
    raw = make_raw(tmp_path / "raw", rels)
    sets = [["cat", "dog"], ["dog"], [], ["bird", "cat"], ["cat"], ["dog", "cat"], []]
    rows = [f'{r},"{"; ".join(s)}"' for r, s in zip(rels, sets)]  # quoted, with spaces after ';'
    csv = write_csv(tmp_path / "l.csv", "path , label", rows)  # a header with stray spaces
    run = cli("build", raw, tmp_path / "out", "--labels", csv, "--multi-label", "--quiet")
    assert run.returncode == 0, run.stderr
    ds, (hot,) = read_back(tmp_path / "out")
    assert ds.label_kind == "multi" and ds.classes == ["bird", "cat", "dog"]
    want = [[float(c in sets[rels.index(ds.source(i))]) for c in ds.classes] for i in range(len(ds))]
    assert hot == want and (ds.multi_hot() == np.array(want)).all()
    assert isinstance(ds[0][1], torch.Tensor) and ds[0][1].dtype == torch.float32
    assert ds.class_counts().tolist() == [1, 4, 3] and (ds.labels == -1).all()
    # inverse of the mean count of an image's labels; the 2 images without labels share weight 1
    counts = {"bird": 1, "cat": 4, "dog": 3}
    expected = [len(s) / sum(counts[c] for c in s) if s else 0.5 for s in sets]
    assert np.allclose(ds.sample_weights(), [expected[rels.index(ds.source(i))] for i in range(len(ds))])
    facts = json.loads(cli("info", tmp_path / "out", "--json").stdout)
    assert facts["class_counts"] == counts and facts["records_without_labels"] == 2
    assert "per label" in cli("info", tmp_path / "out").stdout
    assert contact_sheet(tmp_path / "out", tmp_path / "sheet.png", n=4) == (2, 2)  # captions: 'cat;dog'
    assert [ds.source(i) for i in range(7)] == rels  # sorted walk order
    assert [ds.label_name(i) for i in (0, 2, 3)] == ["cat;dog", "(none)", "bird;cat"]


@pytest.mark.parametrize("unlabeled", [False, True])
def test_targets_are_float32_rows(tmp_path: Path, unlabeled: bool) -> None:
    rels = [f"t/{k}.jpg" for k in range(9)]
    raw = make_raw(tmp_path / "raw", rels)
    values = {rel: (k * 0.1 - 0.35, 1e3 * k, -k) for k, rel in enumerate(rels)}
    rows = [
        f'{rel},{"c" if k % 3 else "a"}," {v[0]!r} ",{v[1]:e},{v[2]},note' for k, (rel, v) in enumerate(values.items())
    ]
    csv = write_csv(tmp_path / "l.csv", "path,label,x,y,z,comment", rows)
    args = ["--unlabeled"] if unlabeled else []
    run = cli("build", raw, tmp_path / "out", "--labels", csv, "--targets", "z,x,y", *args)
    assert run.returncode == 0, run.stderr
    assert "'comment'" in run.stderr and "not used" in run.stderr
    ds, fields = read_back(tmp_path / "out")
    want = [[np.float32(values[ds.source(i)][j]) for j in (2, 0, 1)] for i in range(len(ds))]
    assert ds.target_names == ["z", "x", "y"] and ds.targets.dtype == np.float32
    assert np.array_equal(ds.targets, np.array(want, np.float32))
    if unlabeled:  # the targets take the label's place
        assert len(fields) == 1 and np.array_equal(np.array(fields[0], np.float32), want)
        assert "'label'" in run.stderr  # the label column is not used either
    else:
        labels, targets = fields
        assert ds.classes == ["a", "c"] and len(ds[0]) == 3
        assert labels == [0 if rels.index(ds.source(i)) % 3 == 0 else 1 for i in range(len(ds))]
        assert np.array_equal(np.array(targets, np.float32), want)
    text = cli("info", tmp_path / "out").stdout
    assert "target y: min 0, mean 4000, max 8000" in text
    samples = ds.__getitems__([3, 1, 2])  # the collate fast path: the images' one batch tensor, passed on
    batch = collate_samples(samples)
    assert batch[0].data_ptr() == samples[0].image.data_ptr() and batch[-1].shape == (3, 3)
    assert np.array_equal(batch[-1].numpy(), ds.targets[[3, 1, 2]])


def test_multi_label_with_targets_and_a_split_share_one_mapping(tmp_path: Path) -> None:
    rels = [f"s/{k:02d}.jpg" for k in range(16)]
    raw = make_raw(tmp_path / "raw", rels)
    sets = {rel: ["a", "b", "c"][: k % 4] for k, rel in enumerate(rels)}
    csv = write_csv(
        tmp_path / "l.csv", "path,label,w", [f"{r},{';'.join(s)},{k}" for k, (r, s) in enumerate(sets.items())]
    )
    classes = tmp_path / "c.txt"
    classes.write_text("c\nb\na\nd\n", encoding="utf-8")
    labelling = Labelling(classes=str(classes), multi_label=True, targets=("w",))
    build(raw, tmp_path / "out", labels=str(csv), labelling=labelling, split={"val": 0.3}, workers=1, quiet=True)
    seen = 0
    for part in ("train", "val"):
        ds, (hot, w) = read_back(tmp_path / "out" / part)
        assert ds.classes == ["c", "b", "a", "d"]
        for i in range(len(ds)):
            rel = ds.source(i)
            assert hot[i] == [float(c in sets[rel]) for c in ds.classes] and w[i] == [float(rels.index(rel))]
        seen += len(ds)
    assert seen == 16


# --- --update and --resume follow the labelling ---------------------------------------------------


def test_update_rewrites_labels_and_targets_and_reuses_records(tmp_path: Path) -> None:
    rels = [f"u/{k}.jpg" for k in range(5)]
    raw = make_raw(tmp_path / "raw", rels)
    csv = tmp_path / "l.csv"
    write_csv(csv, "path,label,v", [f"{r},a,{k}" for k, r in enumerate(rels)])
    kw: dict[str, Any] = {
        "labels": str(csv),
        "labelling": Labelling(targets=("v",)),
        "workers": 1,
        "quiet": True,
        "update": True,
    }
    first = build(raw, tmp_path / "out", **kw)
    assert build(raw, tmp_path / "out", **kw).up_to_date
    write_csv(csv, "path,label,v", [f"{r},a,{k * 2}" for k, r in enumerate(rels)])  # targets changed
    second = build(raw, tmp_path / "out", **kw)
    assert not second.up_to_date and second.reused == 5 and second.digest != first.digest
    assert ShardDataset(tmp_path / "out").targets[:, 0].tolist() == [0, 2, 4, 6, 8]
    third = build(raw, tmp_path / "out", **(kw | {"labelling": Labelling()}))  # targets dropped
    assert not third.up_to_date and third.reused == 5 and ShardDataset(tmp_path / "out").targets is None
    assert not (tmp_path / "out" / TARGETS).exists()


def test_a_damaged_journal_is_refused_in_the_callers_words(tmp_path: Path) -> None:
    """A resume whose journal cannot be read fails in one line naming the option as the caller
    wrote it: ``resume=True`` from Python, ``--resume`` on the command line."""
    raw = make_raw(tmp_path / "raw", ["a/0.jpg", "b/1.jpg"])
    (raw / "b" / "1.jpg").write_bytes(b"not a jpeg")
    kw: dict[str, Any] = {"workers": 1, "quiet": True, "on_error": "fail", "checkpoint_seconds": 0}
    with pytest.raises(BuildError, match="on-error fail"):
        build(raw, tmp_path / "out", **kw)
    (tmp_path / ".out.packer-tmp" / "progress.json").write_text("{torn")
    with pytest.raises(BuildError) as python:
        build(raw, tmp_path / "out", resume=True, **kw)
    assert re.fullmatch(
        r"cannot resume=True: the journal in \S+ is damaged \(.+\); build again without resume=True", str(python.value)
    )
    run = cli("build", raw, tmp_path / "out", "--resume", "--workers", "1", "--quiet", "--on-error", "fail")
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "cannot --resume: the journal" in run.stderr and run.stderr.rstrip().endswith("without --resume"), run.stderr
    assert not (tmp_path / "out").exists()  # nothing touched: no half-written dataset


def test_resume_refuses_a_changed_labelling(tmp_path: Path) -> None:
    """A build stopped by --on-error fail resumes with the same labelling only."""
    raw = make_raw(tmp_path / "raw", ["a/0.jpg", "b/1.jpg"])
    (raw / "b" / "1.jpg").write_bytes(b"not a jpeg")
    kw: dict[str, Any] = {"workers": 1, "quiet": True, "on_error": "fail", "checkpoint_seconds": 0}
    with pytest.raises(BuildError, match="on-error fail"):
        build(raw, tmp_path / "out", **kw)
    assert (tmp_path / ".out.packer-tmp").is_dir()
    with pytest.raises(BuildError, match="cannot resume=True: the input or the options changed"):
        build(raw, tmp_path / "out", resume=True, labelling=Labelling(unlabeled=True), **kw)
    make_raw(tmp_path / "raw", ["b/1.jpg"])  # fixed in place
    got = build(raw, tmp_path / "out", resume=True, **kw)
    assert got.count == 2 and got.resumed_from == 1 and ShardDataset(tmp_path / "out").labels.tolist() == [0, 1]


# --- errors name the CSV row ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "header,rows,args,message",
    [
        (
            "path,label",
            "r/1.jpg,a|r/0.jpg,zebra",
            ["--classes", "CLASSES", "--on-error", "fail"],
            "labels.csv:3: label 'zebra' is not in --classes",
        ),
        (
            "path,label,age",
            "r/1.jpg,a,1|r/0.jpg,a,12x",
            ["--targets", "age"],
            "labels.csv:3: column 'age': '12x' is not a finite number",
        ),
        (
            "path,label,age",
            "r/1.jpg,a,1|r/0.jpg,a,nan",
            ["--targets", "age"],
            "labels.csv:3: column 'age': 'nan' is not",
        ),
        (
            "path,label,age",
            "r/1.jpg,a,1|r/0.jpg,a,1e39",
            ["--targets", "age"],
            "labels.csv:3: column 'age': '1e39' is not",
        ),
        ("path,label,age", "r/1.jpg,a,1|r/0.jpg,a,", ["--targets", "age"], "labels.csv:3: column 'age': '' is not"),
        ("path,label", "r/1.jpg,a|r/0.jpg,a", ["--targets", "age"], "labels.csv:1: no column 'age' in the header"),
        ("path,kind", "r/1.jpg,a|r/0.jpg,a", [], "labels.csv:1: no column 'label' in the header"),
        ("r/1.jpg,a", "r/0.jpg,a", [], "labels.csv:1: no column 'path' in the header"),
        ("path,label", "r/1.jpg,a|r/0.jpg,a;;b", ["--multi-label"], "labels.csv:3: empty label between ';'"),
        ("path,label", "r/1.jpg,a|r/0.jpg,a,extra", [], "labels.csv:3: 3 fields, the header has 2"),
        ("path,label", "r/1.jpg,1|r/0.jpg,9999999", [], "labels.csv:3: integer label 9999999 is above"),
        ("path,label", "r/1.jpg,1|r/1.jpg,2", [], "labels.csv:3: duplicate path 'r/1.jpg'"),
    ],
)
def test_csv_problems_are_one_line_naming_the_row(
    tmp_path: Path, header: str, rows: str, args: list[str], message: str
) -> None:
    raw = make_raw(tmp_path / "raw", ["r/0.jpg", "r/1.jpg"])
    (tmp_path / "classes.txt").write_text("a\n", encoding="utf-8")
    csv = write_csv(tmp_path / "labels.csv", header, rows.split("|"))
    args = [str(tmp_path / "classes.txt") if a == "CLASSES" else a for a in args]
    run = cli("build", raw, tmp_path / "out", "--labels", csv, *args)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and message in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_csv_label_is_skipped_and_reported_by_default(tmp_path: Path) -> None:
    raw = make_raw(tmp_path / "raw", ["r/0.jpg", "r/1.jpg"])
    (tmp_path / "classes.txt").write_text("a\n", encoding="utf-8")
    csv = write_csv(tmp_path / "labels.csv", "path,label", ["r/0.jpg,a", "r/1.jpg,zebra"])
    got = build(
        raw,
        tmp_path / "out",
        labels=str(csv),
        workers=1,
        quiet=True,
        labelling=Labelling(classes=str(tmp_path / "classes.txt")),
    )
    assert (got.count, got.skipped) == (1, 1)
    reason = report(tmp_path / "out")["r/1.jpg"]["reason"]
    assert reason == f"label 'zebra' is not in --classes {tmp_path / 'classes.txt'} ({csv}:3)"


@pytest.mark.parametrize(
    "labelling,message",
    [
        (Labelling(multi_label=True), "--multi-label needs --labels"),
        (Labelling(targets=("x",)), "--targets needs --labels"),
        (Labelling(unlabeled=True, multi_label=True), "cannot be combined"),
        (Labelling(targets=("path",)), "cannot name the 'path' column"),
    ],
)
def test_meaningless_option_combinations_are_refused(tmp_path: Path, labelling: Labelling, message: str) -> None:
    raw = make_raw(tmp_path / "raw", ["r/0.jpg"])
    with pytest.raises(BuildError, match=message):
        build(raw, tmp_path / "out", labelling=labelling, workers=1, quiet=True)


# --- on disk: format 1 still opens, damaged label arrays are refused ------------------------------


V1_IMAGES = [("cat/0.png", 40, 24), ("cat/1.png", 24, 32), ("dog/2.png", 32, 32)]  # rel, w, h


def v1_pixels(k: int, w: int, h: int) -> np.ndarray:
    """The pixels of image k of tests/data/v1-memmap (see its README.md)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 6 % 256, y * 8 % 256, (x + y + k * 50) % 256], -1).astype(np.uint8)


def test_format_1_dataset_still_opens(tmp_path: Path) -> None:
    m = Manifest.load(V1)
    assert m.format_version == 1 and m.label_kind == "class" and m.targets == []
    ds = ShardDataset(V1, crop_size=None, dtype=torch.uint8)
    assert ds.classes == ["cat", "dog"] and ds.labels.tolist() == [0, 0, 1] and ds.targets is None
    for k, (_, w, h) in enumerate(V1_IMAGES):
        image, label = ds[k]
        assert label == [0, 0, 1][k] and np.array_equal(image.permute(1, 2, 0).numpy(), v1_pixels(k, w, h))
    _, (labels,) = read_back(V1)
    assert labels == [0, 0, 1]
    assert verify(V1).ok and json.loads(cli("info", V1, "--json").stdout)["label_kind"] == "class"

    # --update writes it as version 3, keeping its records (sources recreated with the same size and mtime)
    raw, out = tmp_path / "raw", shutil.copytree(V1, tmp_path / "v1")
    index = np.load(V1 / "index.npy")
    same = 0
    for k, (rel, w, h) in enumerate(V1_IMAGES):
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(v1_pixels(k, w, h)).save(raw / rel)
        os.utime(raw / rel, ns=(int(index[k]["src_mtime_ns"]),) * 2)
        same += (raw / rel).stat().st_size == int(index[k]["src_size"])
    (raw / "notes.txt").write_text("x")
    got = build(raw, out, backend="memmap", format="raw", update=True, workers=1, quiet=True)
    assert got.reused == same  # all 3 unless this Pillow's PNG encoder writes other bytes
    full = build(raw, tmp_path / "full", backend="memmap", format="raw", workers=1, quiet=True)
    assert got.digest == full.digest and Manifest.load(out).format_version == 3 and verify(out).ok


def test_damaged_label_arrays_are_refused(tmp_path: Path) -> None:
    rels = [f"d/{k}.jpg" for k in range(4)]
    raw = make_raw(tmp_path / "raw", rels)
    csv = write_csv(tmp_path / "l.csv", "path,label,v", [f"{r},a;b;c,{k}" for k, r in enumerate(rels)])
    good = tmp_path / "good"
    build(raw, good, labels=str(csv), labelling=Labelling(multi_label=True, targets=("v",)), workers=1, quiet=True)

    def damaged(name: str, change) -> Path:
        root = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(good, root)
        a = np.load(root / name)
        a = change(a)
        np.save(root / name, a, allow_pickle=False)
        return root

    cases = [
        (damaged(LABELS, lambda a: a[:3]), "unexpected dtype uint8 / shape (3, 1)"),
        (damaged(LABELS, lambda a: a.astype(np.int16)), "unexpected dtype int16"),
        (damaged(LABELS, lambda a: a | 0x80), "bits set beyond the last of 3 classes"),
        (damaged(TARGETS, lambda a: np.where(a == 2, np.inf, a).astype(np.float32)), "record 2 has a target"),
        (damaged(TARGETS, lambda a: a.astype(np.float64)), "unexpected dtype float64"),
    ]
    for root, message in cases:
        with pytest.raises(DatasetError, match=re.escape(message)):
            ShardDataset(root)
        run = cli("verify", root)
        assert run.returncode == 1 and message.split()[0] in run.stderr and "Traceback" not in run.stderr
    edited = damaged(TARGETS, lambda a: a + 1)  # still valid: only the digests can tell
    problems = verify(edited).problems
    assert any("labels_digest" in p for p in problems) and any("dataset digest" in p for p in problems)
    (edited / TARGETS).unlink()
    with pytest.raises(DatasetError, match=r"targets\.npy: missing"):
        ShardDataset(edited)
    data = json.loads((good / MANIFEST).read_text())
    assert data["format_version"] == 3 and data["label_kind"] == "multi" and data["targets"] == ["v"]


def test_pack_unpack_and_weights_roundtrip() -> None:
    sets = [[0, 9], [], [3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    packed = pack(sets, 10)
    assert packed.shape == (4, 2) and packed.dtype == np.uint8
    hot = unpack(packed, 10)
    assert [np.flatnonzero(r).tolist() for r in hot] == sets
    w = sample_weights("multi", np.full(4, -1), packed, 10)
    assert w[1] == 1.0 and np.isclose(w[2], 1 / 2) and np.isclose(w[0], 2 / 4)
