"""The JPEG codec choice, in one place: libjpeg-turbo through PyTurboJPEG, Pillow as fallback.

PyTurboJPEG 1.x binds the system libjpeg-turbo (apt ``libturbojpeg0``); where the library is
missing, packer warns once and uses Pillow, which bundles its own libjpeg(-turbo). Reading a
crop of a record, packer decodes only the crop's rows and columns when its small libjpeg binding
(``packer/_native.c``, built at install where a compiler and libjpeg's headers are present) is
there: neither PyTurboJPEG 1.x nor Pillow can, and a training crop covers under half of a record
on average (the saving: docs/PERFORMANCE.md, "What changed").
"""

from __future__ import annotations

import importlib
import io
import sys
from functools import cache
from typing import Any, Optional

import numpy as np
from PIL import Image

# Crop-on-decode through libjpeg (packer/_native.c), or None where it could not be compiled. Any: the
# compiled module has no stub, and its callers check can_decode_region()/native_shrink() first.
_native: Any
try:
    _native = importlib.import_module("._native", __package__)
except ImportError:
    _native = None


@cache
def turbojpeg():
    """The process's TurboJPEG instance, or None (after a one-line warning) when unavailable.

    PyTurboJPEG reports libjpeg's warnings (truncated data, corrupt segments) with warnings.warn and
    returns the grey-padded image; turning them into errors would take the warnings filters, which
    are process-wide and not thread-safe. This instance raises them as OSError in the calling thread,
    as fatal errors are (PyTurboJPEG 1.x reports both through one private method).
    """
    try:
        from turbojpeg import TurboJPEG

        class StrictTurboJPEG(TurboJPEG):
            def _TurboJPEG__report_error(self, handle: Any) -> None:
                raise OSError(self._TurboJPEG__get_error_string(handle))

        if not hasattr(TurboJPEG, "_TurboJPEG__report_error"):
            raise ImportError("this PyTurboJPEG cannot raise libjpeg's warnings (packer needs 1.x)")
        return StrictTurboJPEG()
    except Exception as e:  # ImportError, or OSError/RuntimeError when libturbojpeg is missing
        print(f"packer: warning: libjpeg-turbo unavailable ({e}); using Pillow for JPEG", file=sys.stderr)
        return None


def native_shrink() -> bool:
    """Whether builds shrink decoded JPEGs with packer's own Lanczos kernel (packer/_resize.c: built,
    and this CPU has AVX2) rather than Pillow's: it reads the decoded pixels in place, where Pillow
    needs them copied into its layout and out again (docs/PERFORMANCE.md, "Build speed")."""
    return turbojpeg() is not None and _native is not None and bool(_native.RESIZE_VECTOR)


def codec_name() -> str:
    """Recorded in the manifest: record bytes (and so the digest) depend on the decoder, the resize
    and the encoder builds."""
    import PIL

    if turbojpeg() is None:
        return f"pillow-{PIL.__version__}"
    return "turbojpeg, resize " + ("packer" if native_shrink() else f"pillow-{PIL.__version__}")


def encode_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    """Encode a C-contiguous H x W x 3 uint8 array as baseline JPEG, 4:2:0, at ``quality``."""
    tj = turbojpeg()
    if tj is not None:
        from turbojpeg import TJPF_RGB, TJSAMP_420

        return tj.encode(rgb, quality=quality, pixel_format=TJPF_RGB, jpeg_subsample=TJSAMP_420)
    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="JPEG", quality=quality, subsampling="4:2:0")
    return out.getvalue()


