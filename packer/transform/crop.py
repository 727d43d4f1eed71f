"""One record's crop into its slot of the output batch, in uint8: decoded (raw records sliced in
place; JPEG at a reduced DCT scale when the crop shrinks by 2x or more, and only the crop's band where
packer's libjpeg binding is built), then resized by the kernel in use. The batch is channels-last
(H x W x C in memory) by default, the layout decoders and resize kernels produce, so no transposing
copy is made (docs/PERFORMANCE.md, "What changed")."""

from __future__ import annotations

import numpy as np

from .. import codec
from ..format.records import FORMATS
from .decode import decode_jpeg, decode_jpeg_band, raw_image
from .geometry import Crop, crop_box, dct_scale
from .resize import Clock, kernel, resize_into


def crop_into(
    data: memoryview, fmt: str, height: int, width: int, crop: Crop, out: np.ndarray, clock: Clock = None
) -> None:
    """One record's crop, resized to ``out``'s size and flipped if the crop says so, written into
    ``out`` (a uint8 H x W x C array)."""
    size = out.shape[0]
    if not FORMATS[fmt].compressed:
        img, box = raw_image(data, height, width), crop_box(crop, None)
    else:
        factor = dct_scale(crop, size)
        box, rgbx = crop_box(crop, factor), kernel().rgbx
        if codec.can_decode_region():
            reach = -(-max(box[2] - box[0], box[3] - box[1]) // size)  # the resize filter's, in pixels
            img, box = decode_jpeg_band(data, height, width, factor, box, reach + 1, rgbx)
        else:
            img = decode_jpeg(data, height=height, width=width, factor=factor, rgbx=rgbx)
    if clock:
        clock("decode")
    resize_into(img, box, crop.flip, out, clock)
