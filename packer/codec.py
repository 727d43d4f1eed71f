"""The JPEG codec choice, in one place: libjpeg-turbo through PyTurboJPEG, Pillow as fallback.

PyTurboJPEG 1.x binds the system libjpeg-turbo (apt ``libturbojpeg0``); where the library is
missing, packer warns once and uses Pillow, which bundles its own libjpeg(-turbo).
"""

from __future__ import annotations

import io
import sys
from functools import lru_cache

import numpy as np
from PIL import Image


@lru_cache(maxsize=None)
def turbojpeg():
    """The process's TurboJPEG instance, or None (after a one-line warning) when unavailable."""
    try:
        from turbojpeg import TurboJPEG

        return TurboJPEG()
    except Exception as e:  # ImportError, or OSError/RuntimeError when libturbojpeg is missing
        print(f"packer: warning: libjpeg-turbo unavailable ({e}); using Pillow for JPEG", file=sys.stderr)
        return None


def codec_name() -> str:
    """Recorded in the manifest: JPEG bytes (and so the digest) depend on the encoder build."""
    import PIL

    tj = turbojpeg()
    return "turbojpeg" if tj is not None else f"pillow-{PIL.__version__}"


def encode_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    """Encode a C-contiguous H x W x 3 uint8 array as baseline JPEG, 4:2:0, at ``quality``."""
    tj = turbojpeg()
    if tj is not None:
        from turbojpeg import TJPF_RGB, TJSAMP_420

        return tj.encode(rgb, quality=quality, pixel_format=TJPF_RGB, jpeg_subsample=TJSAMP_420)
    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="JPEG", quality=quality, subsampling="4:2:0")
    return out.getvalue()
