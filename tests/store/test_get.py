"""Whole objects read in one plain GET (Store.read, and Store.get without an end), against the real S3
server (SeaweedFS on 127.0.0.1) through the fault proxy: no HEAD first, a broken body resumed from the
byte it reached and pinned to the first response's ETag, a replaced object never spliced, 404 at once,
503 retried; and web servers that answer without a Content-Length."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from packer import ShardDataset
from packer.errors import ObjectChanged, ObjectNotFound, StoreError
from packer.format import INDEX, SOURCES
from packer.store import base, open_store
from packer.store.base import Store
from packer.store.http import HttpStore
from packer.store.published import FILES, LAYOUT_META, POINTER, read_pointer

from ..tools.published import publish
from .proxy import Faults, Proxy, _Server
from .seaweed import S3Server


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "BACKOFF_S", 0.01)


def _store(s3_server: S3Server, prefix: str) -> Store:
    return open_store(f"s3://{s3_server.bucket}/{prefix}")


def _path(s3_server: S3Server, prefix: str, key: str) -> str:
    """The object's path as the proxy counts it."""
    return f"/{s3_server.bucket}/{prefix}/{key}"


def test_whole_object_is_one_get(s3_server: S3Server, proxy: Proxy) -> None:
    """Bytes, size, ETag, metadata and dates from the GET alone, as a HEAD gives them."""
    store = _store(s3_server, "get/one")
    data = os.urandom(300_000)
    put = store.put("obj", data, metadata={"SHA256": "abc"})
    proxy.clear()
    got, info = store.read("obj")
    assert got == data
    assert list(proxy.requests.elements()) == [("GET", _path(s3_server, "get/one", "obj"))]
    assert proxy.ranges[_path(s3_server, "get/one", "obj")] == [""]  # a plain GET, no Range
    head = store.head("obj")
    assert (
        (info.size, info.etag, dict(info.metadata))
        == (len(data), put.etag, {"sha256": "abc"})
        == (
            head.size,
            head.etag,
            dict(head.metadata),
        )
    )
    assert info.modified == head.modified > 0 and info.served >= info.modified - 1
    proxy.clear()
    assert store.get("obj") == data and store.get("obj", 1000) == data[1000:]
    assert sorted(proxy.requests.elements()) == [("GET", _path(s3_server, "get/one", "obj"))] * 2
    with pytest.raises(ObjectChanged):  # pinned to a version it no longer is
        store.read("obj", etag='"0123456789abcdef0123456789abcdef"')
    store.put("empty", b"")
    assert store.read("empty")[0] == b""


@pytest.mark.parametrize("fault", ["reset", "truncate"])
def test_broken_body_resumed_from_the_byte_reached(s3_server: S3Server, proxy: Proxy, fast: None, fault: str) -> None:
    store = _store(s3_server, f"get/{fault}")
    data = os.urandom(3 << 20)
    store.put("obj", data)
    proxy.clear()
    proxy.faults.append(Faults(match="get/", reset=2) if fault == "reset" else Faults(match="get/", truncate=2))
    got, info = store.read("obj")
    assert got == data and info.size == len(data)
    path = _path(s3_server, f"get/{fault}", "obj")
    first, *resumed = proxy.ranges[path]
    assert first == "" and len(resumed) == 2 and proxy.requests["HEAD", path] == 0
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for r in resumed]
    assert all(r.endswith(f"-{len(data) - 1}") for r in resumed)  # the rest only, to the object's end
    if fault == "truncate":  # a clean close: every byte sent arrived, so each resume starts where it broke
        assert starts == [len(data) // 2, len(data) // 2 + (len(data) - len(data) // 2) // 2]


def test_object_replaced_before_the_resume_is_never_spliced(s3_server: S3Server, proxy: Proxy, fast: None) -> None:
    """A body cut short whose object is replaced before the resume: the pinned resume is refused
    (ObjectChanged), and the pointer read reads the new version again, whole."""
    prefix = "get/replaced"
    store = _store(s3_server, prefix)
    old, new = os.urandom(200_000), os.urandom(200_000)
    store.put("obj", old)

    def replace(key: str) -> None:
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=new)

    proxy.faults.append(Faults(match=f"{prefix}/obj", truncate=1, then=lambda: replace("obj")))
    with pytest.raises(ObjectChanged, match="replaced while it was being read"):
        store.read("obj")
    assert store.read("obj")[0] == new

    store.put(POINTER, old)
    proxy.clear()
    proxy.faults.append(Faults(match=f"{prefix}/{POINTER}", reset=1, then=lambda: replace(POINTER)))
    got = read_pointer(store)
    etag = s3_server.client.head_object(Bucket=s3_server.bucket, Key=f"{prefix}/{POINTER}")["ETag"]
    assert got is not None and (got.text, got.etag) == (new, etag)
    path = _path(s3_server, prefix, POINTER)
    assert list(proxy.requests) == [("GET", path)] and proxy.requests["GET", path] == 3  # cut, refused resume, whole
    assert proxy.ranges[path][0] == proxy.ranges[path][2] == ""


