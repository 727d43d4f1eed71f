"""packer.codec: whole-JPEG decodes refuse damaged data in any thread, through each decoder."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from packer import codec


@pytest.mark.parametrize("decoder", ["packer", "turbojpeg"])
def test_truncated_jpegs_raise_in_every_thread(decoder: str, monkeypatch) -> None:
    """libjpeg only warns about a truncated JPEG (and pads it grey). decode_jpeg raises for it in
    every thread, decodes whole ones exactly, and leaves the process's warnings alone: another
    thread's own warning stays a warning, and the filters are never touched (they are process-wide,
    so switching them to "error" per call raced: a truncated record could come back grey, or an
    unrelated thread's warning raise)."""
    if decoder == "packer" and not codec.can_decode_region():
        pytest.skip("packer._native not built (no C compiler or libjpeg headers when packer was installed)")
    if decoder == "turbojpeg":
        if codec.turbojpeg() is None:
            pytest.skip("PyTurboJPEG or libturbojpeg not installed")
        monkeypatch.setattr(codec, "_native", None)
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    good = codec.encode_jpeg(pixels, 90)
    truncated = good[: len(good) * 2 // 3]
    want = codec.decode_jpeg(good, width=160, height=120)
    with pytest.raises(ValueError, match="corrupt JPEG data"):
        codec.decode_jpeg(truncated, width=160, height=120)
    with pytest.raises(
        ValueError, match=r"corrupt JPEG data \((decodes to 160x120, expected|crop .* the 160x120 image)"
    ):
        codec.decode_jpeg(good, width=161, height=120)  # the size the index or header said is not the data's

    def work(k: int) -> str:
        if k % 3 == 0:
            try:
                codec.decode_jpeg(truncated, width=160, height=120, rgbx=k % 2 == 0)
            except ValueError:
                return "refused"
            return "decoded a truncated JPEG"
        if k % 3 == 1:
            same = np.array_equal(codec.decode_jpeg(good, width=160, height=120), want)
            return "decoded" if same else "wrong pixels"
        warnings.warn("another thread's warning", UserWarning, stacklevel=1)
        return "warned"

    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(work, range(1200)))
    assert warnings.filters == filters
    assert {o: outcomes.count(o) for o in set(outcomes)} == {"refused": 400, "decoded": 400, "warned": 400}
    # a socket an earlier test left open may be collected in any thread meanwhile: its ResourceWarning is not ours
    caught = [w for w in caught if not issubclass(w.category, ResourceWarning)]
    assert len(caught) == 400 and all(str(w.message) == "another thread's warning" for w in caught)
