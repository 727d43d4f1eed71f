"""Damaged and hostile datasets: opening one gives a DatasetError or verify names the damage; nothing
else escapes, nothing crashes, nothing is unpickled.

Reads that could fault (a truncated data.mdb is memory-mapped) run in a subprocess, so a SIGBUS or
SIGSEGV fails the test instead of killing pytest. Property-based tests flip bytes of the index, the
records and the manifest with hypothesis; example counts stay small to keep the suite quick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from packer import build, codec
from packer.format import INDEX, MANIFEST, SOURCES, DatasetError, Manifest, load_index, source_path
from packer.read.reader import open_reader
from packer.tools.verify import verify

from ..conftest import FORMAT_NAMES

PACKER = [sys.executable, "-m", "packer.cli"]
KINDS = [("lmdb", "jpeg"), ("memmap", "jpeg"), ("memmap", "raw")]  # fuzzing: every backend and format, not every pair
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Small intact datasets (20 records, 3 classes, memmap shards of 7) built once per kind."""
    base = tmp_path_factory.mktemp("pristine")
    raw = base / "raw"
    rng = np.random.default_rng(3)
    for i in range(20):
        path = raw / f"c{i % 3}" / f"im{i:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24 + i, 32, 3), dtype=np.uint8)).save(path)
    built: dict[tuple[str, str], Path] = {}

    def get(backend: str, fmt: str) -> Path:
        if (backend, fmt) not in built:
            out = base / f"{backend}-{fmt}"
            build(raw, out, backend=backend, format=fmt, workers=1, quiet=True, shard_size=7)
            built[backend, fmt] = out
        return built[backend, fmt]

    return get


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def open_and_read_all(root: Path) -> None:
    """What a training job does: load manifest and index, then fetch every record."""
    manifest = Manifest.load(root)
    index, _ = load_index(root, manifest)
    reader = open_reader(root, manifest, index)
    for i in range(len(index)):
        bytes(reader.get(i))


def outcome(root: Path) -> str:
    """'refused' (DatasetError on open or read or from verify), 'reported' (verify found damage) or 'ok'."""
    try:
        open_and_read_all(root)
        result = verify(root)
    except DatasetError:
        return "refused"
    return "ok" if result.ok else "reported"


