"""The published layout's names and files.json, read back from the real S3 server."""

from __future__ import annotations

import functools
import hashlib
import json
import threading

import pytest

from packer.errors import DatasetError
from packer.store import open_store
from packer.store.published import (
    POINTER,
    FileEntry,
    files_json,
    parse_files,
    read_files,
    read_pointer,
    version_id,
    version_key,
)

from .seaweed import S3Server


def test_names() -> None:
    manifest = b'{"count": 3}'
    assert version_id(manifest) == hashlib.sha256(manifest).hexdigest()[:32]
    assert version_key("ab" * 16, "index.npy") == f"versions/{'ab' * 16}/index.npy"


def test_files_json_round_trip(s3_server: S3Server) -> None:
    store = open_store(f"s3://{s3_server.bucket}/published/files")
    version = version_id(b"v1")
    entries = {
        "shard-00001.bin": FileEntry(version_key(version, "shard-00001.bin"), 10, "0" * 64),
        "shard-00000.bin": FileEntry("versions/" + "c" * 32 + "/shard-00000.bin", 7),
    }
    assert read_files(store, version) is None  # a synced copy: no files.json
    store.put(version_key(version, "files.json"), files_json(entries))
    assert read_files(store, version) == entries
    assert list(json.loads(files_json(entries))["files"]) == ["shard-00000.bin", "shard-00001.bin"]
    with pytest.raises(DatasetError, match="not a version id"):
        read_files(store, "../x")


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"format": 2, "files": {}}, "format 2"),
        ({"format": 1, "files": {"a": {"key": "/etc/passwd", "size": 1}}}, "not inside"),
        ({"format": 1, "files": {"a": {"key": "../other/a", "size": 1}}}, "not inside"),
        ({"format": 1, "files": {"a": {"key": "a", "size": -1}}}, "size"),
        ({"format": 1, "files": {"a": {"key": "a", "size": 1, "sha256": "xyz"}}}, "sha256"),
        ({"format": 1}, "files"),
    ],
)
def test_files_json_refused(doc: dict, why: str) -> None:
    with pytest.raises(DatasetError, match=f"U/files.json: not a files.json packer wrote .*{why}"):
        parse_files(json.dumps(doc).encode(), where="U/files.json")


def test_pointer_read_whole_while_publishes_replace_it(s3_server: S3Server) -> None:
    """A reader of the pointer while a writer keeps replacing it gets one whole version each time,
    never ObjectChanged (a replacement between the HEAD and the pinned GET is read again). The
    writer replaces it once a read that began after its last replacement has ended (reads still
    overlap every replacement), so every version is read, however the threads are scheduled."""
    store = open_store(f"s3://{s3_server.bucket}/published/pointer")
    assert read_pointer(store) is None
    versions = [json.dumps({"version": i, "pad": "x" * 2000}).encode() for i in range(100)]
    store.put(POINTER, versions[0])
    stop = threading.Event()
    changed = threading.Condition()
    put, read_since = [0], [-1]  # replacements made; the replacements before the last read that ended began

    def read_since_put(n: int) -> bool:
        return stop.is_set() or read_since[0] >= n

    def publish() -> None:
        writer = open_store(store.url)
        for i in range(1, len(versions) + 1):  # the last round waits for a read of the last version
            with changed:  # a bound on a hang only: the reader reads without pause
                if not changed.wait_for(functools.partial(read_since_put, i - 1), timeout=120):
                    raise AssertionError(f"no read of version {i - 1} in 120 s")
            if stop.is_set() or i == len(versions):
                return
            writer.put(POINTER, versions[i])
            with changed:
                put[0] = i

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        seen = set()
        while thread.is_alive():
            with changed:
                began = put[0]
            got = read_pointer(store)
            assert got is not None and got.text in versions
            seen.add(got.text)
            with changed:
                read_since[0] = began
                changed.notify_all()
    finally:
        stop.set()
        with changed:
            changed.notify_all()
        thread.join()
    assert seen == set(versions)  # each read while the pointer changed
