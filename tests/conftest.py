"""Shared fixtures: the real photos in tests/data laid out as an ImageFolder, and datasets built from them."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from packer.backends import BACKENDS
from packer.format.records import FORMATS

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


#: The backend contract suite's parameters, from packer's own tables: every backend and every record
#: format (a new one is tested by adding it there), every (backend, format) pair, and a cheaper cover
#: that has each backend and each format once, for tests too slow to run on every pair.
BACKEND_NAMES, FORMAT_NAMES = tuple(BACKENDS), tuple(FORMATS)
COMBOS = list(itertools.product(BACKEND_NAMES, FORMAT_NAMES))
_PAIRS = max(len(BACKEND_NAMES), len(FORMAT_NAMES))
ONE_EACH = [(BACKEND_NAMES[i % len(BACKEND_NAMES)], FORMAT_NAMES[i % len(FORMAT_NAMES)]) for i in range(_PAIRS)]
