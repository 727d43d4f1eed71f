"""Reading a dataset with fields: boxes and masks move with the crop, exactly.

Rectangles of known colours are drawn into real photos (tests/data), packed with their boxes and a
mask, and read back through a DataLoader with workers, with every crop policy: each returned box must
bound its rectangle's pixels in the returned crop within 1 px, and the mask must agree with them
pixel for pixel away from their edges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader

import packer
from packer import ShardDataset, ShardSampler
from packer.read.resolution import Steps

PHOTOS = Path(__file__).resolve().parents[1] / "data" / "exif-orientation"
COLOURS = np.array([(255, 0, 255), (0, 255, 255), (255, 255, 0), (0, 0, 255)], np.int16)
FIELDS = {"label": "label", "boxes": "boxes", "box_labels": "box_labels", "mask": "mask", "caption": "text"}


def _drawn(path: Path, k: int) -> dict:
    """A photo (upright; its channels kept within 70..185, so that no pixel of it is near a drawn
    colour) with up to four rectangles of COLOURS at seeded places, their boxes and mask."""
    im = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    pixels = (np.asarray(im, np.float32) * (115 / 255) + 70).astype(np.uint8)
    h, w = pixels.shape[:2]
    rng = np.random.default_rng(k)
    mask = np.zeros((h, w), np.uint8)
    boxes, labels = [], []
    for c in range(int(rng.integers(1, 5))):  # disjoint: one per quadrant
        qy, qx = divmod(c, 2)
        y0 = int(rng.integers(qy * h // 2, qy * h // 2 + h // 4))
        x0 = int(rng.integers(qx * w // 2, qx * w // 2 + w // 4))
        y1 = int(rng.integers(y0 + 40, (qy + 1) * h // 2))
        x1 = int(rng.integers(x0 + 40, (qx + 1) * w // 2))
        pixels[y0:y1, x0:x1] = COLOURS[c]
        mask[y0:y1, x0:x1] = c + 1
        boxes.append([x0, y0, x1, y1])
        labels.append(c + 1)
    return {
        "image": Image.fromarray(pixels),
        "label": k % 2,
        "boxes": boxes,
        "box_labels": labels,
        "mask": mask,
        "caption": f"{path.name} with {len(boxes)} rectangles",
        "source": path.name,
    }


@pytest.fixture(scope="module", params=["raw", "jpeg"])
def drawn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fields") / f"drawn-{request.param}"
    samples = [_drawn(p, k) for k, p in enumerate(sorted(PHOTOS.glob("*.jpg")))]
    report = packer.pack(samples, out, fields=FIELDS, format=request.param, backend="memmap")
    assert report.count == len(samples) == 18
    return out


def _colour_pixels(image: np.ndarray, c: int) -> np.ndarray:
    """Where the H x W x 3 ``image`` shows COLOURS[c] (every channel within 60 of it)."""
    return (np.abs(image.astype(np.int16) - COLOURS[c]) <= 60).all(axis=2)


def _eroded(a: np.ndarray) -> np.ndarray:
    """``a`` less its edge pixels (4-neighbourhood)."""
    out = a.copy()
    out[1:] &= a[:-1]
    out[:-1] &= a[1:]
    out[:, 1:] &= a[:, :-1]
    out[:, :-1] &= a[:, 1:]
    out[0], out[-1], out[:, 0], out[:, -1] = False, False, False, False
    return out


def _check(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, tol: float) -> int:
    """The geometry of one sample; the number of boxes checked."""
    hwc = image.permute(1, 2, 0).numpy()
    m = mask.numpy()
    assert m.shape == hwc.shape[:2] and boxes.shape == (len(labels), 4)
    h, w = m.shape
    assert (boxes >= 0).all() and (boxes[:, 0::2] <= w).all() and (boxes[:, 1::2] <= h).all()  # clipped to the crop
    for box, label in zip(boxes.numpy(), labels.tolist()):
        c = label - 1
        seen = _colour_pixels(hwc, c)
        ys, xs = np.nonzero(seen)
        x0, y0, x1, y1 = box
        if x1 - x0 < 3 or y1 - y0 < 3:  # a sliver: its pixels are blurred into the photo
            continue
        assert len(ys), f"box {box} of label {label}, but no pixel of its colour"
        got = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        assert np.abs(got - box).max() <= tol, f"label {label}: box {box}, its pixels span {got}"
        inside, coloured = _eroded(m == label), _eroded(seen)
        if tol > 1:  # JPEG: a pixel more for its chroma's bleeding
            inside, coloured = _eroded(inside), _eroded(coloured)
        assert seen[inside].all(), "mask pixels off their colour"
        assert (m[coloured] == label).all(), "coloured pixels off their mask"
    present = set(np.unique(m).tolist()) - {0}
    assert present <= set(labels.tolist()) | {lab for lab in present if (m == lab).sum() <= 12}
    return len(labels)


@pytest.mark.parametrize("crop", [112, Steps({0: 144, 1: 80})], ids=["fixed", "schedule"])
@pytest.mark.parametrize("train", [True, False])
def test_boxes_and_masks_follow_every_crop(drawn: Path, train: bool, crop: Any) -> None:
    """At a fixed side, and at each side of a resolution schedule (persistent workers: the side
    changes under them)."""
    tol = 1.0 if drawn.name.endswith("raw") else 1.5  # JPEG: 4:2:0 chroma bleeds half a pixel more
    ds = ShardDataset(drawn, crop_size=crop, train=train, dtype=torch.uint8, seed=3)
    sampler = ShardSampler(ds, repeats=3)  # every record drawn three times: three crops
    loader = DataLoader(ds, batch_size=6, sampler=sampler, num_workers=2, persistent_workers=True)
    checked = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        side = crop(epoch) if callable(crop) else crop
        for batch in loader:
            assert set(batch) == {"image", "label", "boxes", "box_labels", "mask", "caption", "id"}
            assert batch["image"].shape == (6, 3, side, side) and batch["mask"].shape == (6, side, side)
            assert batch["id"].dtype == torch.int64 and isinstance(batch["caption"][0], str)
            assert isinstance(batch["boxes"], list) and len(batch["boxes"]) == 6
            for k in range(6):
                checked += _check(batch["image"][k], batch["boxes"][k], batch["box_labels"][k], batch["mask"][k], tol)
                assert batch["caption"][k].startswith(ds.source(int(batch["id"][k])))
    assert checked > 100


def test_whole_images_keep_their_fields(drawn: Path) -> None:
    ds = ShardDataset(drawn, crop_size=None, dtype=torch.uint8)
    for i in range(len(ds)):
        s = ds[i]
        assert s["id"] == i and s["image"].shape[1:] == s["mask"].shape
        _check(s["image"], s["boxes"], s["box_labels"], s["mask"], 1.0 if drawn.name.endswith("raw") else 1.5)


def test_a_box_mostly_outside_the_crop_is_dropped(tmp_path: Path) -> None:
    """box_min_visible: a box with less than that share of its area in the crop goes, with its label."""
    img = np.full((320, 320, 3), 128, np.uint8)
    boxes = [[0, 0, 320, 320], [100, 100, 140, 140], [0, 150, 40, 170]]
    out = tmp_path / "d"
    packer.pack(
        [{"image": img, "boxes": boxes, "box_labels": [1, 2, 3]}],
        out,
        fields={"boxes": "boxes", "box_labels": "box_labels"},
    )
    # eval crop of 160 from 320: resize to 160/0.875 = 182 short edge, center crop = the middle 280 px
    kept = ShardDataset(out, crop_size=160, train=False, box_min_visible=0.0)[0]
    assert kept["box_labels"].tolist() == [1, 2, 3]
    side = 320 * 160 / 182.0  # the part of the stored image the crop covers (rounded to pixels)
    fraction_in = (40 - (320 - round(side)) / 2) / 40  # box 3's share inside, 0.5
    strict = ShardDataset(out, crop_size=160, train=False, box_min_visible=fraction_in + 0.05)[0]
    assert strict["box_labels"].tolist() == [1, 2] and strict["boxes"].shape == (2, 4)
    np.testing.assert_allclose(strict["boxes"][0].numpy(), [0, 0, 160, 160])


def test_a_dataset_without_fields_still_gives_tuples(built) -> None:
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=64)
    image, label = ds[0]
    assert isinstance(label, int) and image.shape == (3, 64, 64)


def test_a_hostile_field_table_is_a_clear_error(tmp_path: Path) -> None:
    """A record whose field table claims more bytes than it has (CRC forged to match): DatasetError
    naming the record, not a crash or a huge allocation."""
    import zlib

    out = tmp_path / "d"
    img = np.zeros((40, 40, 3), np.uint8)
    packer.pack(
        [{"image": img, "caption": "a"}, {"image": img, "caption": "b"}], out, fields={"caption": "text"}, format="raw"
    )
    index = np.load(out / "index.npy", allow_pickle=False)
    shard = bytearray((out / "shard-00000.bin").read_bytes())
    at = int(index[1]["offset"])
    shard[at + 8 : at + 16] = (2**63).to_bytes(8, "little")
    (out / "shard-00000.bin").write_bytes(bytes(shard))
    index[1]["crc32"] = zlib.crc32(bytes(shard[at : at + int(index[1]["length"])]))
    np.save(out / "index.npy", index)
    ds = ShardDataset(out, crop_size=16, verify=True)
    assert ds[0]["caption"] == "a"
    with pytest.raises(packer.DatasetError, match=r"record 1 \(source 'sample-1'\): field table says"):
        ds[1]


def test_preview_and_show_draw_the_fields(drawn: Path, tmp_path: Path) -> None:
    from packer.tools.preview import _PALETTE, contact_sheet, show

    assert contact_sheet(drawn, tmp_path / "grid.png", n=6, augment=True) == (3, 2)
    show(drawn, 0, tmp_path / "one.png")
    s = ShardDataset(drawn, crop_size=None, dtype=torch.uint8)[0]
    one = np.asarray(Image.open(tmp_path / "one.png").convert("RGB")).astype(np.int16)
    x0, y0, x1, y1 = (round(v) for v in s["boxes"][0].tolist())
    colour = _PALETTE[int(s["box_labels"][0]) % len(_PALETTE)].astype(np.int16)
    assert np.abs(one[y0, (x0 + x1) // 2] - colour).max() <= 12  # the outline (PNG: lossless)
    inside = one[(y0 + y1) // 2, (x0 + x1) // 2]
    assert np.abs(inside - (COLOURS[0] // 2 + _PALETTE[1] // 2)).max() <= 12  # the mask's tint over it


def test_padded_batches_on_request(drawn: Path) -> None:
    import functools

    from packer.read.dataset import collate_fields

    ds = ShardDataset(drawn, crop_size=64, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=6, collate_fn=functools.partial(collate_fields, padded=True), num_workers=2)
    batch = next(iter(loader))
    lengths = batch["boxes_lengths"]
    assert batch["boxes"].shape == (6, int(lengths.max()), 4) and batch["box_labels"].shape == (6, int(lengths.max()))
    listed = [ds[i] for i in range(6)]
    for k, s in enumerate(listed):
        n = int(lengths[k])
        assert n == len(s["boxes"]) and torch.equal(batch["boxes"][k, :n], s["boxes"])
        assert (batch["box_labels"][k, n:] == -1).all() and (batch["boxes"][k, n:] == 0).all()


def test_a_transform_receives_the_fields(drawn: Path) -> None:
    """On a dataset with fields, transform(image, fields) -> (image, fields), after the crop moved
    them: here a vertical flip of the user's own that moves boxes and mask too, checked as above."""

    def vflip(image: torch.Tensor, fields: dict) -> tuple[torch.Tensor, dict]:
        size = image.shape[1]
        boxes = fields["boxes"].clone()
        boxes[:, 1], boxes[:, 3] = size - fields["boxes"][:, 3], size - fields["boxes"][:, 1]
        return image.flip(1), {**fields, "boxes": boxes, "mask": fields["mask"].flip(0)}

    tol = 1.0 if drawn.name.endswith("raw") else 1.5
    ds = ShardDataset(drawn, crop_size=96, dtype=torch.uint8, transform=vflip)
    plain = ShardDataset(drawn, crop_size=96, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=6, num_workers=2)
    for n, batch in enumerate(loader):
        for k in range(6):
            _check(batch["image"][k], batch["boxes"][k], batch["box_labels"][k], batch["mask"][k], tol)
            same = plain[n * 6 + k]
            assert torch.equal(batch["image"][k], same["image"].flip(1))
    with pytest.raises(TypeError, match=r"called as transform\(image, fields\)"):
        ShardDataset(drawn, crop_size=96, dtype=torch.uint8, transform=lambda image, fields: image)[0]


