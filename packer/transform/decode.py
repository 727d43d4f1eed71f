"""Record bytes to pixels: raw records viewed in place; JPEG records decoded whole, or only a crop's
band where packer's libjpeg binding is built, into a per-thread buffer reused from sample to sample."""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from .. import codec
from ..format.records import FORMATS

#: Each thread's decode destination, grown as needed: a 427x320 RGBX decode is 0.5 MB, worth not
#: reallocating per sample.
_buffers = threading.local()


def _buffer(size: int) -> np.ndarray:
    """This thread's flat uint8 decode buffer, at least ``size`` bytes."""
    buffer: Optional[np.ndarray] = getattr(_buffers, "array", None)
    if buffer is None or buffer.size < size:
        buffer = _buffers.array = np.empty(max(size, 1 << 20), np.uint8)
    return buffer


def raw_image(data: memoryview, height: int, width: int) -> np.ndarray:
    """A zero-copy HWC view of a raw record."""
    return np.frombuffer(data, np.uint8).reshape(height, width, 3)


def decode_jpeg(
    data: memoryview, *, height: int, width: int, factor: Optional[tuple[int, int]] = None, rgbx: bool = False
) -> np.ndarray:
    """Decode a whole JPEG record, DCT-scaled by ``factor``; ValueError unless it has the indexed size
    (keyword-only, as :func:`packer.codec.decode_jpeg`'s, so the two orders cannot be swapped).

    The result is this thread's buffer, valid until the thread's next decode.
    """
    factor = factor or (1, 1)
    w, h = codec.scaled_size(width, height, factor)
    channels = 4 if rgbx else 3
    out = _buffer(h * w * channels)[: h * w * channels].reshape(h, w, channels)
    return codec.decode_jpeg(data, width=width, height=height, factor=factor, rgbx=rgbx, out=out)


def decode_jpeg_band(
    data: memoryview,
    height: int,
    width: int,
    factor: Optional[tuple[int, int]],
    box: tuple[int, int, int, int],
    margin: int,
    rgbx: bool,
) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Decode only ``box`` (top, left, bottom, right, in the image decoded at ``factor``) of a JPEG
    record, plus ``margin`` pixels around it (for the resize filter's reach and so that the box's
    pixels equal a full decode's); ValueError unless the record has the indexed size.

    Returns the decoded band (this thread's buffer, valid until its next decode) and the box in it.
    """
    factor = factor or (1, 1)
    want_w, want_h = codec.scaled_size(width, height, factor)
    top, left, bottom, right = box
    t, l = max(0, top - margin), max(0, left - margin)  # noqa: E741 - t, l, b, r: the box edges, as in `box`
    b, r = min(want_h, bottom + margin), min(want_w, right + margin)
    channels = 4 if rgbx else 3
    buffer = _buffer((b - t) * (r - l + 64) * channels)  # the band widens to whole iMCUs (<= 32 px each side)
    if not (0 <= t < b <= want_h and 0 <= l < r <= want_w):
        raise ValueError(f"crop {box} outside the indexed {want_h}x{want_w} image")
    band, x_offset, size = codec.decode_jpeg_region(data, factor, t, l, b - t, r - l, rgbx, buffer)
    if size != (want_w, want_h):
        raise ValueError(f"JPEG decodes to {size[1]}x{size[0]}, index says {want_h}x{want_w}")
    return band, (top - t, left - x_offset, bottom - t, right - x_offset)


def whole_record(data: memoryview, fmt: str, height: int, width: int) -> torch.Tensor:
    """One record -> the whole stored image as uint8 HWC, a copy (decode buffers are reused, record
    bytes transient). A JPEG's frame header is checked against the index's size before the buffer
    for that size is taken (a hostile row may say 65,535 x 65,535 of a small image)."""
    why = FORMATS[fmt].problem(data, height=height, width=width)
    if why:
        raise ValueError(why)
    out = _buffer(height * width * 3)[: height * width * 3].reshape(height, width, 3)
    img = FORMATS[fmt].decode(data, height=height, width=width, out=out)
    return torch.from_numpy(img.copy())
