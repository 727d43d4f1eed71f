"""Synthetic camera sample: layout, EXIF orientation semantics, determinism, default 12 MP size."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from packer.tools.sample import INVERSE_ORIENTATION, main, make_sample, render_photo

SMALL = (160, 120)  # landscape W x H; small so the suite stays fast


def _upright_is_portrait(path: Path) -> bool:
    with Image.open(path) as im:
        w, h = ImageOps.exif_transpose(im).size
    return h > w


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_sample(tmp_path_factory.mktemp("s"), per_class=5, size=SMALL, seed=7)


def test_layout_and_names(sample: list[Path]) -> None:
    assert len(sample) == 15
    assert all(p.is_file() for p in sample)
    assert [p.parent.name for p in sample] == ["cat"] * 5 + ["dog"] * 5 + ["ship"] * 5
    assert [p.name for p in sample] == [f"IMG_{i:04d}.jpg" for i in range(1, 16)]
    with Image.open(sample[0]) as im:
        assert im.format == "JPEG" and im.mode == "RGB"


def test_exif_tags_cycle(sample: list[Path]) -> None:
    tags = []
    for p in sample:
        with Image.open(p) as im:
            exif = im.getexif()
        tags.append(exif[0x0112])
        assert exif[0x010F] and exif[0x0110] and exif[0x0132]  # Make, Model, DateTime
    assert tags == [i % 8 + 1 for i in range(15)]


def test_stored_and_upright_sizes(sample: list[Path]) -> None:
    """Tags 5..8 swap the stored axes; upright aspect alternates landscape/portrait per class."""
    w, h = SMALL
    for i, p in enumerate(sample):
        k = i % 5  # index within the class
        portrait = k % 2 == 1
        upright = (h, w) if portrait else (w, h)
        with Image.open(p) as im:
            o = im.getexif()[0x0112]
            stored = im.size
            assert ImageOps.exif_transpose(im).size == upright
        assert stored == (upright[::-1] if o >= 5 else upright)
        assert _upright_is_portrait(p) == portrait


@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_transpose_recovers_scene(orientation: int) -> None:
    """The stored pixels are the inverse transform of the upright scene, as a camera writes them.

    Compare at thumbnail scale so the (stored-coordinate) sensor noise averages out, and check
    that the scene is asymmetric enough that a wrong transform would have been caught.
    """
    kw: dict[str, Any] = {"portrait": orientation % 2 == 0, "size": (400, 300), "seed": (3, orientation)}
    ref = render_photo(1, orientation=1, **kw)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = render_photo(1, orientation=orientation, **kw)
    stored.save(buf, "JPEG", quality=92, exif=exif.tobytes())
    got = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue())))
    assert got.size == ref.size

    def small(im: Image.Image) -> np.ndarray:
        return np.asarray(im.resize((40, 40), Image.Resampling.BOX), dtype=np.float64)

    err = np.abs(small(got) - small(ref)).mean()
    assert err < 3.0, err
    right = INVERSE_ORIENTATION[orientation]
    wrong = [t for t in INVERSE_ORIENTATION.values() if t is not None and t is not right]
    for t in wrong:  # any other transform of the upright scene is clearly different
        other = got.transpose(t)
        if other.size == ref.size:
            assert np.abs(small(other) - small(ref)).mean() > 3 * err + 2.0


def test_deterministic_bytes(tmp_path: Path) -> None:
    a = make_sample(tmp_path / "a", per_class=2, size=SMALL, seed=11)
    b = make_sample(tmp_path / "b", per_class=2, size=SMALL, seed=11)
    c = make_sample(tmp_path / "c", per_class=2, size=SMALL, seed=12)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert [p.read_bytes() for p in a] != [p.read_bytes() for p in c]


def test_classes_differ_in_colour(sample: list[Path]) -> None:
    """Each class has its own dominant hue, so even a tiny CNN can separate them."""
    means = []
    for cls in range(3):
        files = sample[cls * 5 : cls * 5 + 5]
        arrs = [np.asarray(ImageOps.exif_transpose(Image.open(p)).resize((32, 32))) for p in files]
        means.append(np.mean(arrs, axis=(0, 1, 2)))
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.abs(means[i] - means[j]).max() > 25


def test_default_size_is_12mp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One full-size camera file: 4000x3000, a few MB. Timing is reported, not asserted."""
    t = time.perf_counter()
    (p,) = make_sample(tmp_path, classes=("cat",), per_class=1)
    dt = time.perf_counter() - t
    with Image.open(p) as im:
        assert im.size == (4000, 3000) and im.getexif()[0x0112] == 1
    mb = p.stat().st_size / 1e6
    assert 1.5 < mb < 6.0, mb
    with capsys.disabled():
        print(f"\n12 MP sample image: {dt:.3f} s, {mb:.2f} MB")


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path), "--per-class", "1", "--size", "64x48", "--seed", "2"])
    files = sorted(tmp_path.glob("*/*.jpg"))
    assert [f.parent.name for f in files] == ["cat", "dog", "ship"]
    with Image.open(files[0]) as im:
        assert im.size == (64, 48)
    assert "wrote 3 images" in capsys.readouterr().out
