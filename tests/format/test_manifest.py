"""Reading manifest.json: a small manifest costs small memory, an oversized one is still refused."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from packer import format
from packer.format import MANIFEST, DatasetError, Manifest


def test_reading_a_manifest_allocates_about_its_size_not_the_limit(built) -> None:
    out = built("memmap", "jpeg")
    size = (out / MANIFEST).stat().st_size
    Manifest.load(out)  # imports and caches warmed up
    tracemalloc.start()
    try:
        Manifest.load(out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * size + (1 << 20) < format.MAX_MANIFEST


def test_a_manifest_over_the_limit_is_refused(built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = built("memmap", "jpeg")
    text = (out / MANIFEST).read_bytes()
    (tmp_path / MANIFEST).write_bytes(text + b" " * 100)  # trailing JSON whitespace: still a valid manifest
    monkeypatch.setattr(format, "MAX_MANIFEST", len(text) + 50)
    with pytest.raises(DatasetError, match="manifest is over"):
        Manifest.load(tmp_path)
