"""Published datasets on the real S3 server for the tools tests: three versions of one dataset (a
first build; a refresh that adds a photo, reusing the first's data files; a rebuild at another
quality, whose data files have the same names and other bytes) published one after another."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from packer import build
from packer.store import open_store

from ..store.seaweed import S3Server
from .published import publish


@dataclass
class Versions:
    url: str
    ids: list[str]  # oldest first; the last one is current
    local: list[Path]  # each version's local dataset


@pytest.fixture(scope="session")
def three_builds(raw_photos: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The three versions built locally, once (memmap, 3-4 shards of 7)."""
    root = tmp_path_factory.mktemp("versions")
    raw = root / "raw"
    shutil.copytree(raw_photos, raw)
    options = {"backend": "memmap", "format": "jpeg", "workers": 1, "quiet": True, "shard_size": 7}
    first, refreshed, rebuilt = root / "v1", root / "v2", root / "v3"
    build(raw, first, **options)
    shutil.copytree(first, refreshed)
    photo = sorted((raw / "portrait").iterdir())[0]
    shutil.copyfile(photo, raw / "portrait" / f"again-{photo.name}")
    build(raw, refreshed, update=True, **options)
    build(raw, rebuilt, quality=70, **options)
    return [first, refreshed, rebuilt]


@pytest.fixture
def versions(three_builds: list[Path], s3_server: S3Server, tmp_path: Path) -> Versions:
    """The three versions published one after another at a URL of this test's own."""
    url = f"s3://{s3_server.bucket}/tools/{tmp_path.name}"
    store = open_store(url)
    return Versions(url, [publish(store, p) for p in three_builds], three_builds)