def test_a_transform_that_changes_the_fields_keys_or_pairs_is_one_clear_error(drawn: Path) -> None:
    """A transform(image, fields) that drops or adds a key for some records, or returns boxes and box
    labels of different lengths, fails at that record naming it and the key (not a bare KeyError
    in collate, nor boxes served without their labels); one that keeps them collates."""

    def some(change):
        def transform(image: torch.Tensor, fields: dict) -> tuple[torch.Tensor, dict]:
            return image, change(dict(fields)) if int(fields["boxes"].shape[0]) > 1 else fields

        return transform

    def dropped(f: dict) -> dict:
        del f["mask"]
        return f

    def added(f: dict) -> dict:
        return {**f, "area": f["boxes"][:, 2] - f["boxes"][:, 0]}

    def unpaired(f: dict) -> dict:
        return {**f, "box_labels": f["box_labels"][:1]}

    cases = ((dropped, r"fields of record \d+ without 'mask'"), (added, r"fields of record \d+ with 'area', not given"))
    for change, message in (*cases, (unpaired, r"returned \d+ 'boxes' and 1 'box_labels' for record \d+")):
        loader = DataLoader(ShardDataset(drawn, crop_size=96, transform=some(change)), batch_size=6, num_workers=0)
        with pytest.raises(ValueError, match=message):
            for _ in loader:
                pass
    kept = ShardDataset(drawn, crop_size=96, transform=some(lambda f: {**f, "boxes": f["boxes"] * 0.5}))
    assert sum(len(batch["id"]) for batch in DataLoader(kept, batch_size=6, num_workers=0)) == 18


