"""The crop resize (antialiased bilinear) into a batch slot, by one of three kernels chosen once per
process from :data:`KERNELS`, fastest first where this install has it (docs/PERFORMANCE.md, "The
resize kernels"; ``PACKER_RESIZE=packer|pillow|torch`` overrides):

- ``"packer"``: packer's own (packer/_resize.c, AVX2), which reads the RGB crop in place and writes
  the batch slot directly, where every library kernel needs the crop unpacked to its own layout and
  its result copied out;
- ``"pillow"``: Pillow-SIMD (its version ends in ``.postN``), where packer's kernel is not built or
  the CPU lacks AVX2; it reads RGBX decodes, which Pillow's images map without a copy;
- ``"torch"``: torch's uint8 kernel, the fallback.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .. import codec

#: packer's compiled helpers (packer/_native.c), or None where they could not be built; imported
#: once, by codec. A module attribute of its own, so a test can take the resize kernel away alone.
_native = codec._native

#: Called with a stage's name as each stage ends (``packer bench``'s profile); None in normal use,
#: so the profile times the very code that training runs.
Clock = Optional[Callable[[str], None]]

#: (top, left, bottom, right) of the crop in the decoded image.
Box = tuple[int, int, int, int]


def _packer(img: np.ndarray, box: Box, flip: bool, out: np.ndarray, clock: Clock) -> None:
    """packer/_resize.c: reads the box of the RGB image in place, writes (and mirrors) into ``out``."""
    top, left, bottom, right = box
    size = out.shape[0]
    img = np.ascontiguousarray(img[:, :, :3])  # already so: RGB from the decoders and raw records
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.uint8)
    _native.resize_crop(img, img.shape[0], img.shape[1], top, left, bottom - top, right - left, dst, size, size, flip)
    if clock:
        clock("resize")
    if dst is not out:
        np.copyto(out, dst)


def _raw_bytes(im: Image.Image, rawmode: str) -> bytes:
    """``im.tobytes("raw", rawmode)`` in one encoder call: tobytes packs in 64 KB chunks and joins
    them, one more copy of the whole crop (docs/PERFORMANCE.md, "Per-sample steps"). Mirrors
    tobytes' own use of Pillow's encoder; falls back to tobytes where that differs."""
    size = im.width * im.height * len(rawmode)
    try:
        encoder = Image._getencoder(im.mode, "raw", rawmode)
        try:
            encoder.setimage(im.im, (0, 0, *im.size))
            _, done, data = encoder.encode(size + 1)
        finally:
            encoder.cleanup()
    except (AttributeError, TypeError):  # another Pillow's internals
        return im.tobytes("raw", rawmode)
    return data if done > 0 and len(data) == size else im.tobytes("raw", rawmode)


def _pixels(im: Image.Image) -> object:
    """``im``'s RGBX pixels for ``_native.pack_rgb``: read in place through the Arrow C data
    interface where this Pillow exports it (11.2+, a stable ABI), else copied out."""
    try:
        return im.__arrow_c_array__()
    except (AttributeError, ValueError):
        return _raw_bytes(im, "RGBX")


def _pillow(img: np.ndarray, box: Box, flip: bool, out: np.ndarray, clock: Clock) -> None:
    """Pillow's BILINEAR over the box (a Pillow image mapping the RGBX decode, or the raw record's box
    rows), then packed to RGB and mirrored into ``out`` in one pass where packer's helper is built."""
    top, left, bottom, right = box
    size = out.shape[0]
    img = np.ascontiguousarray(img)  # already so, from the decoders and raw records
    if img.shape[2] == 4:
        src = Image.frombuffer("RGBX", (img.shape[1], img.shape[0]), img, "raw", "RGBX", 0, 1)
    else:  # RGB (raw records): Pillow unpacks just the box's rows, read in place, to its layout
        start = (top * img.shape[1] + left) * 3
        src = Image.frombuffer(
            "RGB", (right - left, bottom - top), img.reshape(-1)[start:], "raw", "RGB", img.shape[1] * 3, 1
        )
        top, left, bottom, right = 0, 0, bottom - top, right - left
    small = src.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, right, bottom))
    if clock:
        clock("resize")
    if _native is not None and out.flags.c_contiguous:  # pack to RGB and mirror in one pass, in place
        _native.pack_rgb(_pixels(small), size, size, flip, out)
    else:
        if flip:
            small = small.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            if clock:
                clock("flip")
        np.copyto(out, np.frombuffer(_raw_bytes(small, "RGB"), np.uint8).reshape(size, size, 3))