def isolated(check: Callable[[Path], str], root: Path) -> str:
    """``check(root)`` in a forked child, so that a memory fault (SIGBUS, SIGSEGV) fails the test
    instead of killing pytest; returns what it returned, or the repr of the exception it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and leave without running pytest's cleanup
        try:
            answer = check(root)
        except BaseException as e:
            answer = repr(e)
        os.write(write_end, answer.encode("utf-8", "replace"))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = f.read().decode("utf-8")
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"{check.__name__} on a damaged dataset crashed: signal {os.WTERMSIG(status)}"
    return answer


def verify_outcome(root: Path) -> str:
    """Like `outcome` for ``packer verify`` alone: the verify-then-trust gate for untrusted data."""
    try:
        return "ok" if verify(root).ok else "reported"
    except DatasetError:
        return "refused"


def cli_verify(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(PACKER + ["verify", str(root)], capture_output=True, text=True, timeout=60)


# --- truncated data files --------------------------------------------------------------------------


def test_truncated_data_mdb_is_refused_not_a_sigbus(pristine, tmp_path: Path) -> None:
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "d.lmdb")
    data = root / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    assert isolated(outcome, root) == "refused"
    with pytest.raises(DatasetError, match=r"data.mdb.*(is truncated|beyond EOF or truncated)"):
        open_and_read_all(root)
    run = cli_verify(root)
    assert run.returncode == 1 and "truncated" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_truncated_shard_is_refused_and_verify_names_the_records(pristine, tmp_path: Path, fmt: str) -> None:
    root = copy(pristine("memmap", fmt), tmp_path / "d")
    shard = root / "shard-00001.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    assert isolated(outcome, root) == "refused"
    with pytest.raises(DatasetError, match="shard is truncated"):
        open_and_read_all(root)
    result = verify(root)
    assert not result.ok and result.bad_records == 1  # only the last record of shard 1 lost bytes
    manifest = Manifest.load(root)
    index, sources = load_index(root, manifest)
    assert any(f"record 13 ({source_path(sources, index[13])})" in p for p in result.problems), result.problems
    run = cli_verify(root)
    assert run.returncode == 1 and "record 13 (" in run.stderr and "shard-00001.bin" in run.stderr


# --- index rows pointing out of range ---------------------------------------------------------------


def set_index(root: Path, field: str, row: int, value: int) -> None:
    index = np.load(root / INDEX, allow_pickle=False)
    index[field][row] = value
    np.save(root / INDEX, index, allow_pickle=False)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("offset", 2**40, "points outside its shard"),
        ("length", 2**40, "points outside its shard"),
        ("offset", 2**64 - 1, "points outside its shard"),  # offset + length wraps around
        ("shard", 99, "beyond the 3 listed"),
        ("label", 7, "labels outside"),
        ("label", -1, "labels outside"),
        ("src_offset", 10**6, f"outside {SOURCES}"),
        ("src_length", 2**32 - 1, f"outside {SOURCES}"),
        ("height", 0, "zero size"),
    ],
)
def test_index_out_of_range_is_refused_on_open(pristine, tmp_path: Path, field: str, value: int, message: str) -> None:
    root = copy(pristine("memmap", "jpeg"), tmp_path / "d")
    set_index(root, field, 5, value)
    with pytest.raises(DatasetError, match=message):
        open_and_read_all(root)
    run = cli_verify(root)
    assert run.returncode == 1 and message.split()[0] in run.stderr and "Traceback" not in run.stderr


def test_lmdb_index_with_bad_keys_or_wrong_length_is_refused(pristine, tmp_path: Path) -> None:
    """Version 3 LMDB rows name (segment, key): a key its file cannot hold is refused on open, one it
    does not hold when read, another record's key by its length, and verify names both records."""
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "a.lmdb")
    set_index(root, "offset", 3, 10**9)
    with pytest.raises(DatasetError, match="record 3: key beyond"):
        open_and_read_all(root)
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "k.lmdb")
    set_index(root, "offset", 3, 1000)
    with pytest.raises(DatasetError, match=r"record 3: missing from data\.mdb"):
        open_and_read_all(root)
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "s.lmdb")
    set_index(root, "shard", 3, 1)
    with pytest.raises(DatasetError, match="beyond the 1 listed"):
        open_and_read_all(root)
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "b.lmdb")
    set_index(root, "length", 3, np.load(root / INDEX)[3]["length"] + 1)
    with pytest.raises(DatasetError, match="record 3: has"):
        open_and_read_all(root)
    assert "record 3 (" in verify(root).problems[0]


def test_raw_record_size_must_match_its_length(pristine, tmp_path: Path) -> None:
    root = copy(pristine("memmap", "raw"), tmp_path / "d")
    set_index(root, "width", 2, np.load(root / INDEX)[2]["width"] + 1)
    with pytest.raises(DatasetError, match="record 2: length does not match"):
        open_and_read_all(root)


# --- manifest -------------------------------------------------------------------------------------


