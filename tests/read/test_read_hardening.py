"""The read side against hostile or awkward datasets: special files in a dataset's place, what verify
covers, more shards than ``ulimit -n``, hostile sizes, odd indices and options, non-UTF-8 source
names, threads sharing a reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from packer import DatasetError, ShardDataset, build
from packer.format import INDEX, MANIFEST, SOURCES
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]


def make_raw(root: Path, count: int, classes: int = 3) -> Path:
    rng = np.random.default_rng(count)
    for i in range(count):
        path = root / f"c{i % classes}" / f"im{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20 + i % 7, 24, 3), dtype=np.uint8)).save(path)
    return root


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):
    """Datasets of 12 records built once per (backend, format)."""
    base = tmp_path_factory.mktemp("small")
    raw = make_raw(base / "raw", 12)
    done: dict[tuple[str, str], Path] = {}

    def get(backend: str, fmt: str = "jpeg") -> Path:
        if (backend, fmt) not in done:
            done[backend, fmt] = base / f"{backend}-{fmt}"
            build(raw, done[backend, fmt], backend=backend, format=fmt, workers=1, quiet=True, shard_size=5)
        return done[backend, fmt]

    return get


def copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


SPECIAL = r"""
import os, sys
from packer import DatasetError, ShardDataset
from packer.cli import dataset_info
from packer.tools.preview import contact_sheet, show
from packer.tools.verify import verify
for root in sys.argv[1:]:
    for name, call in (("ShardDataset", lambda: ShardDataset(root)), ("info", lambda: dataset_info(root)),
                       ("verify", lambda: verify(root)), ("show", lambda: show(root, 0, None)),
                       ("preview", lambda: contact_sheet(root, root + ".jpg", n=4))):
        try:
            call()
            print(name, "opened")
        except DatasetError as e:
            print(name, "DatasetError", "not a regular file" in str(e))
