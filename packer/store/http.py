"""Objects over plain HTTP(S) with Range requests (read-only, no credentials): a dataset directory
served by any web server or a public bucket's https:// address; the transport :mod:`packer.store.s3`
signs (and writes through). urllib3: its pools are per process (see :class:`~packer.store.base.PerProcess`) and hold no
background threads, so they are safe under fork, spawn and forkserver alike (docs/PERFORMANCE.md,
"Object storage clients", has the measurement behind the choice)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any, Optional
from urllib.parse import quote

import urllib3

from ..errors import ObjectChanged, ObjectNotFound, PreconditionFailed, StoreError
from .base import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ObjectInfo, Passing, PerProcess, Store

POOL_SIZE = 32  # connections kept per host and process: a download's parts and a batch's requests
READ_PIECE = 1 << 20  # bytes per piece a response body is read in

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_META = "x-amz-meta-"


def _pool() -> urllib3.PoolManager:
    return urllib3.PoolManager(
        maxsize=POOL_SIZE,
        block=False,
        retries=False,  # retried by Store, with backoff and resumption
        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
    )


class HttpStore(Store):
    """Objects under an ``http://`` or ``https://`` URL, read with GET and Range."""

    def __init__(self, url: str, *, settings: Optional[dict[str, Any]] = None) -> None:
        super().__init__(url, settings=settings)
        self._pools = PerProcess(_pool)

    def object_url(self, key: str) -> str:
        return f"{self.url}/{quote(key)}"

    def headers(self, method: str, url: str, headers: dict[str, str], body: Optional[bytes] = None) -> dict[str, str]:
        """The request's headers as sent (S3 adds its signature here)."""
        return headers

    def _request(
        self, method: str, key: str, headers: dict[str, str], *, query: str = "", body: Optional[bytes] = None
    ) -> urllib3.BaseHTTPResponse:
        """The response to one request for object ``key``, its body unread; failures classified (see Store)."""
        return self._send(method, self.object_url(key) + (f"?{query}" if query else ""), key, headers, body)

    def _send(
        self, method: str, url: str, key: str, headers: dict[str, str], body: Optional[bytes] = None
    ) -> urllib3.BaseHTTPResponse:
        """The response to one request to ``url`` (about object ``key``, for messages), its body unread."""
        try:
            response = self._pools.get().request(
                method,
                url,
                body=body,
                headers=self.headers(method, url, headers, body),
                preload_content=False,
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as e:  # connect/read timeouts, resets, refused connections
            raise Passing(f"{type(e).__name__}: {e}") from None
        status = response.status
        if status in (200, 204, 206):
            return response
        text = self._drain(response)
        if status == 404:
            raise ObjectNotFound(f"{self.name(key)}: not found (HTTP 404{text})")
        if status in (401, 403):
            raise StoreError(f"{self.name(key)}: access denied (HTTP {status}{text}); check the credentials")
        reading = method in ("GET", "HEAD")
        if status == 416 and reading:  # a range past the object's end: it is shorter than its listing says
            raise StoreError(f"{self.name(key)}: shorter than the bytes asked ({headers.get('Range', '')}, HTTP 416)")
        if status == 412 and reading:
            raise ObjectChanged(f"{self.name(key)}: replaced while it was being read (HTTP 412)")
        if status == 412 or (status == 409 and "ConditionalRequestConflict" in text):
            raise PreconditionFailed(f"{self.name(key)}: changed by another writer (HTTP {status}{text})")
        if status == 429 or status >= 500 or "SlowDown" in text:
            raise Passing(f"HTTP {status}{text}")
        raise StoreError(f"{self.name(key)}: HTTP {status}{text}")

    @staticmethod
    def _drain(response: urllib3.BaseHTTPResponse) -> str:
        """A short excerpt of an error response's body (S3's error code is in it), for messages."""
        try:
            text = response.read(2048, decode_content=True).decode("utf-8", "replace")
        except urllib3.exceptions.HTTPError:
            text = ""
        finally:
            response.release_conn()
        code = re.search(r"<Code>([^<]*)</Code>", text)
        return f": {code.group(1)}" if code else ""

    def _head(self, key: str) -> ObjectInfo:
        response = self._request("HEAD", key, {})
        response.release_conn()
        return self._info(key, response)

    def _info(self, key: str, response: urllib3.BaseHTTPResponse, size: Optional[int] = None) -> ObjectInfo:
        """The object's size (its Content-Length, unless ``size`` says), version and metadata as a
        HEAD's or a plain GET's response gives them."""
        if size is None:
            length = response.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise StoreError(f"{self.name(key)}: the server gives no size (Content-Length)")
            size = int(length)
        meta = {k.lower()[len(_META) :]: v for k, v in response.headers.items() if k.lower().startswith(_META)}
        modified, served = (_http_date(response.headers.get(h, "")) for h in ("Last-Modified", "Date"))
        return ObjectInfo(size, response.headers.get("ETag", ""), meta, modified, served)

    def _open(self, key: str, etag: str) -> tuple[ObjectInfo, Iterator[bytes]]:
        response = self._request("GET", key, {"If-Match": etag} if etag else {})
        try:
            if response.status != 200:
                raise StoreError(f"{self.name(key)}: the server answered a plain GET with HTTP {response.status}")
            if not (response.chunked and "Content-Length" not in response.headers):
                info = self._info(key, response)
                return info, self._body(response, info.size)
            # chunked: no size to resume up to, so read whole here (the framing tells a body cut
            # short), and a break reads it again from the start
            try:
                data = response.read()
            except urllib3.exceptions.HTTPError as e:
                raise Passing(f"{type(e).__name__}: {e}") from None
        except BaseException:
            response.release_conn()
            raise
        response.release_conn()
        return self._info(key, response, len(data)), iter([data])

    def _stream(
        self, key: str, start: int, end: int, etag: str, seen: Optional[Callable[[ObjectInfo], object]] = None
    ) -> Iterator[bytes]:
        if end <= start:
            return
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if etag:
            headers["If-Match"] = etag
        response = self._request("GET", key, headers)
        try:
            skip = self._skip(key, response, start)
            if seen is not None:
                seen(self._info(key, response, self._total(key, response)))
        except BaseException:
            response.release_conn()
            raise
        yield from self._body(response, end - start, skip)

    @staticmethod
    def _body(response: urllib3.BaseHTTPResponse, left: int, skip: int = 0) -> Iterator[bytes]:
        """``left`` bytes of the response's body after its first ``skip``, in pieces as they arrive."""
        try:
            while left > 0:
                piece = response.read1(min(READ_PIECE, left + skip))  # what has arrived: kept if the next read fails
                if not piece:
                    break
                if skip:
                    piece, skip = piece[skip:], max(0, skip - len(piece))
                piece = piece[:left]
                left -= len(piece)
                if piece:
                    yield piece
        except urllib3.exceptions.HTTPError as e:  # a reset or idle timeout mid-body
            raise Passing(f"{type(e).__name__}: {e}") from None
        else:
            if left > 0:
                raise Passing(f"the response ended {left} bytes short")
        finally:
            response.release_conn()

    def _total(self, key: str, response: urllib3.BaseHTTPResponse) -> Optional[int]:
        """The object's size as a ranged GET's response gives it (None: its Content-Length, a 200's
        whole body); StoreError where a 206 does not say (``bytes A-B/*``)."""
        if response.status == 200:
            return None
        found = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if found is None or not found.group(3).isdigit():
            raise StoreError(f"{self.name(key)}: the server gives no size (Content-Range)")
        return int(found.group(3))

    def _skip(self, key: str, response: urllib3.BaseHTTPResponse, start: int) -> int:
        """Bytes before ``start`` in the body: 0 for a 206 from ``start``; ``start`` for a server
        that ignored Range and sent the whole object (200)."""
        if response.status == 200:
            return start
        found: Optional[re.Match[str]] = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
        if found is None or int(found.group(1)) != start:
            raise StoreError(f"{self.name(key)}: the server answered a range request with another range")
        return 0


def _http_date(text: str) -> float:
    """An HTTP date header as seconds since the epoch; 0.0 when absent or unreadable."""
    try:
        return parsedate_to_datetime(text).timestamp() if text else 0.0
    except (TypeError, ValueError):
        return 0.0
