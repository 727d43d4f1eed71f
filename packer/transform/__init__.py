"""The read side's per-sample work, on uint8 pixels, in the order a sample meets it:

- :mod:`.draws`: random draws as pure functions of (seed, epoch, index);
- :mod:`.geometry`: crop boxes from the draws (RandomResizedCrop + flip, or eval center crops);
- :mod:`.decode`: record bytes to pixels (raw in place, JPEG whole or only the crop's band);
- :mod:`.resize`: the resize kernels, one table of backends (packer's, Pillow-SIMD's, torch's);
- :mod:`.crop`: one record's crop into its slot of the output batch (decode, then resize);
- :mod:`.normalize`: conversion to float and normalization, last, on the output crop only;
- :mod:`.device`: :func:`to_device`, the same conversion on the GPU for uint8 batches.

The names below are the ones ShardDataset, the tools and training scripts use
(``from packer.transform import to_device``).
"""

from __future__ import annotations

from .crop import crop_into
from .decode import decode_jpeg, decode_jpeg_band, raw_image, whole_record
from .device import to_device
from .draws import DRAWS, sample_keys, uniforms
from .geometry import DCT_SCALES, Augment, Crop, center_crops, crop_box, dct_scale, random_resized_crops
from .normalize import IMAGENET_MEAN, IMAGENET_STD, norm_constants, normalize_hwc, normalize_into
from .resize import RESIZE_BACKENDS, Clock, resize_backend, resize_into

__all__ = [
    "DCT_SCALES",
    "DRAWS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RESIZE_BACKENDS",
    "Augment",
    "Clock",
    "Crop",
    "center_crops",
    "crop_box",
    "crop_into",
    "dct_scale",
    "decode_jpeg",
    "decode_jpeg_band",
    "norm_constants",
    "normalize_hwc",
    "normalize_into",
    "random_resized_crops",
    "raw_image",
    "resize_backend",
    "resize_into",
    "sample_keys",
    "to_device",
    "uniforms",
    "whole_record",
]
