"""Fuzz packer's C extension (packer/_native.c, packer/_resize.c) with damaged and random JPEGs, random crop
boxes, scale factors and buffer sizes, for a bounded time.

Run it under AddressSanitizer and UBSan with ``make test-sanitize`` (which builds a sanitized copy of the
extension and passes it with ``--module``); without ``--module`` it exercises the installed
``packer._native``. Every call must either succeed or raise ValueError; a memory error aborts the
process under the sanitizers. Beyond memory safety it checks what can be checked cheaply: the vector
and scalar resize give identical bytes, pack_rgb and normalize match numpy, and a crop-on-decode band of
an undamaged JPEG equals the same rows of a full decode by the same function.

    python scripts/fuzz_native.py --seconds 60 --seed 1 [--module build/sanitize/_native.so]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
from PIL import Image


def load(path: str | None) -> ModuleType:
    """The extension at ``path`` (a sanitized build), else the installed packer._native."""
    if path is None:
        from packer import _native

        return _native
    spec = importlib.util.spec_from_file_location("_native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_jpeg(rng: np.random.Generator) -> bytes:
    """A small JPEG with random size, content, chroma subsampling, progressive or not, RGB or grey."""
    h, w = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    smooth = np.linspace(0, 255, w)[None, :, None] + np.linspace(0, 80, h)[:, None, None]
    pixels = np.clip(smooth + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(pixels)
    if rng.random() < 0.2:
        im = im.convert("L")
    buf = io.BytesIO()
    im.save(
        buf,
        "JPEG",
        quality=int(rng.integers(5, 100)),
        subsampling=int(rng.integers(0, 3)),
        progressive=bool(rng.random() < 0.3),
    )
    return buf.getvalue()


def damage(data: bytes, rng: np.random.Generator) -> bytes:
    """Truncated, bit-flipped, spliced or random bytes."""
    kind = int(rng.integers(0, 5))
    if kind == 0:
        return data[: int(rng.integers(0, len(data)))]
    if kind == 1:
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        return bytes(b)
    if kind == 2:
        b = bytearray(data)
        start = int(rng.integers(0, len(b)))
        b[start : start + 16] = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        return bytes(b)
    if kind == 3:
        return b"\xff\xd8" + rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
    return rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()


def fuzz_decode(native: ModuleType, rng: np.random.Generator) -> None:
    """decode_crop on a good or damaged JPEG with a random box, scale and output size."""
    good = make_jpeg(rng)
    data = good if rng.random() < 0.5 else damage(good, rng)
    num, channels = int(rng.integers(1, 9)), int(rng.choice([3, 4]))
    size = Image.open(io.BytesIO(good)).size
    w, h = (size[0] * num + 7) // 8, (size[1] * num + 7) // 8  # libjpeg rounds scaled sizes up
    top, left = int(rng.integers(0, h + 2)), int(rng.integers(0, w + 2))
    height, width = int(rng.integers(0, h + 2)), int(rng.integers(0, w + 2))
    need = max(height, 1) * (w + 16) * channels
    out = np.empty(need if rng.random() < 0.9 else int(rng.integers(0, need + 1)), np.uint8)
    try:
        x_offset, band_width, image_width, image_height = native.decode_crop(
            data, top, left, height, width, num, 8, channels, out
        )
    except ValueError:
        return
    assert x_offset <= left and x_offset + band_width >= left + width and band_width * height * channels <= out.size
    if data is good:
        same_as_whole_decode(
            native,
            data,
            num,
            channels,
            top,
            x_offset,
            out[: height * band_width * channels].reshape(height, band_width, channels),
            image_width,
            image_height,
        )


def same_as_whole_decode(
    native: ModuleType,
    data: bytes,
    num: int,
    channels: int,
    top: int,
    x_offset: int,
    band: np.ndarray,
    image_width: int,
    image_height: int,
) -> None:
    """A band equals the same pixels of a whole decode, except within 2 pixels of a cut edge (fancy
    upsampling sees no neighbours across it): packer.codec.decode_jpeg_region's documented promise."""
    whole = np.empty(image_height * image_width * channels, np.uint8)
    native.decode_crop(data, 0, 0, image_height, image_width, num, 8, channels, whole)
    height, band_width = band.shape[:2]
    same = whole.reshape(image_height, image_width, channels)[top : top + height, x_offset : x_offset + band_width]
    rows = slice(0 if top == 0 else 2, height if top + height == image_height else height - 2)
    cols = slice(0 if x_offset == 0 else 2, band_width if x_offset + band_width == image_width else band_width - 2)
    assert np.array_equal(band[rows, cols], same[rows, cols]), "crop-on-decode band differs from a whole decode"


