"""ShardDataset through real DataLoaders (fork and spawn workers) on datasets built from the real photos."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

from packer import DatasetError, codec, transform
from packer.dataset import ShardDataset
from packer.format import lmdb_key
from packer.transform import DRAWS, IMAGENET_MEAN, IMAGENET_STD, random_resized_crops, to_device, uniforms

from .conftest import COMBOS

CROP = 64
#: The resize kernels this install has (packer's own needs packer._native built).
BACKENDS = ("torch", "pillow") + (("packer",) if transform._native is not None else ())
Batch = tuple[torch.Tensor, torch.Tensor]


def load(ds: ShardDataset, workers: int = 0, ctx: Optional[str] = None, **kw: Any) -> list[Batch]:
    """Every batch of one pass, in order (no shuffle: worker-count independence is about the fetch)."""
    loader = DataLoader(ds, batch_size=4, num_workers=workers, multiprocessing_context=ctx if workers else None, **kw)
    return list(loader)


def same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_batches_shapes_ranges_labels(built, backend: str, fmt: str) -> None:
    ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=1)
    batches = load(ds)
    assert sum(len(b[1]) for b in batches) == len(ds) == 18
    lo = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    hi = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    for images, labels in batches:
        assert images.shape[1:] == (3, CROP, CROP) and images.dtype == torch.float32
        assert lo - 1e-5 <= images.min() and images.max() <= hi + 1e-5
        assert labels.dtype == torch.int64
    label_ids = torch.cat([b[1] for b in batches]).numpy()
    assert (label_ids == ds.labels).all()
    assert ds.classes == ["landscape", "portrait"]
    assert [ds.classes[y] for y in label_ids] == [ds.source(i).split("/")[0] for i in range(len(ds))]

    u8 = load(ShardDataset(ds.root, crop_size=CROP, seed=1, dtype=torch.uint8))
    assert all(b[0].dtype == torch.uint8 and b[0].shape[1:] == (3, CROP, CROP) for b in u8)
    assert u8[0][0].float().std() > 10  # real picture content, not a constant fill
    # The float path is the uint8 path normalized; to_device does the same arithmetic.
    assert torch.equal(to_device(u8[0][0], "cpu"), batches[0][0])

    whole = ShardDataset(ds.root, crop_size=None, dtype=torch.uint8)
    img = whole[0].image
    row = whole.index[0]
    assert img.shape == (3, row["height"], row["width"]) and min(img.shape[1:]) == 320
    with pytest.MonkeyPatch.context() as m:  # packer's binding decodes as PyTurboJPEG does, pixel for pixel
        m.setattr(codec, "_native", None)
        assert torch.equal(whole[0][0], img)

    ev = ShardDataset(ds.root, crop_size=CROP, train=False)
    e0 = ev[5][0]
    ev.set_epoch(3)
    assert e0.shape == (3, CROP, CROP) and torch.equal(e0, ev[5][0])  # eval crops ignore the epoch


@pytest.mark.parametrize("backend,fmt", COMBOS)
def test_fork_workers_match_in_process_and_epochs_differ(built, backend: str, fmt: str) -> None:
    ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=7, dtype=torch.uint8)
    ds[0]  # the notebook pattern: the parent opens its handles before the workers fork
    base = load(ds)
    assert same(base, load(ds, workers=2, ctx="fork"))
    ds.set_epoch(1)
    other = load(ds, workers=2, ctx="fork")
    assert not any(torch.equal(x[0], y[0]) for x, y in zip(base, other))
    assert same(other, load(ds))
    assert not same(load(ShardDataset(ds.root, crop_size=CROP, seed=8, dtype=torch.uint8)), load(ds))


def test_spawn_persistent_workers_follow_set_epoch(built) -> None:
    """set_epoch after persistent workers started still changes their crops (shared-memory epoch)."""
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=CROP, seed=3)
    ds[1]
    expected = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        expected.append(load(ds))
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        assert same(list(loader), expected[epoch])


def test_random_streams_are_per_sample() -> None:
    """Each (seed, epoch, index) has its own draws, whatever else is in the batch."""
    seeds, epochs, indices = (0, 1, 2**63), (0, 1, 2**32 - 1), np.arange(200)
    draws = np.concatenate([uniforms(s, e, indices, 2) for s in seeds for e in epochs])
    assert len({tuple(d) for d in draws}) == len(draws) and (draws >= 0).all() and (draws < 1).all()
    batch = uniforms(5, 2, np.array([9, 4, 9]), 6)
    assert np.array_equal(batch[0], batch[2]) and np.array_equal(batch[0], uniforms(5, 2, np.array([9]), 6)[0])
    big = uniforms(0, 0, np.arange(20_000), 2)  # roughly uniform: decile counts within 10%
    counts = np.histogram(big, bins=10, range=(0, 1))[0]
    assert counts.min() > 0.9 * counts.mean()


def reference_crop(u: np.ndarray, height: int, width: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, one image at a time, fed the same draws."""
    import math

    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for k in range(0, 40, 4):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[k])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[k + 1])
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(u[k + 2] * (height - h + 1)), int(u[k + 3] * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def test_batched_crops_match_torchvision_semantics() -> None:
    """The vectorized RandomResizedCrop equals the per-image reference, fallback branch included
    (scales that never fit, and very wide or tall images)."""
    rng = np.random.default_rng(0)
    heights = np.concatenate([rng.integers(1, 700, 500), [320, 10, 3000, 5]])
    widths = np.concatenate([rng.integers(1, 700, 500), [427, 3000, 10, 5]])
    u = uniforms(3, 1, np.arange(len(heights)), DRAWS)
    for scale in ((0.08, 1.0), (1.5, 2.0), (0.5, 0.5)):
        got = random_resized_crops(u, heights, widths, scale)
        want = [reference_crop(u[k], int(heights[k]), int(widths[k]), scale) for k in range(len(u))]
        assert got.tolist() == [list(w) for w in want]
    boxes = random_resized_crops(u, heights, widths)
    assert ((boxes[:, 0] >= 0) & (boxes[:, 0] + boxes[:, 2] <= heights)).all()
    assert ((boxes[:, 1] >= 0) & (boxes[:, 1] + boxes[:, 3] <= widths)).all()


@pytest.mark.parametrize("fmt", ["jpeg", "raw"])
def test_memory_formats_and_resize_backends_agree(built, fmt: str, monkeypatch) -> None:
    """channels-last (default) and contiguous batches hold the same values; torch's, Pillow's and
    packer's antialiased bilinear resizes agree to within rounding away from the crop's border, and
    packer's with Pillow's everywhere (same filter; each backend is used whole per process)."""
    path = built("lmdb", fmt)
    results = {}
    for backend in BACKENDS:
        monkeypatch.setenv("PACKER_RESIZE", backend)
        transform.resize_backend.cache_clear()
        try:
            for memory_format in (torch.channels_last, torch.contiguous_format):
                for dtype in (torch.uint8, torch.float32):
                    ds = ShardDataset(path, crop_size=CROP, seed=6, dtype=dtype, memory_format=memory_format)
                    images = load(ds)[0][0]
                    assert images.is_contiguous(memory_format=memory_format)
                    results[backend, memory_format, dtype] = images
        finally:
            monkeypatch.delenv("PACKER_RESIZE")
            transform.resize_backend.cache_clear()
    for backend in BACKENDS:
        u8, f32 = (
            results[backend, torch.channels_last, torch.uint8],
            results[backend, torch.channels_last, torch.float32],
        )
        assert torch.equal(u8, results[backend, torch.contiguous_format, torch.uint8])
        assert torch.equal(f32, results[backend, torch.contiguous_format, torch.float32])
        assert torch.allclose(to_device(u8, "cpu"), f32, atol=1e-6)
    diff = (
        results["torch", torch.channels_last, torch.uint8].int()
        - results["pillow", torch.channels_last, torch.uint8].int()
    ).abs()
    # Pillow's box resize reads source pixels just outside the box; torch stops at its edge
    assert diff.float().mean() < 0.5 and diff[..., 2:-2, 2:-2].max() <= 3
    if "packer" in BACKENDS:  # torch's kernel ports Pillow's filter, as packer's does; both stop at the box
        ours = results["packer", torch.channels_last, torch.uint8].int()
        diff = (ours - results["torch", torch.channels_last, torch.uint8].int()).abs()
        assert diff.float().mean() < 0.25 and diff.max() <= 2


def test_pickle_round_trip_before_and_after_use(built) -> None:
    for backend, fmt in (("lmdb", "jpeg"), ("memmap", "raw")):
        ds = ShardDataset(built(backend, fmt), crop_size=CROP, seed=2)
        ds.set_epoch(4)
        fresh = pickle.loads(pickle.dumps(ds))
        first = ds[3]
        used = pickle.loads(pickle.dumps(ds))
        for copy in (fresh, used):
            assert copy.epoch == 4 and torch.equal(copy[3][0], first[0]) and copy[3][1] == first[1]


def test_two_datasets_over_one_path(built) -> None:
    """Train and eval views of one LMDB in one process, and both again inside forked workers."""
    path = built("lmdb", "raw")
    train = ShardDataset(path, crop_size=CROP, dtype=torch.uint8)
    evaluation = ShardDataset(path, crop_size=CROP, train=False, dtype=torch.uint8)
    a, b = train[2], evaluation[2]
    assert a[1] == b[1] and not torch.equal(a[0], b[0])
    assert same(load(train, workers=2, ctx="fork"), load(train))
    assert same(load(evaluation, workers=2, ctx="fork"), load(evaluation))


def test_samplers(built) -> None:
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=CROP, dtype=torch.uint8)
    counts = ds.class_counts()
    assert counts.tolist() == [9, 9] and counts.sum() == len(ds)
    weights = ds.sample_weights()
    assert np.allclose(np.bincount(ds.labels, weights), 1.0)
    sampler = WeightedRandomSampler(weights.tolist(), num_samples=8, generator=torch.Generator().manual_seed(0))
    images, labels = next(iter(DataLoader(ds, batch_size=8, sampler=sampler)))
    assert images.shape == (8, 3, CROP, CROP) and labels.shape == (8,)


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_jpeg_record_names_dataset_record_and_source(built, tmp_path: Path) -> None:
    path = copy_dataset(built("memmap", "jpeg"), tmp_path / "ds")
    ds = ShardDataset(path, crop_size=CROP)
    row = ds.index[5]
    shard = path / ds.manifest.shards[int(row["shard"])]["file"]
    with open(shard, "r+b") as f:  # damage the middle of the entropy-coded data
        f.seek(int(row["offset"]) + int(row["length"]) // 2)
        f.write(b"\x00" * 64)
    for verify in (True, False):
        ds = ShardDataset(path, crop_size=CROP, verify=verify)
        ds[4]  # neighbours are unaffected
        if verify:
            with pytest.raises(DatasetError, match="CRC-32") as e:
                ds[5]
            assert str(path) in str(e.value) and "record 5" in str(e.value) and ds.source(5) in str(e.value)
    with open(shard, "r+b") as f:  # a broken header fails even without the CRC check
        f.seek(int(row["offset"]))
        f.write(b"\x00" * 16)
    with pytest.raises(DatasetError, match=r"record 5 .*corrupt JPEG data"):
        ShardDataset(path, crop_size=CROP, verify=False)[5]
    with pytest.raises(DatasetError, match="record 5"):
        load(ShardDataset(path, crop_size=CROP), workers=2, ctx="fork")


def test_corrupt_raw_records(built, tmp_path: Path) -> None:
    """Damage inside an LMDB value (found by plain py-lmdb, closed again before packer opens the path)."""
    path = copy_dataset(built("lmdb", "raw"), tmp_path / "damaged")
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(lmdb_key(3))
    env.close()
    data = path / "data.mdb"
    blob = data.read_bytes()
    assert value is not None
    at = blob.index(value[:4096]) + 100
    data.write_bytes(blob[:at] + bytes(64) + blob[at + 64 :])
    with pytest.raises(DatasetError, match=r"record 3 \(source 'landscape/Landscape_3.jpg'\): CRC-32"):
        ShardDataset(path, crop_size=CROP, verify=True)[3]

    path = copy_dataset(built("lmdb", "raw"), tmp_path / "short")
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:  # a value whose length disagrees with the index
        txn.put(lmdb_key(6), b"short")
    env.close()
    with pytest.raises(DatasetError, match=r"record 6 \(source .*\): .*5 bytes"):
        ShardDataset(path, crop_size=CROP)[6]


def test_truncated_memmap_shard(built, tmp_path: Path) -> None:
    path = copy_dataset(built("memmap", "raw"), tmp_path / "ds")
    ds = ShardDataset(path, crop_size=CROP)
    last = ds.manifest.shards[-1]["file"]
    os.truncate(path / last, 10)
    ds[0]
    with pytest.raises(DatasetError, match=re.escape(f"{path}: record 17 (source ") + ".*truncated"):
        ds[17]


def test_index_errors(built) -> None:
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=CROP, dtype=torch.uint8)
    assert torch.equal(ds[-1][0], ds[17][0])
    with pytest.raises(IndexError):
        ds[18]
    with pytest.raises(ValueError, match=r"dtype must be torch\.uint8 or a floating type"):
        ShardDataset(ds.root, dtype=torch.int32)


