"""packer's C extension at its edges: what the fuzzer (scripts/fuzz_native.py, run under ASan/UBSan by
``make test-sanitize``) found, kept as plain regression tests, and a short fuzz of the installed build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from packer import codec
from packer.transform import norm_constants, normalize_hwc, resize

pytestmark = pytest.mark.skipif(
    not codec.can_decode_region(),
    reason="packer._native not built (no C compiler or libjpeg headers when packer was installed)",
)
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("width", range(1, 14))
def test_pack_rgb_writes_nothing_past_the_slot(width: int, flip: bool) -> None:
    """The SSSE3 row loop stored 16 bytes for 12 and wrote one byte past a slot's last row (a
    neighbouring slot, or past the batch: heap corruption) for widths 5, 9, 13, ..."""
    rng = np.random.default_rng(width)
    height = 3
    rgbx = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    buf = np.full(height * width * 3 + 16, 0xAB, np.uint8)
    slot = buf[: height * width * 3].reshape(height, width, 3)
    codec._native.pack_rgb(rgbx.tobytes(), width, height, flip, slot)
    assert (buf[height * width * 3 :] == 0xAB).all(), "pack_rgb wrote past its output"
    np.testing.assert_array_equal(slot, rgbx[:, ::-1, :3] if flip else rgbx[:, :, :3])


def test_fuzz_installed_extension_briefly() -> None:
    """The fuzz driver itself runs clean against the installed build (``make test`` also runs it
    under the sanitizers, where an out-of-bounds access aborts instead of passing unnoticed)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz_native.py"), "--seconds", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("clean")


def test_native_pack_rgb_any_width_both_directions() -> None:
    """The compiled RGBX->RGB packer (vector path with a scalar tail) against numpy, mirrored or not."""
    from PIL import Image

    rng = np.random.default_rng(5)
    for w, h in ((1, 1), (3, 2), (4, 3), (5, 2), (8, 4), (9, 3), (13, 5), (224, 7)):
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        im = Image.fromarray(rgb).convert("RGBX")
        for src in (resize._pixels(im), resize._raw_bytes(im, "RGBX")):
            for flip in (False, True):
                out = np.zeros((h, w, 3), np.uint8)
                codec._native.pack_rgb(src, w, h, flip, out)
                assert np.array_equal(out, rgb[:, ::-1] if flip else rgb), (w, h, flip)
    with pytest.raises(ValueError, match="too small"):
        codec._native.pack_rgb(bytes(10), 4, 4, False, np.zeros((4, 4, 3), np.uint8))


def test_native_normalize_equals_torchs_arithmetic() -> None:
    """The compiled float32 normalization (vector steps of 16 pixels, a scalar tail, streaming stores
    only on 16-byte aligned output) gives torch's sub-then-multiply result bit for bit."""
    rng = np.random.default_rng(6)
    mean, std = (0.3, 0.5, 0.7), (0.2, 0.25, 0.3)
    for h, w in ((1, 1), (1, 5), (3, 7), (2, 16), (5, 17), (224, 224)):
        x = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        m, inv = norm_constants(mean, std, (3,))
        want = (x.float() - m) * inv
        for offset in (0, 1):  # an unaligned output takes the plain-store path
            out = torch.empty(h * w * 3 + offset)[offset:].view(h, w, 3)
            assert torch.equal(normalize_hwc(x, out, mean, std), want), (h, w, offset)
    with pytest.raises(ValueError, match="3-channel"):
        codec._native.normalize(np.zeros(6, np.uint8), np.zeros(5, np.float32), (0, 0, 0), (1, 1, 1))


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
                codec._native.resize_crop(img, 320, 427, top, left, h, w, got[vector], oh, ow, flip, vector)
            case = (top, left, h, w, oh, ow, flip)
            assert np.array_equal(got[True], got[False]), case
            assert np.abs(got[True].astype(int) - want).max() <= 2, case

    # Lanczos, on noise (negative lobes: clipped between the passes), against the exact separable
    # filter with Pillow's coefficients, horizontal pass first, each pass rounded and clipped as Pillow
    # does. (Pillow's own LANCZOS result drifts from it when one axis is upscaled and the other
    # shrunk, by up to 29 levels on noise; packer's builds only shrink, where they agree within 2:
    # tests/builder/test_inputs.py.)
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
            codec._native.resize_crop(img, 320, 427, top, left, h, w, got[vector], oh, ow, False, vector, True)
        where = (top, left, h, w, oh, ow)
        assert np.array_equal(got[True], got[False]), where
        assert np.abs(got[True] - want).max() <= 2, where  # 14-bit coefficients: a level per pass
    out = np.zeros((4, 4, 3), np.uint8)
    for bad in ((0, 0, 321, 10), (-1, 0, 5, 5), (0, 420, 5, 8), (0, 0, 0, 5)):
        with pytest.raises(ValueError, match="outside"):
            codec._native.resize_crop(img, 320, 427, *bad, out, 4, 4, False)
    with pytest.raises(ValueError, match="output too small"):
        codec._native.resize_crop(img, 320, 427, 0, 0, 8, 8, out, 5, 4, False)
    with pytest.raises(ValueError, match="source smaller"):
        codec._native.resize_crop(img[:10], 320, 427, 0, 0, 8, 8, out, 4, 4, False)