"""


def test_special_files_in_a_datasets_place_are_refused_without_blocking(small, tmp_path: Path) -> None:
    """index.npy, sources.npy or manifest.json replaced by a FIFO (no writer: an open for reading
    would block forever), data.mdb or a shard by a symlink to /dev/zero (endless): every entry point
    refuses by name, at once (``info`` reads no data file: it opens the last two)."""
    roots = []
    for name, backend in (
        (INDEX, "lmdb"),
        (SOURCES, "memmap"),
        (MANIFEST, "memmap"),
        ("data.mdb", "lmdb"),
        ("shard-00001.bin", "memmap"),
    ):
        root = copy(small(backend), tmp_path / f"{name}-{backend}")
        (root / name).unlink()
        if name.endswith((".npy", ".json")):
            os.mkfifo(root / name)
        else:
            (root / name).symlink_to("/dev/zero")
        roots.append(str(root))
    run = subprocess.run([sys.executable, "-c", SPECIAL, *roots], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = [
        "info opened" if k >= 15 and entry == "info" else f"{entry} DatasetError True"
        for k, entry in enumerate(["ShardDataset", "info", "verify", "show", "preview"] * 5)
    ]
    assert run.stdout.splitlines() == expected, run.stdout
    cli = subprocess.run(PACKER + ["info", roots[0]], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and "is a FIFO, not a regular file" in cli.stderr and "Traceback" not in cli.stderr


def test_verify_covers_class_names_options_and_source_paths(small, tmp_path: Path) -> None:
    root = copy(small("memmap"), tmp_path / "names")
    assert verify(root).ok and not verify(root).notes
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["classes"][0], manifest["classes"][1] = manifest["classes"][1], manifest["classes"][0]
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    result = verify(root)
    assert not result.ok and any(p.startswith(f"{MANIFEST}: fields (class names") for p in result.problems), (
        result.problems
    )
    ShardDataset(root)  # still opens: only verify can tell

    root = copy(small("lmdb"), tmp_path / "paths.lmdb")
    data = bytearray((root / SOURCES).read_bytes())
    data[-3] ^= 0x01  # one byte of the last source path: still valid UTF-8, still a plausible name
    (root / SOURCES).write_bytes(bytes(data))
    result = verify(root)
    assert [p for p in result.problems if p.startswith(SOURCES)] == [
        f"{SOURCES}: source paths differ from those the build wrote (manifest sources_digest; damaged or edited)"
    ]

    root = copy(small("memmap"), tmp_path / "options")
    text = json.loads((root / MANIFEST).read_text())
    text["short_edge"] = 300
    (root / MANIFEST).write_text(json.dumps(text))
    assert any(p.startswith(MANIFEST) for p in verify(root).problems)


def test_verify_of_a_format_1_dataset_says_what_it_cannot_check(small, tmp_path: Path) -> None:
    """Format 1 had no manifest_digest or sources_digest: verified as far as its digests go, and
    verify says what it could not check (exit 0). A format-2 manifest without them fails."""
    v1 = copy(Path(__file__).parents[1] / "data" / "v1-memmap", tmp_path / "v1")
    result = verify(v1)
    assert result.ok and [n.split(":")[0] for n in result.notes] == [MANIFEST, SOURCES], result.notes
    run = subprocess.run(PACKER + ["verify", str(v1)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "note: manifest.json: fields" in run.stderr and "note: sources.npy" in run.stderr

    root = copy(small("lmdb"), tmp_path / "stripped.lmdb")
    manifest = json.loads((root / MANIFEST).read_text())
    del manifest["manifest_digest"], manifest["sources_digest"]
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    result = verify(root)
    assert not result.ok and not result.notes
    assert len(result.problems) == 2
    assert result.problems[0].startswith(MANIFEST) and "(the manifest has no manifest_digest;" in result.problems[0]
    assert result.problems[1].startswith(SOURCES) and "(the manifest has no sources_digest;" in result.problems[1]


MANY_SHARDS = r"""
import resource, sys, torch
from torch.utils.data import DataLoader
from packer import ShardDataset
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ds = ShardDataset(sys.argv[1], crop_size=16, dtype=torch.uint8)
seen = 0
for epoch in range(2):
    ds.set_epoch(epoch)
    for images, labels in DataLoader(ds, batch_size=8, num_workers=2, shuffle=True, multiprocessing_context="fork"):
        seen += len(labels)
