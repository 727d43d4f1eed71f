"""packer.transform: crop draws and boxes, decoders, the resize backends and their agreement, and every
read path's batches pinned bit for bit against recorded digests."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from packer import codec, transform
from packer.read.dataset import ShardDataset
from packer.transform import DRAWS, random_resized_crops, resize, to_device, uniforms

from ..conftest import FORMAT_NAMES
from ..read.test_dataset import CROP, load

#: The resize kernels this install has (packer's own needs packer._native built).
BACKENDS = ("torch", "pillow") + (("packer",) if codec._native is not None else ())


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


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
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
        assert resize._raw_bytes(im, "RGB") == im.tobytes("raw", "RGB")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
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
                band = torch.stack([s.image for s in ds.__getitems__(list(range(len(ds))))])
                with monkeypatch.context() as m:
                    m.setattr(codec, "_native", None)
                    full = torch.stack([s.image for s in ds.__getitems__(list(range(len(ds))))])
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


@pytest.mark.skipif(codec._native is None, reason="packer._native not built (no C compiler or libjpeg headers)")
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_native_packing_matches_pillows(built, fmt: str, monkeypatch) -> None:
    """Writing a Pillow-resized crop to its batch slot with the compiled RGBX->RGB packer (mirroring
    included) gives Pillow's own transpose + tobytes result, byte for byte."""
    monkeypatch.setenv("PACKER_RESIZE", "pillow")
    transform.resize_backend.cache_clear()
    try:
        ds = ShardDataset(built("memmap", fmt), crop_size=CROP, seed=4, dtype=torch.uint8)
        indices = list(range(len(ds)))
        native = torch.stack([s.image for s in ds.__getitems__(indices)])
        monkeypatch.setattr(resize, "_native", None)
        fallback = torch.stack([s.image for s in ds.__getitems__(indices)])
    finally:
        monkeypatch.delenv("PACKER_RESIZE")
        transform.resize_backend.cache_clear()
    assert torch.equal(native, fallback)


# --- every read path's batches, bit for bit --------------------------------------------------------
#
# Hashed and compared with digests recorded on this project's install, so that a change to
# packer.transform (or codec's decoders) that alters a single pixel fails here. The digests depend on
# the decoders, resize kernels and float arithmetic of the install (libjpeg-turbo, Pillow, torch, numpy,
# CPU), so they are keyed by those; elsewhere the test is skipped, saying how to record the install's
# (``PACKER_RECORD_DIGESTS=1``, run on the code before the change).

DIGESTS = Path(__file__).resolve().parents[1] / "data" / "batch-digests.json"


def install_key() -> str:
    """What the pixels depend on besides packer's code."""
    import PIL

    return (
        f"{platform.machine()} torch-{torch.__version__} numpy-{np.__version__} pillow-{PIL.__version__} "
        f"{codec.codec_name()} native={codec._native is not None}"
    )


def digest(images: list[torch.Tensor]) -> str:
    """The images' shapes, dtypes, strides and bytes."""
    h = hashlib.sha256()
    for image in images:
        h.update(f"{tuple(image.shape)} {image.dtype} {image.stride()}".encode())
        h.update(image.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def batches(path: Path) -> dict[str, str]:
    """Every sample of ``path`` through each read path that the backend in use takes."""
    n = 18
    out: dict[str, str] = {}

    def batch(name: str, epoch: int = 0, **kw) -> None:
        ds = ShardDataset(path, **kw)
        ds.set_epoch(epoch)
        out[name] = digest([s.image for s in ds.__getitems__(list(range(n)))])

    batch("train-u8", crop_size=64, seed=3, dtype=torch.uint8)
    batch("train-u8-epoch5", epoch=5, crop_size=64, seed=3, dtype=torch.uint8)
    batch("train-f32-contiguous", crop_size=64, seed=3, memory_format=torch.contiguous_format)
    batch("train-f32-noflip", crop_size=100, seed=4, flip=False, scale=(0.5, 1.0))
    batch("eval-f32", crop_size=96, train=False)
    batch("eval-u8-224", crop_size=224, train=False, dtype=torch.uint8)
    batch("transform-f32", crop_size=64, seed=3, transform=lambda x: x)
    batch("whole-f32", crop_size=None)
    batch("whole-transform-u8", crop_size=None, dtype=torch.uint8, transform=lambda x: x[:, :200, :200])
    ds = ShardDataset(path, crop_size=64, seed=3, dtype=torch.uint8)
    u8 = torch.stack([s.image for s in ds.__getitems__(list(range(n)))])
    out["to_device-cpu"] = digest([transform.to_device(u8, "cpu")])
    out["to_device-cpu-f16"] = digest([transform.to_device(u8, "cpu", dtype=torch.float16)])
    with pytest.MonkeyPatch.context() as m:  # without packer's libjpeg binding: whole-record decodes
        m.setattr(codec, "_native", None)
        batch("train-u8-whole-decode", crop_size=64, seed=3, dtype=torch.uint8)
        batch("whole-u8-turbojpeg", crop_size=None, dtype=torch.uint8)
    return out


def test_batches_are_bit_identical_to_the_recorded_ones(built, monkeypatch) -> None:
    found: dict[str, str] = {}
    for backend in BACKENDS:
        monkeypatch.setenv("PACKER_RESIZE", backend)
        transform.resize_backend.cache_clear()
        try:
            for fmt in FORMAT_NAMES:
                for name, value in batches(built("memmap", fmt)).items():
                    found[f"{backend} {fmt} {name}"] = value
        finally:
            monkeypatch.delenv("PACKER_RESIZE")
            transform.resize_backend.cache_clear()
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    key = install_key()
    if os.environ.get("PACKER_RECORD_DIGESTS") == "1":
        recorded[key] = found
        DIGESTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    if key not in recorded:
        pytest.skip(f"no digests recorded for this install ({key}): PACKER_RECORD_DIGESTS=1 records them")
    changed = sorted(name for name in found if recorded[key].get(name) != found[name])
    assert not changed, f"batches differ from the recorded ones: {changed}"
    assert set(found) == set(recorded[key])