def tamper_manifest(root: Path, change: Callable[[dict], object]) -> None:
    data = json.loads((root / MANIFEST).read_text())
    result = change(data)
    (root / MANIFEST).write_text(result if isinstance(result, str) else json.dumps(data))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.update(format_version=5), "format_version 5 is not supported"),
        (lambda m: m.update(format_version=4), "field fields is invalid"),  # version 4 declares fields
        (lambda m: m.update(fields=[{"name": "x", "kind": "text", "dtype": "utf-8"}]), "field fields is invalid"),
        (lambda m: m.update(format_version=True), "format_version True is not supported"),
        (lambda m: m.update(label_kind="regression"), "field label_kind is invalid"),
        (lambda m: m.update(targets=["a", "a"]), "field targets is invalid"),
        (lambda m: m.update(format_version=1, targets=["a"]), "field targets is invalid"),
        (lambda m: m.pop("format_version"), "format_version None is not supported"),
        (lambda m: '{"format_version": 1, "count": ', "unreadable manifest"),
        (lambda m: "[1, 2, 3]", "not a JSON object"),
        (lambda m: "\udcff".encode("utf-8", "surrogateescape").decode("latin-1"), "unreadable manifest"),
        (lambda m: "[" * 100_000 + "]" * 100_000, "unreadable manifest"),  # nesting bomb: RecursionError
        (lambda m: m.pop("classes"), "missing fields"),
        (lambda m: m.update(count="18"), "field count is invalid"),
        (lambda m: m.update(count=-1), "field count is invalid"),
        (lambda m: m.update(count=10**30), "field count is invalid"),
        (lambda m: m.update(count=True), "field count is invalid"),
        (lambda m: m.update(count=21), "index has 20 rows, manifest says 21"),
        (lambda m: m.update(backend="pickle"), "field backend is invalid"),
        (lambda m: m.update(classes=["a", 1, "c"]), "field classes is invalid"),
        (lambda m: m.update(class_counts=[20]), "field class_counts is invalid"),
        (lambda m: m["shards"][0].update(file="../../../etc/passwd"), "field shards is invalid"),
        (lambda m: m["shards"][0].update(file=".hidden"), "field shards is invalid"),
        (lambda m: m["shards"][0].update(file="a\x00b"), "field shards is invalid"),
        (lambda m: m["shards"][0].update(bytes=-5), "field shards is invalid"),
        (lambda m: m["shards"][0].update(bytes=10), "points outside its shard"),
    ],
)
def test_tampered_manifest_is_refused(pristine, tmp_path: Path, change, message: str) -> None:
    root = copy(pristine("memmap", "jpeg"), tmp_path / "d")
    tamper_manifest(root, change)
    with pytest.raises(DatasetError, match=message):
        open_and_read_all(root)
    run = cli_verify(root)
    assert run.returncode == 1 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "change,problem",
    [
        (lambda m: m.update(digest="sha256:" + "0" * 64), "dataset digest"),
        (lambda m: m.update(class_counts=[1, 2, 17]), "class_counts"),
        (lambda m: m.update(scanned=99), "scanned 99"),
        (lambda m: m["shards"][0].update(count=6), "data file record counts"),
    ],
)
def test_manifest_inconsistent_with_the_data_is_reported_by_verify(
    pristine, tmp_path: Path, change, problem: str
) -> None:
    root = copy(pristine("memmap", "jpeg"), tmp_path / "d")
    tamper_manifest(root, change)
    open_and_read_all(root)  # nothing a reader needs is wrong; verify is what catches it
    result = verify(root)
    assert not result.ok and any(problem in p for p in result.problems), result.problems
    assert cli_verify(root).returncode == 1


def test_missing_files_are_refused(pristine, tmp_path: Path) -> None:
    for name in (MANIFEST, INDEX, SOURCES):
        root = copy(pristine("lmdb", "jpeg"), tmp_path / f"no-{name}.lmdb")
        (root / name).unlink()
        with pytest.raises(DatasetError):
            open_and_read_all(root)
    with pytest.raises(DatasetError, match="not a packer dataset"):
        open_and_read_all(tmp_path / "nowhere")


# --- hostile index.npy ------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates a marker file: proof that code from the dataset ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", [INDEX, SOURCES])
def test_pickled_object_arrays_are_refused_without_unpickling(pristine, tmp_path: Path, name: str) -> None:
    root = copy(pristine("memmap", "jpeg"), tmp_path / "d")
    marker = tmp_path / "code-ran"
    np.save(root / name, np.array([Payload(marker)] * 20, dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError):
        open_and_read_all(root)
    run = cli_verify(root)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert not marker.exists(), "loading the dataset unpickled its contents"


def test_index_of_the_wrong_dtype_or_shape_is_refused(pristine, tmp_path: Path) -> None:
    root = copy(pristine("memmap", "jpeg"), tmp_path / "a")
    np.save(root / INDEX, np.zeros(20, dtype=np.float64))
    with pytest.raises(DatasetError, match="unexpected dtype"):
        open_and_read_all(root)
    root = copy(pristine("memmap", "jpeg"), tmp_path / "b")
    index = np.load(root / INDEX)
    np.save(root / INDEX, np.stack([index, index]))
    with pytest.raises(DatasetError, match="shape"):
        open_and_read_all(root)


@pytest.mark.parametrize("garbage", ["zeros", "random", "empty"])
def test_garbage_data_mdb_is_refused(pristine, tmp_path: Path, garbage: str) -> None:
    root = copy(pristine("lmdb", "jpeg"), tmp_path / "g.lmdb")
    size = (root / "data.mdb").stat().st_size
    content = {"zeros": bytes(size), "random": np.random.default_rng(0).bytes(size), "empty": b""}[garbage]
    (root / "data.mdb").write_bytes(content)
    assert isolated(outcome, root) == "refused"


# --- property-based: flip bytes, never anything but DatasetError or a verify report -----------------

flips = st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=3)