def test_a_mix_of_datasets_with_fields(drawn: Path, tmp_path: Path) -> None:
    """MixDataset: samples of members with the same fields, ids the mix's indices (mix.source(id));
    members with other fields are refused."""
    from packer import MixDataset

    a = ShardDataset(drawn, crop_size=64, dtype=torch.uint8)
    b = ShardDataset(drawn, crop_size=64, dtype=torch.uint8, seed=1)
    mix = MixDataset([a, b])
    batch = next(iter(DataLoader(mix, batch_size=36, num_workers=0)))
    assert batch["image"].shape == (36, 3, 64, 64) and batch["id"].tolist() == list(range(36))
    assert [mix.source(i).split(": ")[1] for i in (0, 18)] == [a.source(0), b.source(0)]
    assert batch["caption"][18] == batch["caption"][0] and len(batch["boxes"]) == 36
    img = np.zeros((64, 64, 3), np.uint8)
    packer.pack([{"image": img, "label": 0}, {"image": img, "label": 1}], tmp_path / "l", fields={"label": "label"})
    plain = ShardDataset(tmp_path / "l", crop_size=64, dtype=torch.uint8)  # classes "0", "1" as drawn's
    with pytest.raises(ValueError, match="MixDataset members differ in fields"):
        MixDataset([a, plain])


