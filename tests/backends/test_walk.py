"""Sequential record walks (packer.backends.walk), which verify, resume and --update read whole datasets through:
every record once in index order with the same bytes and CRC-32 as the training reader sees, holes and
extra keys reported, the LMDB environment released when a caller stops early."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import lmdb
import pytest

from packer import ShardDataset
from packer.backends.lmdb import close_lmdb
from packer.backends.walk import walk
from packer.format import Manifest, lmdb_key, load_index
from packer.read.reader import open_reader
from packer.tools.verify import verify

from ..conftest import COMBOS


@pytest.mark.parametrize(("backend", "fmt"), COMBOS)
def test_walk_yields_every_record_as_the_reader_does(built, backend: str, fmt: str) -> None:
    out = built(backend, fmt)
    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    reader = open_reader(out, manifest, index)
    expected = [bytes(reader.get(i)) for i in range(len(index))]
    close_lmdb(out)  # one open per file and process (py-lmdb): the walk opens its own, with readahead
    seen = []
    for i, data, crc in walk(out, manifest, index):
        assert data is not None and bytes(data) == expected[i]
        assert crc == zlib.crc32(data) == int(index[i]["crc32"])
        seen.append(i)
    assert seen == list(range(len(index)))


def test_a_caller_that_stops_early_releases_the_lmdb_environment(built, tmp_path: Path) -> None:
    """py-lmdb opens a file once per process: a walk left open would make the next open fail."""
    out = shutil.copytree(built("lmdb", "jpeg"), tmp_path / "ds.lmdb")
    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    records = walk(out, manifest, index)
    next(records)
    records.close()
    env = lmdb.open(str(out), readonly=True, lock=False)  # raises "already open" if the walk's env leaked
    env.close()
    assert ShardDataset(out, crop_size=None)[0][0].shape[0] == 3


def test_missing_and_extra_lmdb_keys_are_holes_and_a_count(built, tmp_path: Path) -> None:
    out = shutil.copytree(built("lmdb", "jpeg"), tmp_path / "ds.lmdb")
    close_lmdb(out)
    env = lmdb.open(str(out), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.delete(lmdb_key(3))
        txn.put(b"stray", b"x")
        txn.put(lmdb_key(10_000), b"y")
    env.close()
    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    extra: list[int] = []
    got = {i: data for i, data, _ in walk(out, manifest, index, lambda _, n, __: extra.append(n))}
    assert sorted(got) == list(range(len(index))) and got[3] is None and extra == [2]
    result = verify(out)
    assert not result.ok
    assert any("record 3 " in p and "missing" in p for p in result.problems)
    assert any("holds 2 records the index does not name" in p for p in result.problems)


def test_a_truncated_shard_is_short_records_not_a_crash(built, tmp_path: Path) -> None:
    out = shutil.copytree(built("memmap", "jpeg"), tmp_path / "ds")
    shard = out / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    result = verify(out)
    assert not result.ok
    assert any("shard-00001.bin: shard is 100 bytes" in p for p in result.problems)
    assert any(p.startswith("record 7 ") for p in result.problems)
