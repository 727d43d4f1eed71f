"""The store's write side against the real S3 server (SeaweedFS on 127.0.0.1), directly and through
the fault proxy: PUTs conditional on an object's absence or version, uploads in parallel parts that
survive resets, 503s and bodies cut short, failed uploads aborted, deletes, listings."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from packer.errors import PreconditionFailed, StoreError, URLNotSupported
from packer.store import base, open_store, s3
from packer.store.base import Store

from .proxy import Faults, Proxy, serve_folder
from .seaweed import S3Server

PART = 5 << 20  # S3's smallest part: three parts of a 12 MiB file


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small parts (so a multipart upload stays small) and short backoffs (so the tests stay fast)."""
    monkeypatch.setattr(base, "PART_BYTES", PART)
    monkeypatch.setattr(base, "BACKOFF_S", 0.01)


def _store(s3_server: S3Server, prefix: str) -> Store:
    return open_store(f"s3://{s3_server.bucket}/{prefix}")


def test_put_head_list_delete(s3_server: S3Server) -> None:
    store = _store(s3_server, "write/basic")
    info = store.put("a/one", b"first", metadata={"SHA256": "abc"})
    store.put("a/two", b"second!")
    store.put("b", b"x")
    head = store.head("a/one")
    assert (head.size, head.etag, dict(head.metadata)) == (5, info.etag, {"sha256": "abc"})
    assert head.modified > 0 and head.served >= head.modified - 1
    assert store.get("a/one") == b"first"
    assert [(o.key, o.size) for o in store.list("a/")] == [("a/one", 5), ("a/two", 7)]
    assert [o.key for o in store.list()] == ["a/one", "a/two", "b"]
    assert [o.key for o in _store(s3_server, "write").list("basic/a/")] == ["basic/a/one", "basic/a/two"]
    store.delete("a/one")
    store.delete("a/one")  # absent: fine
    assert [o.key for o in store.list()] == ["a/two", "b"]


def test_list_pages(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(s3_server, "write/pages")
    for i in range(5):
        store.put(f"k{i}", b"%d" % i)
    monkeypatch.setattr(s3, "LIST_PAGE", 2)
    assert [o.key for o in store.list()] == [f"k{i}" for i in range(5)]


def test_conditional_puts(s3_server: S3Server) -> None:
    """If-None-Match: * and If-Match, as SeaweedFS checks them (docs/OBJECT-STORAGE.md)."""
    store = _store(s3_server, "write/conditional")
    first = store.put("pointer", b"v1", if_none_match=True)
    with pytest.raises(PreconditionFailed, match="pointer"):
        store.put("pointer", b"v1-again", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("pointer", b"v2", if_match='"0123456789abcdef0123456789abcdef"')
    with pytest.raises(PreconditionFailed):
        store.put("absent", b"v2", if_match=first.etag)
    assert store.get("pointer") == b"v1"
    second = store.put("pointer", b"v2", if_match=first.etag)
    assert store.get("pointer") == b"v2"
    with pytest.raises(PreconditionFailed):
        store.put("pointer", b"v3", if_match=first.etag)
    with pytest.raises(PreconditionFailed):
        store.delete("pointer", if_match=first.etag)
    store.delete("pointer", if_match=second.etag)
    assert [o.key for o in store.list()] == []


def test_conditional_put_whose_answer_was_lost(s3_server: S3Server, proxy: Proxy, fast: None) -> None:
    """The first attempt lands but its connection is reset before the answer: the retry is refused
    (the object exists now), the object is read back, and it is ours: a success. Someone else's
    bytes there instead are a PreconditionFailed."""
    store = _store(s3_server, "write/lost")
    proxy.faults.append(Faults(match="lost/created", method="PUT", reset=1))
    info = store.put("created", b"mine", if_none_match=True)
    assert store.get("created") == b"mine" and info.etag == store.head("created").etag
    store.put("taken", b"theirs")
    proxy.faults.append(Faults(match="lost/taken", method="PUT", fail=1))
    with pytest.raises(PreconditionFailed):
        store.put("taken", b"mine", if_none_match=True)
    assert store.get("taken") == b"theirs"


def test_multipart_upload_survives_faults(s3_server: S3Server, proxy: Proxy, tmp_path: Path, fast: None) -> None:
    """A 12 MiB file goes up in three parts through 503s, resets after the part landed and part
    bodies cut short (and a 503 and a lost answer to the upload's creation); the object is the file,
    byte for byte, with its metadata and S3's ETag."""
    data = os.urandom(12 << 20)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    store = _store(s3_server, "write/multipart")
    proxy.faults += [Faults(match="big.bin", method="PUT", fail=2, reset=2, truncate=2)]
    proxy.faults += [Faults(match="big.bin", method="POST", fail=1, reset=1)]  # the creates
    digest = hashlib.sha256(data).hexdigest()
    info = store.put_file("big.bin", path, metadata={"sha256": digest})
    head = store.head("big.bin")
    assert head.size == info.size == len(data) and head.etag.strip('"') == info.etag.strip('"')
    assert head.etag.strip('"').endswith("-3") and head.metadata == {"sha256": digest}
    assert store.get("big.bin") == data
    assert proxy.requests["PUT", f"/{s3_server.bucket}/write/multipart/big.bin"] >= 3 + 6
    # the create whose answer was lost began an upload no one knows of: `packer clean URL` aborts it
    assert [u.key for u in store.uploads()] == ["big.bin"]


def test_small_file_is_one_put(s3_server: S3Server, proxy: Proxy, tmp_path: Path, fast: None) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(b"s" * 1000)
    store = _store(s3_server, "write/small")
    proxy.faults.append(Faults(match="small.bin", method="PUT", fail=1, truncate=1))
    assert store.put_file("small.bin", path).size == 1000
    assert store.get("small.bin") == b"s" * 1000
    assert not [k for k in proxy.requests if k[0] == "POST"]  # no multipart upload


def test_failed_multipart_upload_is_aborted(s3_server: S3Server, proxy: Proxy, tmp_path: Path, fast: None) -> None:
    """Parts that keep failing: a StoreError naming the object, no object, and no upload left behind
    (its parts would be stored, and paid for, until aborted)."""
    path = tmp_path / "doomed.bin"
    path.write_bytes(os.urandom(PART + 1))
    store = _store(s3_server, "write/aborted")
    proxy.faults.append(Faults(match="doomed.bin", method="PUT", fail=1000))
    with pytest.raises(StoreError, match=r"doomed\.bin: failed 6 times"):
        store.put_file("doomed.bin", path)
    assert list(store.list()) == []
    assert store.uploads() == []


def test_stale_uploads_listed_and_aborted(s3_server: S3Server) -> None:
    store = _store(s3_server, "write/stale")
    upload = store._create_upload("half.bin", {})
    assert [(u.key, u.upload_id) for u in store.uploads()] == [("half.bin", upload)]
    assert store.uploads()[0].initiated > 0
    store.abort(store.uploads()[0])
    assert store.uploads() == []


def test_web_server_is_read_only(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    url, server = serve_folder(tmp_path)
    try:
        store = open_store(url)
        assert not store.writable and store.get("f") == b"x"
        for write in (lambda: store.put("f", b"y"), lambda: store.delete("f"), lambda: list(store.list())):
            with pytest.raises(URLNotSupported, match="cannot write here"):
                write()
    finally:
        server.shutdown()
