"""packer's C extension at its edges: what the fuzzer (scripts/fuzz_native.py, run under ASan/UBSan by
``make test-sanitize``) found, kept as plain regression tests, and a short fuzz of the installed build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from packer import codec

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