def flip(path: Path, changes: list[tuple[int, int]], start: int = 0, end: int | None = None) -> None:
    """XOR bytes of ``path`` at positions drawn into [start, end) (one mask per position: none cancel out)."""
    data = bytearray(path.read_bytes())
    end = len(data) if end is None else end
    for pos, mask in {start + pos % (end - start): mask for pos, mask in changes}.items():
        data[pos] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("backend,fmt", KINDS)
@FUZZ
@given(changes=flips)
def test_fuzzed_index_is_refused_or_reported(pristine, backend: str, fmt: str, changes) -> None:
    src = pristine(backend, fmt)
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(src, Path(tmp) / "d")
        flip(root / INDEX, changes)
        result = outcome(root)
        if result == "ok":  # only a change numpy ignores (e.g. header padding) may go unnoticed
            original, now = np.load(src / INDEX), np.load(root / INDEX)
            assert now.dtype == original.dtype and now.tobytes() == original.tobytes()


@pytest.mark.parametrize("backend,fmt", KINDS)
@FUZZ
@given(record=st.integers(0, 19), changes=flips)
def test_fuzzed_record_bytes_are_named_by_verify(pristine, backend: str, fmt: str, record: int, changes) -> None:
    src = pristine(backend, fmt)
    manifest = Manifest.load(src)
    index, sources = load_index(src, manifest)
    row = index[record]
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(src, Path(tmp) / "d")
        if backend == "lmdb":  # the record's bytes inside data.mdb (stored inline, found by content)
            blob = bytes(open_reader(src, manifest, index).get(record))
            path = root / "data.mdb"
            start = path.read_bytes().find(blob)
            assert start > 0
        else:
            path, start = root / str(manifest.shards[int(row["shard"])]["file"]), int(row["offset"])
        flip(path, changes, start, start + int(row["length"]))
        open_and_read_all(root)  # records are opaque bytes to a reader: damage inside one is verify's job
        result = verify(root)
        assert not result.ok and result.bad_records == 1
        assert result.problems[0].startswith(f"record {record} ({source_path(sources, row)}): crc32")


@FUZZ
@given(changes=flips)
def test_fuzzed_manifest_never_escapes_as_another_exception(pristine, changes) -> None:
    src = pristine("memmap", "jpeg")
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(src, Path(tmp) / "d")
        flip(root / MANIFEST, changes)
        outcome(root)  # any exception other than DatasetError fails the test


@FUZZ
@given(changes=flips)
def test_fuzzed_data_mdb_never_crashes_verify(pristine, changes) -> None:
    """Bit rot anywhere in data.mdb, B-tree pages included: verify refuses or reports it, or the bytes
    were unused; it never hands a malformed page to liblmdb (which could fault on it)."""
    src = pristine("lmdb", "jpeg")
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(src, Path(tmp) / "d")
        flip(root / "data.mdb", changes)
        assert isolated(verify_outcome, root) in ("ok", "reported", "refused")


def test_reader_sees_a_dataset_rebuilt_at_the_same_path(pristine, tmp_path: Path) -> None:
    """The per-process LMDB registry must not serve the replaced (deleted) environment's records."""
    raw = pristine("lmdb", "jpeg").parent / "raw"
    out = tmp_path / "same.lmdb"
    for quality in (90, 40):
        build(raw, out, workers=1, quiet=True, force=True, quality=quality)
        manifest = Manifest.load(out)
        index, _ = load_index(out, manifest)
        reader = open_reader(out, manifest, index)
        assert [len(reader.get(i)) for i in range(len(index))] == index["length"].tolist()
        assert verify(out).ok


