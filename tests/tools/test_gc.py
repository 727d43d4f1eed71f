"""packer gc on a published dataset in the real S3 server: what no kept version needs goes, a kept
old version stays whole (every object its readers need, byte for byte), a dry run lists the same
objects and deletes nothing, abandoned publishes go once old, and the lease keeps a second writer out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from packer import ShardDataset
from packer.backends import data_files
from packer.cli import main
from packer.errors import BuildError
from packer.format import INDEX, MANIFEST, SOURCES, Manifest
from packer.store import open_store
from packer.store.base import Store
from packer.store.published import LEASE, POINTER, Lease, files_json, read_files, read_version, version_key
from packer.tools.gc import KEEP_AGE_S, KEEP_VERSIONS, collect, gc, parse_age

from ..store.seaweed import S3Server
from .conftest import Versions
from .published import publish

ABANDONED = "f" * 32  # a publish that died before its files.json


def _whole(store: Store, version: str, local: Path) -> None:
    """Every object a reader of ``version`` opens is there, with the bytes of the local dataset."""
    files = read_files(store, version)
    assert files is not None
    for name in data_files(Manifest.load(local)):
        assert store.get(files[name].key) == (local / name).read_bytes(), name
    for name in (MANIFEST, INDEX, SOURCES):
        assert store.get(version_key(version, name)) == (local / name).read_bytes(), name


def _keys(store: Store) -> set[str]:
    return {o.key for o in store.list()}


def test_gc_keeps_what_kept_versions_need(versions: Versions) -> None:
    store = open_store(versions.url)
    v1, v2, v3 = versions.ids
    store.put(version_key(ABANDONED, INDEX), b"half a publish")
    before = _keys(store)
    dry = gc(store, keep_versions=2, keep_age_s=0, dry_run=True)
    assert _keys(store) == before  # a dry run deletes nothing
    report = gc(store, keep_versions=2, keep_age_s=0)
    assert [o.key for o in report.deleted] == [o.key for o in dry.deleted] and report.bytes == dry.bytes > 0
    assert (report.current, report.kept, sorted(report.dropped)) == (v3, [v3, v2], sorted([v1, ABANDONED]))
    reused = {e.key for e in (read_files(store, v2) or {}).values() if e.key.startswith(f"versions/{v1}/")}
    assert reused  # the refresh reused the first build's shards: they stay, the rest of v1 goes
    assert _keys(store) == before - {o.key for o in report.deleted}
    assert {k for k in _keys(store) if k.startswith(f"versions/{v1}/")} == reused
    assert not [k for k in _keys(store) if ABANDONED in k]
    assert report.deleted[0].key == version_key(v1, "files.json")  # first: never a half-deleted version
    assert read_files(store, v1) is None
    _whole(store, v2, versions.local[1])  # a reader pinned to the kept old version reads all of it
    _whole(store, v3, versions.local[2])
    assert gc(store, keep_versions=2, keep_age_s=0).deleted == []  # nothing more to do


def test_reader_pinned_to_a_kept_version_reads_it_all_after_gc(
    three_builds: list[Path], s3_server: S3Server, tmp_path: Path
) -> None:
    """A ShardDataset opened on the second version reads every record (as the local copy has them)
    after the third was published and gc dropped the first, whose shards the second still uses."""
    store = open_store(url := f"s3://{s3_server.bucket}/tools/pinned-{tmp_path.name}")
    publish(store, three_builds[0])
    publish(store, three_builds[1])
    reader = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
    local = ShardDataset(three_builds[1], crop_size=None, dtype=torch.uint8)
    assert torch.equal(reader[0][0], local[0][0])  # opened: pinned to the second version
    publish(store, three_builds[2])
    assert len(gc(store, keep_versions=2, keep_age_s=0).deleted) > 0
    assert len(reader) == len(local) == 19
    for i in range(len(local)):
        got, want = reader[i], local[i]
        assert torch.equal(got[0], want[0]) and got[1] == want[1], i


def test_gc_keeps_young_versions_and_publishes(versions: Versions) -> None:
    """Within the age every version stays, an unfinished publish too; the count alone keeps one."""
    store = open_store(versions.url)
    store.put(version_key(ABANDONED, INDEX), b"a publish under way")
    before = _keys(store)
    assert gc(store, keep_versions=1, keep_age_s=3600).deleted == []
    assert _keys(store) == before
    report = gc(store, keep_versions=1, keep_age_s=0)
    assert report.kept == [versions.ids[2]]
    _whole(store, versions.ids[2], versions.local[2])


def test_gc_counts_only_versions_the_pointer_named(versions: Versions) -> None:
    """A publish that wrote its files.json but never its pointer is newer than the current version,
    yet not one of the versions kept by count: the parent chain says which were committed."""
    store = open_store(versions.url)
    uncommitted = "e" * 32
    store.put(version_key(uncommitted, "files.json"), files_json({}, parent=versions.ids[2]))
    report = gc(store, keep_versions=3, keep_age_s=0)
    assert (report.kept, report.dropped) == (versions.ids[::-1], [uncommitted])
    assert read_version(store, versions.ids[1]).parent == versions.ids[0]  # type: ignore[union-attr]


def test_info_shows_the_version_and_how_many_are_kept(versions: Versions, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    facts = json.loads(runner.invoke(main, ["info", "--json", versions.url]).output)
    assert (facts["version"], facts["versions"], facts["count"]) == (versions.ids[2], 3, 19)
    gc(open_store(versions.url), keep_versions=2, keep_age_s=0)
    shown = runner.invoke(main, ["info", versions.url])
    assert shown.exit_code == 0 and f"  version {versions.ids[2]}; 2 versions kept in the store" in shown.output
    local = json.loads(runner.invoke(main, ["info", "--json", str(versions.local[2])]).output)
    assert (local["version"], local["versions"]) == (versions.ids[2], None)


def test_gc_command(versions: Versions) -> None:
    """--dry-run lists each object and the bytes; a held lease refuses gc in one line; a local path
    is refused."""
    runner = CliRunner()
    args = ["gc", versions.url, "--keep-versions", "2", "--keep-age", "0"]
    dry = runner.invoke(main, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    first = versions.ids[0]
    assert f"would delete {versions.url}/versions/{first}/files.json (" in dry.output
    assert "kept 2 versions (current " in dry.output and "would delete" in dry.output.splitlines()[-1]
    with Lease(open_store(versions.url), holder="nightly-1 pid 42", quiet=True):
        busy = runner.invoke(main, args)
    assert (
        busy.exit_code == 1 and f"packer: error: {versions.url} is being built by nightly-1 pid 42 since" in busy.output
    )
    done = runner.invoke(main, [*args, "--json"])
    assert done.exit_code == 0, done.output
    facts = json.loads(done.output)
    assert facts["kept"] == versions.ids[:0:-1] and facts["bytes"] > 0 and not facts["dry_run"]
    assert LEASE not in {o.key for o in open_store(versions.url).list()}
    with pytest.raises(BuildError, match="a local dataset keeps no old versions"):
        collect("/tmp/some/train.lmdb")


def test_without_a_pointer_every_whole_version_stays(versions: Versions) -> None:
    """No pointer (deleted by hand, or a first publish that died before it): no history to keep by,
    so only unfinished folders go."""
    store = open_store(versions.url)
    store.put(version_key(ABANDONED, INDEX), b"half a publish")
    store.delete(POINTER)
    report = gc(store, keep_versions=1, keep_age_s=0)
    assert [o.key for o in report.deleted] == [version_key(ABANDONED, INDEX)]
    assert sorted(report.kept) == sorted(versions.ids)


def test_command_defaults_are_the_api_defaults() -> None:
    defaults = {p.name: p.default for p in main.commands["gc"].params}
    assert defaults["keep_versions"] == KEEP_VERSIONS and parse_age(str(defaults["keep_age_s"])) == KEEP_AGE_S


def test_parse_age() -> None:
    assert [parse_age(t) for t in ("3d", "12h", "30m", "90s", "45", "1.5h")] == [259200, 43200, 1800, 90, 45, 5400]
    with pytest.raises(ValueError, match="not an age"):
        parse_age("3 weeks")
