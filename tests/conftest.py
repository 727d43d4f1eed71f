"""Shared fixtures: the real photos in tests/data laid out as an ImageFolder, datasets built from them,
and a real S3 server (SeaweedFS on 127.0.0.1, tests/store/seaweed.py) started once per test session when
a test first asks for it, with the fault proxy in front of it (tests/store/proxy.py)."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from packer.backends import BACKENDS
from packer.format.records import FORMATS

from .store.proxy import Proxy, start
from .store.seaweed import S3Server, seaweed

# the node cache's lock discipline checked in every test, and in the DataLoader workers and ranks they
# start (they inherit it): a wait under a node lock, or node locks out of order, fails (packer.read.remote)
os.environ.setdefault("PACKER_LOCK_CHECK", "1")

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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The server, with AWS_* set in this process's environment (DataLoader workers inherit it)."""
    with seaweed(tmp_path_factory.mktemp("seaweedfs")) as server:
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def _proxy_server(s3_server: S3Server) -> Iterator[Proxy]:
    proxy, server = start(s3_server.endpoint)
    yield proxy
    server.shutdown()


@pytest.fixture
def proxy(_proxy_server: Proxy, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    """The fault proxy in front of the server, as this test's (and its workers') S3 endpoint; the
    requests of an earlier test's background downloads are let finish before its counts clear."""
    _proxy_server.settle()
    _proxy_server.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", _proxy_server.url)
    yield _proxy_server
    _proxy_server.clear()


@pytest.fixture(scope="session")
def class_sorted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real memmap dataset of 16 classes x 48 small photos, stored class by class (as every build
    of a class-folder tree is)."""
    from PIL import Image

    from packer import build

    raw = tmp_path_factory.mktemp("sorted") / "raw"
    rng_ = np.random.default_rng(0)
    for c in range(16):
        (raw / f"c{c:02}").mkdir(parents=True)
        for k in range(48):
            pixels = rng_.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(raw / f"c{c:02}" / f"{k:03}.jpg", quality=80)
    out = raw.parent / "sorted.memmap"
    build(raw, out, backend="memmap", quiet=True, workers=1)
    return out
