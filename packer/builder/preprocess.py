"""One source file in, one record out: decode small, orient, RGB, shrink to the short edge, encode.

JPEGs are decoded at the smallest DCT scale (1/8, 1/4, 1/2) that keeps the short edge at or above the
target (Pillow ``draft``), so the decoder never produces pixels that would be thrown away; EXIF
orientation is applied to that small image, then one antialiased downscale hits the exact size.
Any failure becomes a :class:`Skip` with a reason a person can act on.

Nothing here changes process-wide state, so packer can preprocess inside any process (a Dask worker
with several threads, an application that imports packer): Pillow's global decompression-bomb limit
is left as it is (packer opens images without it and applies its own ``--max-pixels`` to the header
instead), and damaged JPEG data is detected by libjpeg's error handler in packer's C binding rather
than by turning warnings into errors, which is process-wide and races between threads.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Optional, Union

import numpy as np
from PIL import Image

from .. import codec
from .._version import DISTRIBUTION
from ..codec import decode_jpeg, native_shrink, shrink_factor, turbojpeg
from ..format.records import FORMATS
from .scan import open_source

BACKGROUND = (255, 255, 255)  # transparent pixels are composited on white
HEIF_EXTENSIONS = frozenset((".heic", ".heif"))
HEIF_MISSING = f"HEIC/HEIF needs the optional extra: pip install '{DISTRIBUTION}[heif]'"


def _register_heif() -> bool:
    """Pillow reads HEIC/HEIF only through the optional pillow-heif plugin; register it when installed."""
    try:
        from pillow_heif import register_heif_opener
    except ImportError:
        return False
    register_heif_opener()
    return True


HEIF_AVAILABLE = _register_heif()  # at import, so every worker process registers it too


@dataclass(frozen=True)
class PreprocessSpec:
    """What one file's preprocessing needs: :attr:`packer.builder.options.BuildOptions.preprocess` (which holds
    the defaults and checks the values)."""

    format: str
    short_edge: int
    quality: int
    max_pixels: int
    min_size: int
    max_aspect: float


@dataclass(frozen=True)
class Record:
    data: bytes
    height: int
    width: int
    crc32: int  # zlib.crc32 of data, computed where the data is made (in the worker, in parallel)


@dataclass(frozen=True)
class Skip:
    reason: str


Result = Union[Record, Skip]


def target_size(width: int, height: int, short_edge: int) -> tuple[int, int]:
    """(w, h) with the short edge at ``short_edge`` and the aspect kept; never upscales."""
    short = min(width, height)
    if short <= short_edge:
        return width, height
    scale = short_edge / short
    if width <= height:
        return short_edge, max(1, round(height * scale))
    return max(1, round(width * scale)), short_edge


def _check_geometry(width: int, height: int, opts: PreprocessSpec) -> Optional[str]:
    if width * height > opts.max_pixels:
        return (
            f"decompression bomb guard: {width}x{height} = {width * height} pixels "
            f"exceeds --max-pixels {opts.max_pixels}"
        )
    if min(width, height) < opts.min_size:
        return f"too small: {width}x{height}, short edge below --min-size {opts.min_size}"
    if max(width, height) > opts.max_aspect * min(width, height):
        return f"extreme aspect ratio: {width}x{height} exceeds --max-aspect {opts.max_aspect:g}"
    return None


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: alpha on a fixed background, 16-bit and float scaled, not clipped."""
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        a = np.asarray(im.convert("I") if im.mode != "I" else im, dtype=np.int64)
        return Image.fromarray(np.clip((a + 128) // 257, 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode == "F":
        f = np.asarray(im, dtype=np.float64)
        f = f * 255.0 if np.nanmax(f) <= 1.0 else f
        return Image.fromarray(np.clip(np.nan_to_num(f), 0, 255).astype(np.uint8), "L").convert("RGB")
    has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    if has_alpha:
        rgba = im.convert("RGBA")
        base = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return im.convert("RGB")


def open_image(data: bytes | BinaryIO) -> Image.Image:
    """``Image.open`` of encoded bytes or of a file opened for reading (the same plugins, tried in the
    same order; only the header is read until the pixels are loaded) without Pillow's
    decompression-bomb check, which reads the process-wide ``Image.MAX_IMAGE_PIXELS``: packer checks
    ``--max-pixels`` against the header right after, so neither limit is changed for anyone else in
    the process."""
    fp = io.BytesIO(data) if isinstance(data, bytes) else data
    prefix = fp.read(16)
    tried: list[str] = []
    for loader in (None, Image.preinit, Image.init):  # Image.open's order: registered, common, all
        if loader is not None:
            loader()
        for fmt in [f for f in Image.ID if f not in tried]:
            tried.append(fmt)
            factory, accept = Image.OPEN[fmt]
            try:
                result = accept(prefix) if accept else True
                if result and not isinstance(result, str):
                    fp.seek(0)  # where an earlier plugin's attempt may have left it
                    return factory(fp, "")
            except (SyntaxError, IndexError, TypeError, struct.error):
                continue
    raise Image.UnidentifiedImageError("cannot identify image file")


def stored_size(path: str, opts: PreprocessSpec) -> tuple[int, int]:
    """The (width, height) of the source image ``path`` as stored (EXIF orientation not applied), from
    its header alone: what a converter checks its annotations' sizes against before it makes
    anything that large. ValueError, with the reason :func:`process` would give, for a file that
    the build would skip (unreadable, not an image, beyond ``--max-pixels`` and the other limits)."""
    try:
        with open_source(path) as f, open_image(f) as im:
            width, height = im.size
    except Exception as e:  # any failure is the file's, as in process()
        raise ValueError(describe(e)) from None
    problem = _check_geometry(width, height, opts)
    if problem:
        raise ValueError(problem)
    return width, height


def load(path: str, opts: PreprocessSpec) -> Image.Image:
    """Decode ``path`` as an upright RGB image already shrunk to the target short edge."""
    with open_source(path) as f:
        data = f.read()
    return load_bytes(data, opts)[0]


def load_bytes(data: bytes, opts: PreprocessSpec) -> tuple[Image.Image, tuple[int, int]]:
    """The encoded image ``data`` as :func:`load` makes it, and the (width, height) of the source
    once upright (EXIF orientation applied): what a sample's boxes and masks are measured in."""
    with open_image(data) as im:  # reads the header only: size, mode, EXIF
        width, height = im.size
        problem = _check_geometry(width, height, opts)
        if problem:
            raise ValueError(problem)
        target = target_size(width, height, opts.short_edge)
        orientation = im.getexif().get(0x0112, 1)
        if im.format == "JPEG" and im.mode in ("RGB", "L") and turbojpeg() is not None:
            factor = shrink_factor(width, height, opts.short_edge)
            rgb = Image.fromarray(shrink(decode_jpeg(data, width=width, height=height, factor=factor), target), "RGB")
        else:
            if im.format == "JPEG" and target != (width, height):
                im.draft(im.mode, target)  # DCT-domain downscale; result stays >= the requested size
            im.load()
            rgb = to_rgb(im)  # before resizing: palette images would otherwise resample as NEAREST
            if rgb is im:
                rgb = im.copy()  # the file's own image is released when the with-block closes it
    return _finish(rgb, target, orientation), _upright(width, height, orientation)


def load_image(im: Image.Image | np.ndarray, opts: PreprocessSpec) -> tuple[Image.Image, tuple[int, int]]:
    """A decoded Pillow image (its EXIF orientation honoured, as a file's is), or H x W x 3 uint8
    pixels, as :func:`load_bytes` makes one. Pixels are shrunk where they lie (no full-size copy
    into a Pillow image and back)."""
    height, width = im.shape[:2] if isinstance(im, np.ndarray) else im.size[::-1]
    problem = _check_geometry(width, height, opts)
    if problem:
        raise ValueError(problem)
    target = target_size(width, height, opts.short_edge)
    if isinstance(im, np.ndarray):
        orientation = 1
        small = (width, height) != target and native_shrink()
        rgb = Image.fromarray(shrink(np.ascontiguousarray(im), target) if small else im, "RGB")
    else:
        orientation = im.getexif().get(0x0112, 1)
        rgb = to_rgb(im)
        if rgb.size != target and native_shrink():
            rgb = Image.fromarray(shrink(np.asarray(rgb), target), "RGB")
    return _finish(rgb, target, orientation), _upright(width, height, orientation)


def _finish(rgb: Image.Image, target: tuple[int, int], orientation: int) -> Image.Image:
    """The last steps of every image: the resize to ``target`` (where the decode left another size), the orientation."""
    if rgb.size != target:
        rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return _apply_orientation(rgb, orientation)


def _upright(width: int, height: int, orientation: int) -> tuple[int, int]:
    """(width, height) of a ``width`` x ``height`` image once its EXIF ``orientation`` is applied."""
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def shrink(pixels: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """H x W x 3 ``pixels`` at the ``target`` (width, height) with Pillow's LANCZOS filter, by
    packer's kernel where :func:`~packer.codec.native_shrink`; else unchanged, for Pillow to resize."""
    height, width = pixels.shape[:2]
    if (width, height) == target or not native_shrink():
        return pixels
    out = np.empty((target[1], target[0], 3), np.uint8)
    codec._native.resize_crop(pixels, height, width, 0, 0, height, width, out, target[1], target[0], False, True, True)
    return out


def _apply_orientation(im: Image.Image, orientation: int) -> Image.Image:
    """EXIF Orientation 2..8 as Pillow's exif_transpose does it, on the already small image."""
    method = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }.get(orientation)
    return im.transpose(method) if method is not None else im


def process(path: str, opts: PreprocessSpec) -> Result:
    """The whole per-file job; never raises for bad input, returns a Skip naming the problem."""
    if not HEIF_AVAILABLE and os.path.splitext(path)[1].lower() in HEIF_EXTENSIONS:
        return Skip(HEIF_MISSING)
    try:
        im = load(path, opts)
        rgb = np.ascontiguousarray(np.asarray(im, dtype=np.uint8))
        h, w = rgb.shape[:2]
        data = FORMATS[opts.format].encode(rgb, quality=opts.quality)
        return Record(data, h, w, zlib.crc32(data))
    except MemoryError:
        return Skip("out of memory while decoding")
    except Exception as e:  # any decoder failure is the file's problem, reported with its path
        return Skip(describe(e))


def describe(e: Exception) -> str:
    if isinstance(e, Image.UnidentifiedImageError):
        return "not a recognised image (cannot identify image file)"
    if isinstance(e, OSError) and e.strerror:
        return f"unreadable: {e.strerror}"
    text = str(e) or type(e).__name__
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def process_chunk(paths: list[str], opts: PreprocessSpec) -> list[Result]:
    """Unit of work sent to a worker process: a few files, to amortise inter-process overhead."""
    return [process(p, opts) for p in paths]