def test_download_learns_the_version_from_its_first_part(s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """A download whose version is not known (no HEAD first) takes it from its first part's
    response, size and all, and asks the other parts If-Match it; a part cut short resumes pinned
    to it too, so the parts are of one version."""
    store = _store(s3_server, "get/learned")
    data = os.urandom(300_000)
    put = store.put("obj", data)
    path = _path(s3_server, "get/learned", "obj")
    proxy.clear()
    proxy.faults.append(Faults(match="get/learned/obj", truncate=1))
    seen: list[base.ObjectInfo] = []
    with open(tmp_path / "out", "wb+") as f:
        store.download("obj", f.fileno(), base.ObjectInfo(len(data), ""), part_bytes=64 << 10, seen=seen.append)
        f.seek(0)
        assert f.read() == data
    assert [(i.size, i.etag) for i in seen] == [(len(data), put.etag)]
    assert proxy.requests["GET", path] == 6 and proxy.pinned[path] == 5  # 5 parts, the first one cut and resumed
    assert not proxy.requests["HEAD", path]


def test_missing_at_once_and_503_retried(s3_server: S3Server, proxy: Proxy, fast: None) -> None:
    store = _store(s3_server, "get/faults")
    with pytest.raises(ObjectNotFound, match="get/faults/absent: not found"):
        store.read("absent")
    assert list(proxy.requests.elements()) == [("GET", _path(s3_server, "get/faults", "absent"))]  # no retries
    assert read_pointer(store) is None
    store.put("obj", b"payload")
    proxy.clear()
    proxy.faults.append(Faults(match="get/faults/obj", fail=2))
    assert store.read("obj")[0] == b"payload"
    assert list(proxy.requests.elements()) == [("GET", _path(s3_server, "get/faults", "obj"))] * 3
    proxy.clear()
    proxy.faults.append(Faults(match="get/faults/obj", fail=base.ATTEMPTS))
    with pytest.raises(StoreError, match=f"failed {base.ATTEMPTS} times, last: HTTP 503: SlowDown"):
        store.read("obj")


def test_opening_a_dataset_asks_no_head(built, s3_server: S3Server, proxy: Proxy, tmp_path: Path) -> None:
    """Opening a dataset URL reads the pointer, then at once files.json (absent in a synced copy)
    and the index arrays where the pointer says they are, one GET each and no HEAD: 4 requests,
    where a HEAD before each GET made 7 (synced) and 8 (published). A pointer without the publish's
    layout mark (an older packer's) has the arrays asked in both places."""
    local = built("memmap", "jpeg")
    synced = s3_server.upload(local, "get/open-synced")
    published = _store(s3_server, "get/open-published")
    version = publish(published, local)
    unmarked = _store(s3_server, "get/open-unmarked")
    assert publish(unmarked, local) == version
    pointer = unmarked.read(POINTER)
    assert pointer[1].metadata == LAYOUT_META
    unmarked.put(POINTER, pointer[0], if_match=pointer[1].etag)  # as a publish before the mark wrote it
    inside = [f"versions/{version}/{name}" for name in (INDEX, SOURCES)]
    for url, arrays in [(synced, [INDEX, SOURCES]), (published.url, inside), (unmarked.url, [INDEX, SOURCES, *inside])]:
        proxy.clear()
        ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / url.rsplit("/", 1)[1])
        where = url.removeprefix("s3:/")
        assert sorted(proxy.requests.elements()) == sorted(
            ("GET", f"{where}/{key}") for key in [POINTER, f"versions/{version}/{FILES}", *arrays]
        )


class _Unsized(BaseHTTPRequestHandler):
    """Answers a plain GET without Content-Length: chunked (``framing`` "chunked"), its first answer
    cut off mid-chunk when ``cut``, or (``framing`` "eof") a body that just ends when the connection
    closes, whose end nothing marks."""

    protocol_version = "HTTP/1.1"
    body = b""
    framing = "chunked"
    cut = 0  # answers still to cut off
    gets = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        cls.gets += 1
        self.send_response(200)
        self.send_header("ETag", '"v1"')
        if cls.framing == "eof":
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(cls.body)
            self.close_connection = True
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        half = len(cls.body) // 2
        for piece in (cls.body[:half], cls.body[half:]):
            self.wfile.write(b"%x\r\n" % len(piece) + piece[: len(piece) // 2 if cls.cut else None])
            if cls.cut:  # mid-chunk: the framing says more was due
                cls.cut -= 1
                self.close_connection = True
                return
            self.wfile.write(b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def unsized() -> Iterator[tuple[HttpStore, type[_Unsized]]]:
    handler = type("Handler", (_Unsized,), {"body": os.urandom(100_000)})
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield HttpStore(f"http://127.0.0.1:{server.server_address[1]}"), handler
    server.shutdown()


def test_chunked_answer_is_read_whole_or_again(unsized: tuple[HttpStore, type[_Unsized]], fast: None) -> None:
    """A chunked body (no size to resume up to) is read whole; one cut short is read again from the start."""
    store, handler = unsized
    data, info = store.read("obj")
    assert data == handler.body and (info.size, info.etag, handler.gets) == (len(handler.body), '"v1"', 1)
    handler.cut = 1
    assert store.get("obj") == handler.body and handler.gets == 3


def test_answer_without_a_marked_end_fails_clearly(unsized: tuple[HttpStore, type[_Unsized]]) -> None:
    """Neither Content-Length nor chunked: a cut body would look whole, so it is refused, as a HEAD is."""
    store, handler = unsized
    handler.framing = "eof"
    with pytest.raises(StoreError, match=r"/obj: the server gives no size \(Content-Length\)"):
        store.read("obj")