def fuzz_resize(native: ModuleType, rng: np.random.Generator) -> None:
    """resize_crop with valid and invalid boxes and sizes; vector and scalar results must agree."""
    sh, sw = int(rng.integers(1, 120)), int(rng.integers(1, 120))
    src = rng.integers(0, 256, sh * sw * 3 + int(rng.integers(0, 2)) * 7, dtype=np.uint8)
    top, left = int(rng.integers(-1, sh)), int(rng.integers(-1, sw))
    height, width = int(rng.integers(0, sh + 2)), int(rng.integers(0, sw + 2))
    oh, ow = int(rng.integers(0, 70)), int(rng.integers(0, 70))
    flip, lanczos = bool(rng.random() < 0.5), bool(rng.random() < 0.3)
    outs = []
    for vector in (True, False):
        out = np.empty(max(oh * ow * 3 - int(rng.random() < 0.05), 0), np.uint8)
        try:
            native.resize_crop(src, sh, sw, top, left, height, width, out, oh, ow, flip, vector, lanczos)
        except ValueError:
            return
        outs.append(out)
    assert np.array_equal(outs[0], outs[1]), "vector and scalar resize differ"


def fuzz_pack(native: ModuleType, rng: np.random.Generator) -> None:
    """pack_rgb of RGBX bytes, mirrored or not, against numpy."""
    h, w = int(rng.integers(1, 40)), int(rng.integers(1, 70))
    rgbx = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    flip = bool(rng.random() < 0.5)
    out = np.empty((h, w, 3), np.uint8)
    native.pack_rgb(rgbx.tobytes(), w, h, flip, out)
    want = rgbx[:, ::-1, :3] if flip else rgbx[:, :, :3]
    assert np.array_equal(out, want), "pack_rgb differs from numpy"


def fuzz_normalize(native: ModuleType, rng: np.random.Generator) -> None:
    """normalize of any length (vector body and scalar tail), and mismatched buffers refused."""
    n = int(rng.integers(0, 400)) * 3
    src = rng.integers(0, 256, n, dtype=np.uint8)
    out = np.empty(n + (3 if rng.random() < 0.05 else 0), np.float32)
    mean, inv = (120.0, 110.0, 100.0), (0.02, 0.03, 0.04)
    try:
        native.normalize(src, out, mean, inv)
    except ValueError:
        assert out.size != n
        return
    want = (src.reshape(-1, 3) - np.asarray(mean, np.float32)) * np.asarray(inv, np.float32)
    assert np.allclose(out.reshape(-1, 3), want, rtol=1e-6, atol=1e-5), "normalize differs from numpy"


CASES: list[Callable[[ModuleType, np.random.Generator], None]] = [fuzz_decode, fuzz_resize, fuzz_pack, fuzz_normalize]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--module", help="path of a (sanitized) build of packer._native")
    args = parser.parse_args()
    native = load(args.module)
    rng = np.random.default_rng(args.seed)
    counts = dict.fromkeys((case.__name__ for case in CASES), 0)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for case in CASES:
            case(native, rng)
            counts[case.__name__] += 1
    print("fuzz_native: " + ", ".join(f"{name} {n}" for name, n in counts.items()) + f" calls, seed {args.seed}: clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