def reader_outcome(root: Path) -> str:
    """A training job's reads alone, with no verify first: 'ok' or 'refused'."""
    try:
        open_and_read_all(root)
    except DatasetError:
        return "refused"
    return "ok"


@FUZZ
@given(changes=flips)
def test_fuzzed_data_mdb_never_crashes_a_reader(pristine, changes) -> None:
    """The same bit rot read straight through packer's reader: the page check that precedes a data.mdb
    version's first open on this machine refuses malformed pages before liblmdb maps them."""
    src = pristine("lmdb", "jpeg")
    with tempfile.TemporaryDirectory() as tmp:
        root = copy(src, Path(tmp) / "d")
        flip(root / "data.mdb", changes)
        assert isolated(reader_outcome, root) in ("ok", "refused")


def _leaf_nodes(data: bytes, psize: int = 4096) -> list[int]:
    """File offsets of every leaf node of a data.mdb (its 4-byte data-size field comes first)."""
    import struct

    offsets = []
    for page in range(2, len(data) // psize):
        at = page * psize
        flags, lower = struct.unpack_from("<HH", data, at + 10)
        if flags & 0x02:  # P_LEAF
            offsets += [at + ptr for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", data, at + 16)]
    return offsets


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_damaged_node_size_with_restored_mtime_is_an_error_not_sigbus(pristine, tmp_path: Path, fmt: str) -> None:
    """Bit rot that kept the file's mtime (cp -p, rsync --inplace): one leaf node's 4-byte size made
    huge. Nothing is keyed on the mtime any more: the read path checks the pages a record's lookup
    touches before liblmdb does, so show, preview and ShardDataset refuse the records of that page
    by name (a DatasetError, exit 1), where they died of SIGBUS (exit 135)."""
    root = copy(pristine("lmdb", fmt), tmp_path / "d.lmdb")
    data = root / "data.mdb"
    st = data.stat()
    node = _leaf_nodes(data.read_bytes())[3]  # record 3: inline (jpeg) or on overflow pages (raw)
    with open(data, "r+b") as f:
        f.seek(node)
        f.write((0x7FFFFFF0).to_bytes(4, "little"))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    for args in (["show", str(root), "3"], ["preview", str(root), "-o", str(tmp_path / "s.jpg"), "--n", "20"]):
        run = subprocess.run(PACKER + args, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, (args, run.returncode, run.stderr[-800:])
        assert re.search(r"record \d \(source .*\): damaged LMDB structure", run.stderr), run.stderr[-800:]
        assert "Traceback" not in run.stderr
    script = (
        "import sys, torch\nfrom packer import ShardDataset, DatasetError\n"
        "ds = ShardDataset(sys.argv[1], crop_size=None, dtype=torch.uint8)\n"
        "try:\n    [ds[i] for i in range(len(ds))]\nexcept DatasetError as e:\n    print(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "damaged LMDB structure" in run.stdout, (
        run.returncode,
        run.stdout,
        run.stderr[-800:],
    )


def test_update_over_a_damaged_lmdb_with_restored_mtime_keeps_or_decodes_again(pristine, tmp_path: Path) -> None:
    """A refresh that links the old data.mdb never reads it: the build cannot crash on it, the damage
    stays (verify names it, a reader refuses the record). One that rewrites every record (here: a third
    of the files deleted, too much dead) walks the old file with a cursor: its whole tree is checked
    first, whatever the mtime, so a damaged old dataset is decoded again instead of crashing the build."""
    raw = copy(pristine("lmdb", "raw").parent / "raw", tmp_path / "raw")
    out = tmp_path / "d.lmdb"
    build(raw, out, format="raw", workers=1, quiet=True)
    data = out / "data.mdb"
    st = data.stat()
    with open(data, "r+b") as f:
        f.seek(_leaf_nodes(data.read_bytes())[3])
        f.write((0x7FFFFFF0).to_bytes(4, "little"))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    Image.fromarray(np.zeros((30, 30, 3), np.uint8)).save(raw / "c0" / "new.png")
    script = (
        "import sys\nfrom packer import build\n"
        "r = build(sys.argv[1], sys.argv[2], format='raw', workers=1, quiet=True, update=True)\n"
        "print(r.count, r.reused)\n"
    )

    def refresh() -> list[str]:
        run = subprocess.run(
            [sys.executable, "-c", script, str(raw), str(out)], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, (run.returncode, run.stderr[-1500:])
        return run.stdout.split()

    assert refresh() == ["21", "20"]
    assert any("damaged LMDB structure" in p or "not a valid LMDB" in p for p in _verify_problems(out))
    for path in sorted(p for p in raw.rglob("*.png") if p.name != "new.png")[:7]:
        path.unlink()
    assert refresh() == ["14", "1"] and verify(out).ok  # new.png's record, from the sound data-00001.mdb


def _verify_problems(root: Path) -> list[str]:
    try:
        return verify(root).problems
    except DatasetError as e:
        return [str(e)]


CROP_DECODE_FUZZ = r"""
import sys
import numpy as np
from packer import codec
from packer.format import Manifest, load_index
from packer.read.reader import open_reader

root = sys.argv[1]
manifest = Manifest.load(root)
index, _ = load_index(root, manifest)
reader = open_reader(root, manifest, index)
rng = np.random.default_rng(0)
out = np.empty(1 << 22, np.uint8)
errors = 0
for trial in range(400):
    i = int(rng.integers(len(index)))
    data = bytearray(reader.get(i))
    for _ in range(int(rng.integers(1, 4))):
        data[int(rng.integers(len(data)))] = int(rng.integers(256))
    h, w = int(index[i]["height"]), int(index[i]["width"])
    top, left = int(rng.integers(h)), int(rng.integers(w))
    factor = [(1, 1), (1, 2), (1, 4)][trial % 3]
    sh, sw = -(-h * factor[0] // factor[1]), -(-w * factor[0] // factor[1])
    top, left = min(top, sh - 1), min(left, sw - 1)
    try:
        codec.decode_jpeg_region(bytes(data), factor, top, left, sh - top, sw - left, trial % 2 == 0, out)
    except ValueError:
        errors += 1
print("done", errors)
"""


@pytest.mark.skipif(not codec.can_decode_region(), reason="packer._native not built (no C compiler or libjpeg headers)")
def test_crop_on_decode_of_damaged_records_never_crashes(pristine) -> None:
    """400 byte-flipped JPEG records through the libjpeg binding (no CRC check in front), random
    bands and DCT scales, in a subprocess: a crash would fail the test; errors are ValueErrors."""
    run = subprocess.run(
        [sys.executable, "-c", CROP_DECODE_FUZZ, str(pristine("lmdb", "jpeg"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("done ") and int(run.stdout.split()[1]) > 0


def test_threaded_lmdb_fetch_matches_serial_names_bad_records_and_survives_fork(pristine, tmp_path: Path) -> None:
    """A batch's LMDB records are fetched by packer.backends.lmdb's fetch threads (each with its own read
    transaction): the same bytes in the same order as one at a time, a bad record named by its index,
    and a forked child (whose parent's threads did not survive the fork) fetching with its own."""
    from packer.backends import lmdb as backend

    root = copy(pristine("lmdb", "raw"), tmp_path / "d.lmdb")
    manifest = Manifest.load(root)
    index, _ = load_index(root, manifest)
    reader = open_reader(root, manifest, index)
    order = [19, 3, 3, 0, 7, 12, 5, 5, 18, 1, 2, 4, 6, 8, 9, 10, 11, 13, 14, 15, 16, 17]
    assert len(order) >= 2 * backend.FETCH_THREADS
    serial = [bytes(reader.get(i)) for i in order]
    assert [bytes(b) for b in reader.get_many(order)] == serial

    def child_fetch(_: Path) -> str:
        return "same" if [bytes(b) for b in reader.get_many(order)] == serial else "different"

    assert isolated(child_fetch, root) == "same"
    wrong = index.copy()
    wrong["length"][12] += 1
    with pytest.raises(DatasetError, match=r"record 12: has \d+ bytes, index says \d+") as e:
        open_reader(root, manifest, wrong).get_many(order)
    assert e.value.record == 12