def test_masks_of_the_first_layout_read_as_run_lengths_do(tmp_path: Path) -> None:
    """A mask field declared with encoding "raw" is written as packer's first datasets with fields
    were (the pixels as they are, no "encoding" in its manifest entry): such datasets read, verify
    and batch as the run-length encoded ones do, which take a fraction of their bytes."""
    import json

    from packer.tools.verify import verify

    samples = [_drawn(p, k) for k, p in enumerate(sorted(PHOTOS.glob("*.jpg"))[:6])]
    paths = {}
    for encoding in ("raw", "rle"):
        paths[encoding] = tmp_path / encoding
        fields = {**FIELDS, "mask": {"kind": "mask", "encoding": encoding}}
        packer.pack(samples, paths[encoding], fields=fields, format="jpeg", backend="memmap")
        assert verify(paths[encoding]).ok
    manifest = json.loads((paths["raw"] / "manifest.json").read_text())
    assert next(f for f in manifest["fields"] if f["name"] == "mask") == {
        "name": "mask",
        "kind": "mask",
        "dtype": "|u1",
    }
    sizes = {e: int(np.load(p / "index.npy", allow_pickle=False)["length"].sum()) for e, p in paths.items()}
    assert sizes["rle"] < sizes["raw"] / 2
    old, new = (ShardDataset(paths[e], crop_size=96, dtype=torch.uint8, seed=5) for e in ("raw", "rle"))
    for a, b in zip(DataLoader(old, batch_size=3, num_workers=2), DataLoader(new, batch_size=3, num_workers=2)):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"]) and a["mask"].any()
        assert all(torch.equal(x, y) for x, y in zip(a["boxes"], b["boxes"]))
    whole = ShardDataset(paths["raw"], crop_size=None, dtype=torch.uint8)[1]["mask"]
    assert torch.equal(whole, ShardDataset(paths["rle"], crop_size=None, dtype=torch.uint8)[1]["mask"])