def _tensor(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy for arrays that may be read-only record buffers: they are only ever read,
    so the "not writable" warning torch raises for them is noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _torch(img: np.ndarray, box: Box, flip: bool, out: np.ndarray, clock: Clock) -> None:
    """torch's antialiased bilinear uint8 kernel on a view of the box; mirrored while copying out."""
    top, left, bottom, right = box
    size = out.shape[0]
    region = _tensor(img[top:bottom, left:right, :3]).permute(2, 0, 1)[None]
    if region.shape[2:] != (size, size):
        region = F.interpolate(region, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    hwc = region[0].permute(1, 2, 0)
    if clock:
        clock("resize")
    if flip:
        hwc = hwc.flip(1)
        if clock:
            clock("flip")
    torch.from_numpy(out).copy_(hwc)


def _packer_missing() -> Optional[str]:
    return None if _native is not None else "packer._native was not built (no C compiler or libjpeg headers)"


def _packer_vector() -> bool:
    """packer's kernel is built and this CPU has AVX2 (its scalar code is only the reference)."""
    return _native is not None and bool(_native.RESIZE_VECTOR)


def _pillow_simd() -> bool:
    import PIL

    return ".post" in PIL.__version__


def _nothing_missing() -> Optional[str]:
    return None


def _always() -> bool:
    return True


class Kernel(NamedTuple):
    """A resize kernel and when it can be used."""

    #: ``resize(img, box, flip, out, clock)``: ``img[box]`` resized, mirrored if ``flip``, into ``out``.
    resize: Callable[[np.ndarray, Box, bool, np.ndarray, Clock], None]
    #: Whether the automatic choice takes it: the first kernel in :data:`KERNELS` for which this holds.
    preferred: Callable[[], bool] = _always
    #: Why PACKER_RESIZE cannot choose it on this install, or None.
    missing: Callable[[], Optional[str]] = _nothing_missing
    #: Whether it wants RGBX decodes (Pillow's pixel layout, which its images map without a copy).
    rgbx: bool = False


#: The resize kernels by name (``PACKER_RESIZE``'s choices), fastest first.
KERNELS: dict[str, Kernel] = {
    "packer": Kernel(_packer, preferred=_packer_vector, missing=_packer_missing),
    "pillow": Kernel(_pillow, preferred=_pillow_simd, rgbx=True),
    "torch": Kernel(_torch),
}
#: Their names (public since packer.transform exported it: kept under that name).
RESIZE_BACKENDS = tuple(KERNELS)


@functools.cache
def resize_backend() -> str:
    """The name of the resize kernel this process uses: ``PACKER_RESIZE`` if set (and not ``auto``),
    else the first :data:`KERNELS` entry preferred on this install. Fixed per process, so every
    worker resizes alike."""
    choice = os.environ.get("PACKER_RESIZE", "auto")
    if choice == "auto":
        return next(name for name, kernel in KERNELS.items() if kernel.preferred())
    if choice not in KERNELS:
        raise ValueError(f"PACKER_RESIZE must be one of {', '.join(KERNELS)} or auto, not {choice!r}")
    missing = KERNELS[choice].missing()
    if missing:
        raise ValueError(f"PACKER_RESIZE={choice}, but {missing}")
    return choice


def kernel() -> Kernel:
    """The kernel :func:`resize_backend` names."""
    return KERNELS[resize_backend()]


def resize_into(img: np.ndarray, box: Box, flip: bool, out: np.ndarray, clock: Clock = None) -> None:
    """Write ``img[box]`` resized (antialiased bilinear) and optionally mirrored into ``out``, a
    ``size x size x 3`` uint8 HWC array (a view of the output batch), with the kernel in use.
    ``img`` is HWC RGB, or RGBX where the kernel wants it (:attr:`Kernel.rgbx`)."""
    kernel().resize(img, box, flip, out, clock)
    if clock:
        clock("write to batch")