FALLBACK_READ = """
import sys
sys.modules["turbojpeg"] = None  # as on a machine without PyTurboJPEG: packer must use Pillow
sys.modules["packer._native"] = None  # and without packer's libjpeg binding
import numpy as np, torch
from packer import ShardDataset
ds = ShardDataset(sys.argv[1], crop_size=224, train=False, dtype=torch.uint8)
np.save(sys.argv[2], torch.stack([ds[i][0] for i in range(len(ds))]).numpy())
"""


@pytest.mark.parametrize("resize", ["torch", "pillow"])
def test_pillow_fallback_reads_dct_scaled_crops(raw_photos, tmp_path: Path, resize: str, monkeypatch) -> None:
    """Without libjpeg-turbo, reads decode with Pillow, DCT scaling included (a 561 px center crop of a
    641 px short edge decodes at 1/2), and match the turbojpeg path within decoder rounding, with
    either resize backend (Pillow's reads RGBX decodes in place)."""
    import subprocess
    import sys

    from packer import build

    out = tmp_path / "big.lmdb"
    build(raw_photos, out, short_edge=641, workers=1, quiet=True)  # odd sizes: 962x641
    fallback = tmp_path / "fallback.npy"
    monkeypatch.setenv("PACKER_RESIZE", resize)
    transform.resize_backend.cache_clear()
    try:
        run = subprocess.run(
            [sys.executable, "-c", FALLBACK_READ, str(out), str(fallback)], capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        assert "using Pillow" in run.stderr
        ds = ShardDataset(out, crop_size=224, train=False, dtype=torch.uint8)
        turbo = torch.stack([ds[i][0] for i in range(len(ds))]).numpy().astype(np.int16)
    finally:
        monkeypatch.delenv("PACKER_RESIZE")
        transform.resize_backend.cache_clear()
    pillow = np.load(fallback).astype(np.int16)
    assert pillow.shape == turbo.shape == (18, 3, 224, 224)
    assert np.abs(pillow - turbo).mean() < 2.0


def test_raw_bytes_matches_tobytes() -> None:
    """The one-call RGB packing (Pillow's encoder, as tobytes drives it) gives tobytes' bytes."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for w, h in ((1, 1), (224, 224), (300, 17), (17, 300)):
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert("RGBX")
        assert transform._raw_bytes(im, "RGB") == im.tobytes("raw", "RGB")


@pytest.mark.parametrize("fmt", ["jpeg", "raw"])
def test_threads_sharing_a_dataset_get_the_same_samples(built, fmt: str) -> None:
    """Decode buffers are per thread: a thread pool over one dataset (decodes release the GIL)
    gives what a single thread gives."""
    from concurrent.futures import ThreadPoolExecutor

    ds = ShardDataset(built("lmdb", fmt), crop_size=CROP, seed=9, dtype=torch.float32)
    order = [i % len(ds) for i in range(72)]
    expected = [ds[i][0].clone() for i in order]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: ds[i][0].clone(), order))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.skipif(
    not codec.can_decode_region(),
    reason="packer._native not built (no C compiler or libjpeg "
    "headers when packer was installed): crops decode whole records",
)
@pytest.mark.parametrize("short_edge", [320, 641])
def test_crop_on_decode_matches_a_full_decode(raw_photos, tmp_path: Path, short_edge: int, monkeypatch) -> None:
    """Decoding only a crop's band gives the crop a full decode gives: exactly with torch's resize
    and with packer's (they stop at the box), within 1 with Pillow's (its filter weights depend on
    the box's position in the decoded image, in floating point).
    At short edge 641, eval crops decode at 1/2 scale (the DCT-scaled band path)."""
    from packer import build

    out = tmp_path / "ds.lmdb"
    build(raw_photos, out, short_edge=short_edge, workers=1, quiet=True)
    for backend, tolerance in [("torch", 0), ("pillow", 1), ("packer", 0)][: len(BACKENDS)]:
        monkeypatch.setenv("PACKER_RESIZE", backend)
        transform.resize_backend.cache_clear()
        try:
            for train in (True, False):
                ds = ShardDataset(out, crop_size=224, train=train, seed=2, dtype=torch.uint8)
                band = torch.stack([s.image for s in ds._batch(list(range(len(ds))), 0)])
                with monkeypatch.context() as m:
                    m.setattr(codec, "_native", None)
                    full = torch.stack([s.image for s in ds._batch(list(range(len(ds))), 0)])
                assert (band.int() - full.int()).abs().max() <= tolerance, (backend, train)
        finally:
            monkeypatch.delenv("PACKER_RESIZE")
            transform.resize_backend.cache_clear()


@pytest.mark.skipif(not codec.can_decode_region(), reason="packer._native not built")
def test_crop_decoder_refuses_bad_data_and_boxes() -> None:
    out = np.empty(1 << 16, np.uint8)
    for bad in (b"", b"\xff\xd8 not a jpeg", b"\x00" * 100):
        with pytest.raises(ValueError, match="corrupt JPEG data"):
            codec.decode_jpeg_region(bad, (1, 1), 0, 0, 8, 8, False, out)
    good = codec.encode_jpeg(np.zeros((32, 48, 3), np.uint8), 90)
    band, x0, size = codec.decode_jpeg_region(good, (1, 1), 8, 17, 8, 8, True, out)
    assert size == (48, 32) and band.shape[0] == 8 and band.shape[2] == 4 and x0 <= 17 < x0 + band.shape[1]
    with pytest.raises(ValueError, match="outside"):
        codec.decode_jpeg_region(good, (1, 1), 30, 0, 8, 8, False, out)
    with pytest.raises(ValueError, match="too small"):
        codec.decode_jpeg_region(good, (1, 1), 0, 0, 32, 48, True, np.empty(100, np.uint8))
    with pytest.raises(ValueError, match="corrupt JPEG data"):  # truncated inside the rows asked for
        codec.decode_jpeg_region(good[: len(good) // 2], (1, 1), 0, 0, 32, 48, False, out)


@pytest.mark.skipif(transform._native is None, reason="packer._native not built (no C compiler or libjpeg headers)")
@pytest.mark.parametrize("fmt", ["jpeg", "raw"])
def test_native_packing_matches_pillows(built, fmt: str, monkeypatch) -> None:
    """Writing a Pillow-resized crop to its batch slot with the compiled RGBX->RGB packer (mirroring
    included) gives Pillow's own transpose + tobytes result, byte for byte."""
    monkeypatch.setenv("PACKER_RESIZE", "pillow")
    transform.resize_backend.cache_clear()
    try:
        ds = ShardDataset(built("memmap", fmt), crop_size=CROP, seed=4, dtype=torch.uint8)
        indices = list(range(len(ds)))
        native = torch.stack([s.image for s in ds._batch(indices, 0)])
        monkeypatch.setattr(transform, "_native", None)
        fallback = torch.stack([s.image for s in ds._batch(indices, 0)])
    finally:
        monkeypatch.delenv("PACKER_RESIZE")
        transform.resize_backend.cache_clear()
    assert torch.equal(native, fallback)


@pytest.mark.skipif(transform._native is None, reason="packer._native not built (no C compiler or libjpeg headers)")
def test_native_pack_rgb_any_width_both_directions() -> None:
    """The compiled RGBX->RGB packer (vector path with a scalar tail) against numpy, mirrored or not."""
    from PIL import Image

    rng = np.random.default_rng(5)
    for w, h in ((1, 1), (3, 2), (4, 3), (5, 2), (8, 4), (9, 3), (13, 5), (224, 7)):
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        im = Image.fromarray(rgb).convert("RGBX")
        for src in (transform._pixels(im), transform._raw_bytes(im, "RGBX")):
            for flip in (False, True):
                out = np.zeros((h, w, 3), np.uint8)
                transform._native.pack_rgb(src, w, h, flip, out)
                assert np.array_equal(out, rgb[:, ::-1] if flip else rgb), (w, h, flip)
    with pytest.raises(ValueError, match="too small"):
        transform._native.pack_rgb(bytes(10), 4, 4, False, np.zeros((4, 4, 3), np.uint8))


@pytest.mark.skipif(transform._native is None, reason="packer._native not built (no C compiler or libjpeg headers)")
def test_native_normalize_equals_torchs_arithmetic() -> None:
    """The compiled float32 normalization (vector steps of 16 pixels, a scalar tail, streaming stores
    only on 16-byte aligned output) gives torch's sub-then-multiply result bit for bit."""
    rng = np.random.default_rng(6)
    mean, std = (0.3, 0.5, 0.7), (0.2, 0.25, 0.3)
    for h, w in ((1, 1), (1, 5), (3, 7), (2, 16), (5, 17), (224, 224)):
        x = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        m, inv = transform.norm_constants(mean, std, (3,))
        want = (x.float() - m) * inv
        for offset in (0, 1):  # an unaligned output takes the plain-store path
            out = torch.empty(h * w * 3 + offset)[offset:].view(h, w, 3)
            assert torch.equal(transform.normalize_hwc(x, out, mean, std), want), (h, w, offset)
    with pytest.raises(ValueError, match="3-channel"):
        transform._native.normalize(np.zeros(6, np.uint8), np.zeros(5, np.float32), (0, 0, 0), (1, 1, 1))


@pytest.mark.skipif(transform._native is None, reason="packer._native not built (no C compiler or libjpeg headers)")
def test_native_resize_matches_pillows_filter() -> None:
    """packer's resize kernel against Pillow's BILINEAR resize of the cropped image (the filter it
    implements): random boxes anywhere in the image, down- and upscaling, odd widths, 1 px sides,
    mirrored or not; within 2 (rounding: the passes run in the other order), and the AVX2 and scalar
    code give the same bytes. Its Lanczos filter against the exact one (below)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    smooth = np.linspace(0, 255, 427 * 3).reshape(1, 427, 3) + np.linspace(0, 60, 320).reshape(320, 1, 1)
    for img in (smooth.astype(np.uint8), rng.integers(0, 256, (320, 427, 3), dtype=np.uint8)):
        pil = Image.fromarray(img)
        for _ in range(150):
            h, w = int(rng.integers(1, 321)), int(rng.integers(1, 428))
            top, left = int(rng.integers(0, 321 - h)), int(rng.integers(0, 428 - w))
            oh, ow = (int(rng.choice([1, 7, 64, 224, 301])) for _ in range(2))
            flip = bool(rng.integers(0, 2))
            want = np.asarray(pil.crop((left, top, left + w, top + h)).resize((ow, oh), Image.Resampling.BILINEAR))
            if flip:
                want = want[:, ::-1]
            got = {}
            for vector in (True, False):
                got[vector] = np.zeros((oh, ow, 3), np.uint8)
                transform._native.resize_crop(img, 320, 427, top, left, h, w, got[vector], oh, ow, flip, vector)
            case = (top, left, h, w, oh, ow, flip)
            assert np.array_equal(got[True], got[False]), case
            assert np.abs(got[True].astype(int) - want).max() <= 2, case

    # Lanczos, on noise (negative lobes: clipped between the passes), against the exact separable
    # filter with Pillow's coefficients, horizontal pass first, each pass rounded and clipped as Pillow
    # does. (Pillow's own LANCZOS result drifts from it when one axis is upscaled and the other
    # shrunk, by up to 29 levels on noise; packer's builds only shrink, where they agree within 2:
    # test_inputs.py.)
    def lanczos_matrix(size: int, out: int) -> np.ndarray:
        scale = size / out
        support = 3 * max(scale, 1.0)
        m = np.zeros((out, size))
        for x in range(out):
            center = (x + 0.5) * scale
            first, last = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), size)
            t = (np.arange(first, last) - center + 0.5) / max(scale, 1.0)
            k = np.where(np.abs(t) < 3, np.sinc(t) * np.sinc(t / 3), 0.0)
            m[x, first:last] = k / k.sum()
        return m

    def rounded(a: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(a + 0.5), 0, 255)

    for _ in range(30):
        h, w = int(rng.integers(1, 321)), int(rng.integers(1, 428))
        top, left = int(rng.integers(0, 321 - h)), int(rng.integers(0, 428 - w))
        oh, ow = (int(rng.choice([1, 5, 100, 240, 400])) for _ in range(2))
        crop = img[top : top + h, left : left + w].astype(np.float64)
        mid = rounded(np.einsum("xw,hwc->hxc", lanczos_matrix(w, ow), crop))
        want = rounded(np.einsum("yh,hxc->yxc", lanczos_matrix(h, oh), mid))
        got = {}
        for vector in (True, False):
            got[vector] = np.zeros((oh, ow, 3), np.uint8)
            transform._native.resize_crop(img, 320, 427, top, left, h, w, got[vector], oh, ow, False, vector, True)
        where = (top, left, h, w, oh, ow)
        assert np.array_equal(got[True], got[False]), where
        assert np.abs(got[True] - want).max() <= 2, where  # 14-bit coefficients: a level per pass
    out = np.zeros((4, 4, 3), np.uint8)
    for bad in ((0, 0, 321, 10), (-1, 0, 5, 5), (0, 420, 5, 8), (0, 0, 0, 5)):
        with pytest.raises(ValueError, match="outside"):
            transform._native.resize_crop(img, 320, 427, *bad, out, 4, 4, False)
    with pytest.raises(ValueError, match="output too small"):
        transform._native.resize_crop(img, 320, 427, 0, 0, 8, 8, out, 5, 4, False)
    with pytest.raises(ValueError, match="source smaller"):
        transform._native.resize_crop(img[:10], 320, 427, 0, 0, 8, 8, out, 4, 4, False)