def test_a_batch_transform_receives_the_fields(drawn: Path) -> None:
    """On a dataset with fields, batch_transform(images, fields) -> (images, fields): fields is the
    batch's dict less its images; what it returns is the batch. Here a vertical flip of the whole
    batch moving boxes and masks, and the first sample's boxes dropped, checked as above."""
    seen: list[set] = []

    def vflip(images: torch.Tensor, fields: dict) -> tuple[torch.Tensor, dict]:
        seen.append(set(fields))
        size = images.shape[2]
        boxes = []
        for b in fields["boxes"]:
            b = b.clone()
            b[:, 1], b[:, 3] = size - b[:, 3], size - b[:, 1]
            boxes.append(b)
        boxes[0], labels = boxes[0][:0], [fields["box_labels"][0][:0], *fields["box_labels"][1:]]
        return images.flip(2), {**fields, "boxes": boxes, "box_labels": labels, "mask": fields["mask"].flip(1)}

    tol = 1.0 if drawn.name.endswith("raw") else 1.5
    ds = ShardDataset(drawn, crop_size=96, dtype=torch.uint8, batch_transform=vflip)
    plain = ShardDataset(drawn, crop_size=96, dtype=torch.uint8)
    batches = list(DataLoader(ds, batch_size=6, num_workers=2))
    assert len(batches) == 3
    for n, batch in enumerate(batches):
        assert batch["id"].tolist() == list(range(n * 6, n * 6 + 6)) and len(batch["boxes"][0]) == 0
        assert batch["label"].dtype == torch.int64 and isinstance(batch["caption"][0], str)
        for k in range(6):
            if k:  # the first: its mask keeps the objects whose boxes went
                _check(batch["image"][k], batch["boxes"][k], batch["box_labels"][k], batch["mask"][k], tol)
            assert torch.equal(batch["image"][k], plain[n * 6 + k]["image"].flip(1))
    sample = ds[4]  # one sample: a batch of one
    assert sample["id"] == 4 and isinstance(sample["label"], int) and len(sample["boxes"]) == 0
    assert seen[-1] == {"label", "boxes", "box_labels", "mask", "caption", "id"}
    missing = ShardDataset(drawn, crop_size=96, batch_transform=lambda images, fields: (images, {"id": fields["id"]}))
    with pytest.raises(ValueError, match=r"called as batch_transform\(images, fields\) and returns \(images, fields\)"):
        missing[0]