print(len(ds.manifest.shards), seen)
"""


def test_more_memmap_shards_than_open_files_allowed(tmp_path: Path) -> None:
    """One record per shard, 70 shards, a limit of 40 open files: a mapping keeps no descriptor."""
    raw = make_raw(tmp_path / "raw", 70)
    out = tmp_path / "many"
    build(raw, out, backend="memmap", workers=1, quiet=True, shard_size=1)
    run = subprocess.run(
        [sys.executable, "-c", MANY_SHARDS, str(out), "40"], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["70", "140"]


# `packer show OUT 0` with an address space of what the process already uses plus 80 MB: enough to read
# the manifest (a buffer of up to 64 MB), not to map a 144 MB shard
SHOW_UNDER_ULIMIT_V = """
import resource, sys
import packer.read.dataset, packer.tools.preview  # imported (and their address space taken) before the limit
from packer.cli import main
used = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + (80 << 20),) * 2)
main(["show", sys.argv[1], "0"])
"""


def test_a_shard_that_cannot_be_mapped_is_one_clean_error(tmp_path: Path) -> None:
    """ENOMEM from mmap (ulimit -v): the error names the shard and the likely limits, and the half-made
    mapping leaves no "Exception ignored in Mapping.__del__" behind it."""
    raw = tmp_path / "raw" / "a"
    raw.mkdir(parents=True)
    for k in range(3):  # flat colour: tiny files that decode into 48 MB records
        Image.new("RGB", (4000, 4000), (80 * k, 10, 10)).save(raw / f"{k}.jpg")
    out = tmp_path / "big"
    build(raw.parent, out, backend="memmap", format="raw", short_edge=4000, workers=1, quiet=True)
    run = subprocess.run([sys.executable, "-c", SHOW_UNDER_ULIMIT_V, str(out)], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr == (
        f"packer: error: {out}: shard shard-00000.bin cannot be mapped (out of address space (ulimit -v) "
        f"or mappings (too many shards mapped: vm.max_map_count))\n"
    )


def test_hostile_sizes_are_refused_before_any_allocation(small, tmp_path: Path) -> None:
    """A JPEG record whose index says 4,000,000 x 4,000,000 pixels (48 TB decoded)."""
    root = copy(small("memmap"), tmp_path / "huge")
    index = np.load(root / INDEX)
    index["height"][2] = index["width"][2] = 4_000_000
    np.save(root / INDEX, index)
    with pytest.raises(DatasetError, match="record 2: stored size 4000000 x 4000000 is impossible"):
        ShardDataset(root, crop_size=None)
    run = subprocess.run(PACKER + ["show", str(root), "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "impossible" in run.stderr and "Traceback" not in run.stderr


def test_odd_indices_and_options_get_clear_errors(small) -> None:
    ds = ShardDataset(small("lmdb"), crop_size=16, dtype=torch.uint8)
    assert ds.__getitems__([]) == []
    assert torch.equal(ds[np.int64(3)][0], ds[3][0]) and torch.equal(ds[torch.tensor(3)][0], ds[3][0])
    for bad in (1.7, "3", None):
        with pytest.raises(TypeError, match="record indices are integers"):
            ds[bad]
    with pytest.raises(TypeError):
        ds.__getitems__([0, 2.5])
    for epoch in (2**70, -1):
        with pytest.raises(ValueError, match="epoch must be in"):
            ds.set_epoch(epoch)
    with pytest.raises(TypeError):
        ds.set_epoch(1.5)
    for options in ({"eval_ratio": 0}, {"eval_ratio": 1.5}, {"ratio": (0, 0)}, {"ratio": (2, 1)}, {"scale": (0, 0)}):
        with pytest.raises(ValueError, match=r"ratio|scale"):
            ShardDataset(small("lmdb"), **options)


def test_non_utf8_source_names_round_trip(tmp_path: Path) -> None:
    """A source whose name is not UTF-8 (Latin-1 'café'): show prints, byte for byte, a path that exists."""
    raw = make_raw(tmp_path / "raw", 3, classes=1)
    name = os.fsdecode(b"caf\xe9.png")
    os.rename(raw / "c0" / "im001.png", raw / "c0" / name)
    out = tmp_path / "out"
    build(raw, out, backend="memmap", workers=1, quiet=True)
    ds = ShardDataset(out, crop_size=None)
    sources = [ds.source(i) for i in range(len(ds))]
    assert f"c0/{name}" in sources and all((raw / s).is_file() for s in sources)
    k = sources.index(f"c0/{name}")
    run = subprocess.run(PACKER + ["show", str(out), str(k)], capture_output=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"{k}: c0/caf\xe9.png  class c0".encode("latin-1")), run.stdout


def test_threads_reading_one_lmdb_reader_each_use_their_own_transaction(small) -> None:
    """LMDB wants one read transaction per thread: single-record reads from many threads included."""
    ds = ShardDataset(small("lmdb", "raw"), crop_size=None, dtype=torch.uint8)
    expected = [ds[i][0].clone() for i in range(len(ds))]
    txns, errors = [], []  # the transactions themselves: kept alive, their ids cannot be reused

    def work(seed: int) -> None:
        try:
            txns.append(ds._reader.txn())
            for i in np.random.default_rng(seed).integers(0, len(ds), 60).tolist():
                if not torch.equal(ds[i][0], expected[i]):
                    errors.append(i)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len({id(t) for t in txns}) == 6
