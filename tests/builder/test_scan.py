"""The scan's compact source list (packer.builder.scan.Paths / Sources): what consumers read from it, and the
digests it feeds, equal those of the one-object-per-file list it replaced."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer.builder import scan as scan_module
from packer.builder.labels import Labelling
from packer.builder.scan import Paths, Source, Sources, scan

ODD = os.fsdecode(b"\xff\xfe odd.jpg")  # not UTF-8: kept as surrogate escapes, as os.scandir gives it
RELS = ["a/1.jpg", "a/2.jpg", "b/ému.jpg", f"b/{ODD}", "c/x/deep.jpg"]


@pytest.fixture(params=[3, 1 << 16], ids=["small-chunks", "default-chunks"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Lazy iteration works in chunks: also run with chunks smaller than the lists, so items cross them."""
    monkeypatch.setattr(scan_module, "_CHUNK", request.param)
    return int(request.param)


def test_paths_read_back_as_given(chunk: int) -> None:
    paths = Paths.of(RELS)
    assert len(paths) == len(RELS) and list(paths) == RELS
    assert [paths[i] for i in range(-len(RELS), len(RELS))] == RELS + RELS
    assert paths.encoded(3) == RELS[3].encode("utf-8", "surrogateescape")
    assert list(paths[1:4]) == RELS[1:4] and list(paths[4:2]) == [] and list(paths[3:]) == RELS[3:]
    with pytest.raises(IndexError):
        paths[len(RELS)]


@pytest.mark.parametrize(
    "mask", [[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], ids=["some", "none", "all", "last"]
)
def test_select_keeps_the_masked_items(mask: list[int], chunk: int) -> None:
    keep = np.array(mask, dtype=bool)
    expected = [rel for rel, k in zip(RELS, mask) if k]
    assert list(Paths.of(RELS).select(keep)) == expected
    assert list(Paths.of(RELS)[1:].select(keep[1:])) == expected[1 if mask[0] else 0 :]  # a slice's own range
    sources = Sources(Paths.of(RELS), np.arange(len(RELS), dtype=np.int32))
    assert list(sources.select(keep)) == [Source(r, i) for i, (r, k) in enumerate(zip(RELS, mask)) if k]


def test_sources_items_and_slices(chunk: int) -> None:
    labels = np.array([0, 0, 1, 1, -1], dtype=np.int32)
    sources = Sources(Paths.of(RELS), labels)
    expected = [Source(r, int(label)) for r, label in zip(RELS, labels)]
    assert list(sources) == expected and [sources[i] for i in range(len(sources))] == expected
    assert list(sources[2:]) == expected[2:] and sources.rel(3) == RELS[3]
    assert all(type(s.label) is int for s in sources)


def _photo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 20), (9, 99, 199)).save(path, "JPEG")


def test_fingerprint_is_the_per_source_definition(tmp_path: Path, chunk: int) -> None:
    """The digests that ``inputs`` and --resume compare are defined per source as
    f"{rel}\\0{label}\\n"; the chunked computation must give exactly that (datasets built before stay
    up to date)."""
    raw = tmp_path / "raw"
    for rel in RELS[:-1] + ["top.jpg"]:
        _photo(Path(os.fsdecode(os.fsencode(str(raw)) + b"/" + rel.encode("utf-8", "surrogateescape"))))
    found = scan(raw)
    assert list(found.sources) == [Source(r, i) for r, i in zip(RELS[:-1], [0, 0, 1, 1])]
    assert found.ignored == [("top.jpg", "not inside a class folder")]
    h = hashlib.sha256()
    for s in found.sources:
        h.update(f"{s.rel}\0{s.label}\n".encode("utf-8", "surrogateescape"))
    h.update("\0".join(found.classes).encode("utf-8", "surrogateescape"))
    assert found.fingerprint() == h.hexdigest()


def test_pinned_classes_reject_per_folder(tmp_path: Path) -> None:
    """A class folder not in --classes: each of its files skipped with the reason, or the first one an
    error with --on-error fail; an empty folder is no class."""
    raw = tmp_path / "raw"
    for rel in ["a/1.jpg", "b/1.jpg", "b/2.jpg", "c/1.jpg"]:
        _photo(raw / rel)
    (raw / "empty").mkdir()
    (tmp_path / "classes.txt").write_text("c\na\n")
    labelling = Labelling(classes=str(tmp_path / "classes.txt"))
    found = scan(raw, labelling=labelling)
    assert found.classes == ["c", "a"]
    assert list(found.sources) == [Source("a/1.jpg", 1), Source("c/1.jpg", 0)]
    why = f"class folder 'b' is not in --classes {tmp_path / 'classes.txt'}"
    assert found.missing == [("b/1.jpg", why), ("b/2.jpg", why)]
    with pytest.raises(scan_module.ScanError, match=f"{raw / 'b'}/: {why}"):
        scan(raw, labelling=labelling, strict=True)
    assert scan(raw).classes == ["a", "b", "c"]