def test_a_workers_batch_arrives_whole_and_equal_by_value(drawn: Path) -> None:
    """Labels, ids, boxes and box labels cross from a DataLoader worker inside the pickled batch
    (packer.read.batchpool.inline), not in a shared-memory segment each: what arrives is plain
    lists of plain tensors, not in shared memory, equal to the same batches read in this process."""
    ds = ShardDataset(drawn, crop_size=112, train=True, dtype=torch.uint8, seed=5)
    here = list(DataLoader(ds, batch_size=6, num_workers=0))
    there = list(DataLoader(ds, batch_size=6, num_workers=2))
    assert len(here) == len(there) == 3
    for a, b in zip(here, there):
        assert set(a) == set(b)
        for key in ("label", "id"):
            assert type(b[key]) is torch.Tensor and not b[key].is_shared() and torch.equal(a[key], b[key])
        for key in ("boxes", "box_labels"):
            assert type(b[key]) is list and all(type(t) is torch.Tensor and not t.is_shared() for t in b[key])
            assert [t.dtype for t in b[key]] == [t.dtype for t in a[key]]
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key]))
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])


def test_array_values_a_field_cannot_hold_are_reported_skips_naming_the_field(tmp_path: Path) -> None:
    """Issue 40 item 6: int64 16777217 in a float32 field (16777216.0 once stored), float64 1e-50
    (0.0): each a reported skip naming the sample and the field; what a float32 holds is packed and
    read back as given."""
    import json

    img = np.zeros((40, 40, 3), np.uint8)
    samples = [
        {"image": img, "emb": np.array([1, 16777217], np.int64), "source": "big-int"},
        {"image": img, "emb": np.array([1.0, 1e-50]), "source": "tiny-float"},
        {"image": img, "emb": np.array([16777216, 3], np.int64), "source": "ok"},
    ]
    out = tmp_path / "d"
    report = packer.pack(samples, out, fields={"emb": ("array", "float32")}, workers=1)
    assert (report.count, report.skipped, report.scanned) == (1, 2, 3)
    reasons = {s["path"]: s["reason"] for s in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert "field 'emb'" in reasons["big-int"] and "16777217 would become 16777216.0" in reasons["big-int"]
    assert "field 'emb'" in reasons["tiny-float"] and "1e-50 would become 0.0" in reasons["tiny-float"]
    assert ShardDataset(out, crop_size=None)[0]["emb"].tolist() == [16777216.0, 3.0]


def test_a_big_endian_array_field_reads_in_every_worker(tmp_path: Path) -> None:
    """Issue 40 item 14: ``("array", ">f4")`` is declared and stored ``<f4``; a dataset on disk whose
    manifest declares ``>f4`` (what packer wrote for it before, as a list of manifest entries still
    writes) is read in native order: batches from DataLoader workers, verify and info all agree."""
    import json
    import subprocess
    import sys

    from packer.tools.verify import verify

    img = np.zeros((40, 40, 3), np.uint8)
    values = [np.array([1.5, -2.25, float(i)], ">f4") for i in range(4)]
    samples = [{"image": img, "emb": v} for v in values]
    declared = {
        "dict": {"emb": ("array", ">f4")},
        "manifest entries": [{"name": "emb", "kind": "array", "dtype": ">f4"}],
    }
    for how, fields in declared.items():
        out = tmp_path / how.replace(" ", "-")
        packer.pack(samples, out, fields=fields, workers=1)
        dtype = json.loads((out / "manifest.json").read_text())["fields"][0]["dtype"]
        assert dtype == ("<f4" if how == "dict" else ">f4")
        assert verify(out).ok
        batch = next(iter(DataLoader(ShardDataset(out, crop_size=16), batch_size=4, num_workers=2)))
        assert batch["emb"].dtype == torch.float32 and batch["emb"].tolist() == [v.tolist() for v in values]
        info = subprocess.run([sys.executable, "-m", "packer.cli", "info", str(out)], capture_output=True, text=True)
        assert info.returncode == 0 and f"field emb: array ({dtype})" in info.stdout, info.stderr


@pytest.mark.parametrize("name", ["skip", "source"])
def test_a_field_named_as_a_samples_own_key_is_refused(tmp_path: Path, name: str) -> None:
    """Issue 40 item 16: a ``skip`` text field turned every sample with a value into a skip; now
    such a name is refused where the fields are declared, in one line, before anything is packed."""
    img = np.zeros((40, 40, 3), np.uint8)
    with pytest.raises(packer.BuildError, match=f"field name '{name}' is reserved"):
        packer.pack([{"image": img, name: "x"}], tmp_path / "d", fields={name: "text"})
    assert not (tmp_path / "d").exists()
