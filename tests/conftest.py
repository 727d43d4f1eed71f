"""Shared fixtures: the real photos in tests/data laid out as an ImageFolder, and datasets built from them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# 18 real photos covering every EXIF orientation flag, downscaled, with their licence (see its README.md).
PHOTOS = Path(__file__).resolve().parent / "data" / "exif-orientation"


@pytest.fixture(scope="session")
def raw_photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """landscape/ and portrait/ class folders holding copies of the 18 EXIF-orientation photos."""
    raw = tmp_path_factory.mktemp("raw")
    for f in sorted(PHOTOS.glob("*.jpg")):
        cls = "landscape" if f.name.startswith("Landscape") else "portrait"
        (raw / cls).mkdir(exist_ok=True)
        shutil.copyfile(f, raw / cls / f.name)
    return raw


@pytest.fixture(scope="session")
def built(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory):
    """Build (once per session) a dataset for a (backend, format) pair; returns its path."""
    from packer import build

    root = tmp_path_factory.mktemp("built")
    cache: dict[tuple[str, str], Path] = {}

    def get(backend: str, fmt: str) -> Path:
        if (backend, fmt) not in cache:
            out = root / (f"{fmt}.lmdb" if backend == "lmdb" else f"{fmt}-memmap")
            build(raw_photos, out, backend=backend, format=fmt, workers=1, quiet=True, shard_size=7)
            cache[backend, fmt] = out
        return cache[backend, fmt]

    return get


COMBOS = [("lmdb", "jpeg"), ("lmdb", "raw"), ("memmap", "jpeg"), ("memmap", "raw")]