def scaled_size(width: int, height: int, factor: tuple[int, int]) -> tuple[int, int]:
    """The size libjpeg produces for a DCT scaling ``factor`` (it rounds up)."""
    num, den = factor
    return -(-width * num // den), -(-height * num // den)


def shrink_factor(width: int, height: int, min_short: int) -> tuple[int, int]:
    """The smallest DCT scaling factor (<= 1) whose output keeps the short edge >= ``min_short``.

    libjpeg-turbo scales in eighths (1/8, 1/4, 3/8, ... 7/8); decoding straight to the smallest one
    skips most of the IDCT and colour-conversion work for pixels a downscale would throw away.
    """
    tj = turbojpeg()
    factors = tj.scaling_factors if tj is not None else ((1, 8), (1, 4), (1, 2), (1, 1))
    best = (1, 1)
    for f in factors:
        if f[0] <= f[1] and f[0] * best[1] < best[0] * f[1] and min(scaled_size(width, height, f)) >= min_short:
            best = f
    return best


def decode_jpeg(
    data: bytes | memoryview,
    *,
    width: int,
    height: int,
    factor: tuple[int, int] = (1, 1),
    rgbx: bool = False,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Decode a whole JPEG of ``width`` x ``height`` pixels (its header's, or the index's) to an
    H x W x 3 uint8 RGB array (x 4 RGBX with ``rgbx``), DCT-scaled by ``factor``. The size is
    keyword-only: width-then-height here and height-then-width in an array shape are easy to swap.

    RGBX is Pillow's own pixel layout, so a Pillow image can map the result without converting it.
    ``out`` is the destination when it has the decoded shape and is C-contiguous (saves an allocation
    per call). Damage raises ValueError, including what libjpeg only warns about (truncated data,
    corrupt segments: no grey-padded pixels), as does data of another size. Safe in any number of
    threads: packer's libjpeg binding (where built) has its own error handler per call, and the
    fallback, PyTurboJPEG, raises libjpeg's warnings itself (:func:`turbojpeg`) rather than through
    the process-wide warnings filters. Without turbojpeg, Pillow's draft() gives the power-of-two scales.
    """
    w, h = scaled_size(width, height, factor)
    shape = (h, w, 4 if rgbx else 3)
    if out is None or out.shape != shape or not out.flags.c_contiguous:
        out = np.empty(shape, np.uint8)
    tj = turbojpeg()
    if can_decode_region():
        img, (_, _, decoded) = out, decode_jpeg_region(data, factor, 0, 0, h, w, rgbx, out.reshape(-1))
    elif tj is not None:
        from turbojpeg import TJPF_RGB, TJPF_RGBX

        try:
            img = tj.decode(data, pixel_format=TJPF_RGBX if rgbx else TJPF_RGB, scaling_factor=factor, dst=out)
        except OSError as e:
            raise ValueError(f"corrupt JPEG data ({e})") from None
        decoded = img.shape[1], img.shape[0]
    else:
        try:
            im = Image.open(io.BytesIO(data))
            if factor != (1, 1):  # draft picks scale w // requested: ask for the rounded-down size
                im.draft("RGB", (im.width * factor[0] // factor[1], im.height * factor[0] // factor[1]))
            img = np.asarray(im.convert("RGBX" if rgbx else "RGB"))
        except (OSError, SyntaxError) as e:  # Pillow's ways of saying the data is bad
            raise ValueError(f"corrupt JPEG data ({e})") from None
        decoded = img.shape[1], img.shape[0]
    if decoded != (w, h):
        raise ValueError(f"corrupt JPEG data (decodes to {decoded[0]}x{decoded[1]}, expected {w}x{h})")
    return img


def can_decode_region() -> bool:
    """Whether :func:`decode_jpeg_region` is available (the compiled binding imported)."""
    return _native is not None


def decode_jpeg_region(
    data: bytes | memoryview,
    factor: tuple[int, int],
    top: int,
    left: int,
    height: int,
    width: int,
    rgbx: bool,
    out: np.ndarray,
) -> tuple[np.ndarray, int, tuple[int, int]]:
    """Rows ``[top, top + height)`` and at least columns ``[left, left + width)`` of the image as
    DCT-scaled by ``factor``, decoded into the flat uint8 buffer ``out`` (rows below are never
    decoded, rows above only entropy-decoded). Returns (band, x_offset, (image_width, image_height)):
    the band is ``height`` rows of iMCU-aligned columns starting at ``x_offset``, pixel for pixel what
    a full decode gives there, except within a pixel or two of the band's cut edges (fancy
    upsampling sees no neighbours there). Damage, including what libjpeg only warns about, raises
    ValueError."""
    channels = 4 if rgbx else 3
    try:
        x_offset, band_width, image_width, image_height = _native.decode_crop(
            data, top, left, height, width, factor[0], factor[1], channels, out
        )
    except ValueError as e:
        raise ValueError(f"corrupt JPEG data ({e})") from None
    band = out[: height * band_width * channels].reshape(height, band_width, channels)
    return band, x_offset, (image_width, image_height)
