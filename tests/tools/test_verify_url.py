"""packer verify on a URL, in the real S3 server: streamed from the store (nothing kept in the node
cache, each shard read once, through resets and cut bodies), every version with --all-versions, and
every missing, truncated or damaged object named, whatever the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.errors import DatasetError
from packer.format import Manifest
from packer.store import open_store
from packer.store.published import read_files, version_key
from packer.tools.verify import verify

from ..store.proxy import Faults, Proxy
from ..store.seaweed import S3Server
from .conftest import Versions
from .published import publish


def test_published_versions_verify(versions: Versions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))
    current = verify(versions.url)
    assert current.ok, current.problems
    assert current.root == f"{versions.url} (version {versions.ids[2]})"
    assert (current.count, current.digest) == (19, verify(versions.local[2]).digest)
    old = verify(versions.url, version=versions.ids[0])
    assert old.ok and old.count == 18 and old.digest == verify(versions.local[0]).digest
    open_store(versions.url).put(
        version_key("a" * 32, "manifest.json"), (versions.local[0] / "manifest.json").read_bytes()
    )
    with pytest.raises(DatasetError, match=f"version {'a' * 32} has no files.json"):
        verify(versions.url, version="a" * 32)
    with pytest.raises(DatasetError, match=f"no version {'b' * 32} there"):
        verify(versions.url, version="b" * 32)
    out = CliRunner().invoke(main, ["verify", "--all-versions", versions.url])
    assert out.exit_code == 0, out.output
    assert sorted(line.split("version ")[1][:32] for line in out.output.splitlines()) == sorted(versions.ids)
    assert out.output.splitlines()[0].startswith(f"packer: {versions.url} (version {versions.ids[2]}): ok, 19 records")
    assert not (tmp_path / "cache").exists()  # streamed: nothing went into the node cache


def test_streamed_once_through_faults(versions: Versions, proxy: Proxy) -> None:
    store = open_store(versions.url)
    files = read_files(store, versions.ids[2]) or {}
    proxy.faults.append(Faults(match="shard-", reset=2, truncate=2))
    assert verify(versions.url).ok
    for name, entry in files.items():
        got = sum(n for key, n in proxy.sent.items() if key.endswith("/" + entry.key))
        assert entry.size <= got < 2 * entry.size, name  # once, and the halves of the broken answers


def test_every_damaged_object_named(versions: Versions) -> None:
    """A flipped byte, a truncated shard and a deleted one: each object named (limit 1 or not), the
    records they hold counted bad, and the exit status 1."""
    store = open_store(versions.url)
    files = read_files(store, versions.ids[2]) or {}
    (_, a), (_, b), (deleted, c) = sorted(files.items())[:3]
    data = bytearray(store.get(a.key))
    data[len(data) // 2] ^= 0xFF
    store.put(a.key, bytes(data))
    store.put(b.key, store.get(b.key)[: b.size - 100])
    store.delete(c.key)
    store.put(version_key(versions.ids[2], "manifest.json"), b"{}")
    held = {str(sh["file"]): int(sh["count"]) for sh in Manifest.load(versions.local[2]).shards}[deleted]
    result = verify(versions.url, limit=1)
    assert not result.ok and result.bad_records == 1 + 1 + held
    problems = "\n".join(result.problems)
    assert f"{store.name(a.key)}: sha256 differs from files.json's" in problems
    assert f"{store.name(b.key)}: {b.size - 100} bytes, files.json says {b.size} (truncated or replaced)" in problems
    assert f"{store.name(c.key)}: missing ({deleted}, {held} records)" in problems
    assert f"versions/{versions.ids[2]}/manifest.json: differs from {store.name('manifest.json')}" in problems
    out = CliRunner().invoke(main, ["verify", versions.url, "--limit", "1"])
    assert out.exit_code == 1 and "FAILED verification" in out.output
    assert all(store.name(e.key) in out.output for e in (a, b, c))


def test_lmdb_published_verify(built, s3_server: S3Server) -> None:
    """An LMDB data file (a B-tree, not a stream) is checked too, and a damaged one named."""
    local = built("lmdb", "jpeg")
    url = f"s3://{s3_server.bucket}/tools/verify-lmdb"
    store = open_store(url)
    version = publish(store, local)
    result = verify(url)
    assert result.ok and result.digest == verify(local).digest
    (entry,) = (read_files(store, version) or {}).values()
    data = bytearray(store.get(entry.key))
    data[len(data) // 2] ^= 0xFF
    store.put(entry.key, bytes(data))
    damaged = verify(url)
    assert not damaged.ok and f"{store.name(entry.key)}: sha256 differs" in "\n".join(damaged.problems)
