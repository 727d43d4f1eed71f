"""A fault-injecting HTTP proxy on 127.0.0.1 for the store tests: it forwards each request to the
real server unchanged (Host included, so S3 signatures still hold), and on the way back injects
what :class:`Faults` says for objects whose key contains a given text: 503s, connection resets
mid-body, bodies cut short, flipped bytes, a first-byte delay and a bandwidth cap. Uploads (PUT, POST,
DELETE) pass through too, with their own faults (see :class:`Faults`). It counts requests and body
bytes per object, and keeps each GET's Range header."""

from __future__ import annotations

import email.utils
import http.client
import re
import select
import socket
import struct
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: The bandwidth cap's bucket, in seconds of its rate: what a response may send at once after the
#: cap's line went idle (a sleep that overslept), so that the cap is met on average, not undercut.
BURST_S = 0.002


@dataclass
class Faults:
    """What to do to responses of objects whose key contains ``match`` ("" for all): the first
    ``stall`` GETs get no answer until the client closes the connection (its idle-read timeout gave
    up on it), ``stall_s`` seconds at most, then a closed connection; the next
    ``fail`` get a 503 SlowDown, the next ``reset`` are reset halfway through the body, the
    next ``truncate`` end halfway with a clean close, the next ``corrupt`` have their middle byte
    flipped (every one when ``corrupt`` is -1); ``delay`` seconds before the first byte (a HEAD's
    answer waits as long, and meets no other fault), ``rate``
    bytes/s at most (all its responses together), ``stream_rate`` bytes/s at most per response (a
    store whose one GET is capped, as S3's are); ``then()``, when given, runs after each reset or
    cut body is sent and before its connection closes, so before the client can resume (an object
    replaced right there).

    A rule whose ``method`` is PUT, POST or DELETE applies to those requests instead: the first
    ``fail`` get a 503 SlowDown and are not forwarded, the next ``reset`` are forwarded (the write
    lands) and then reset before any answer (the writer cannot tell), the next ``truncate`` are cut
    off halfway through the request body (nothing forwarded)."""

    match: str = ""
    method: str = "GET"
    stall: int = 0
    stall_s: float = 5.0
    fail: int = 0
    reset: int = 0
    truncate: int = 0
    corrupt: int = 0
    delay: float = 0.0
    rate: float = 0.0
    stream_rate: float = 0.0
    then: Callable[[], object] | None = None
    date_skew: float = 0.0  # seconds added to the Date header of its GET and HEAD answers (a skewed store clock)
    seen: int = 0
    free_at: float = 0.0  # when the bandwidth ``rate`` shares across all its responses is free again


@dataclass
class Proxy:
    upstream: str
    url: str = ""
    faults: list[Faults] = field(default_factory=list)
    requests: Counter = field(default_factory=Counter)  # (method, object name) -> requests
    sent: Counter = field(default_factory=Counter)  # object name -> body bytes sent
    received: Counter = field(default_factory=Counter)  # object name -> request body bytes received whole
    ranges: defaultdict = field(default_factory=lambda: defaultdict(list))  # object name -> GET Range headers
    peers: defaultdict = field(default_factory=lambda: defaultdict(list))  # object name -> client ports of its GETs
    gotten: list = field(default_factory=list)  # (object name, Range) of every GET, in the order they came
    pinned: Counter = field(default_factory=Counter)  # object name -> GETs asked If-Match (one version)
    # (object name, Range, client port, when its first body byte went, when its last did) of every GET answered
    spans: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0  # requests being answered

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until no request is being answered (one of a killed client may still be sending):
        the counts a test asserts start from none in flight. ``timeout`` only bounds a hang."""
        deadline = time.monotonic() + timeout
        while self.active:
            assert time.monotonic() < deadline, f"the proxy still answers {self.active} request(s) after {timeout:g} s"
            time.sleep(0.02)

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.requests.clear()
            self.sent.clear()
            self.received.clear()
            self.ranges.clear()
            self.peers.clear()
            self.gotten.clear()
            self.pinned.clear()
            self.spans.clear()

    def fetched(self, name: str) -> int:
        """Body bytes sent for objects whose key ends with ``name``."""
        return sum(n for key, n in self.sent.items() if key.endswith("/" + name))

    def uploaded(self, name: str) -> int:
        """Request body bytes received whole for objects whose key ends with ``name``."""
        return sum(n for key, n in self.received.items() if key.endswith("/" + name))

    def gets(self, name: str) -> int:
        return sum(n for (method, key), n in self.requests.items() if method == "GET" and key.endswith("/" + name))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that went away mid-body (killed, or a reset the proxy made itself)


def start(upstream: str) -> tuple[Proxy, ThreadingHTTPServer]:
    proxy = Proxy(upstream)
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._counted()

        def do_GET(self) -> None:
            self._counted()

        def do_PUT(self) -> None:
            self._counted()

        def do_POST(self) -> None:
            self._counted()

        def do_DELETE(self) -> None:
            self._counted()

        def _counted(self) -> None:
            with proxy.lock:
                proxy.active += 1
            try:
                self._forward()
            finally:
                with proxy.lock:
                    proxy.active -= 1

        def _forward(self) -> None:
            asked = time.monotonic()
            key = unquote(urlsplit(self.path).path)
            writing = self.command in ("PUT", "POST", "DELETE")
            with proxy.lock:
                proxy.requests[self.command, key] += 1
                if self.command == "GET":
                    proxy.ranges[key].append(self.headers.get("Range", ""))
                    proxy.peers[key].append(self.client_address[1])
                    proxy.gotten.append((key, self.headers.get("Range", "")))
                    proxy.pinned[key] += "If-Match" in self.headers
                applies = self.command if writing else "GET"
                rule = next((f for f in proxy.faults if f.match in key and f.method == applies), None)
                delay = rule.delay if rule is not None else 0.0  # a HEAD waits for its first byte too
                skew = rule.date_skew if rule is not None else 0.0
                rule = rule if self.command != "HEAD" else None  # and meets no other fault
                n = -1
                if rule is not None:
                    n, rule.seen = rule.seen, rule.seen + 1
            if writing:
                self._write(key, rule, n)
                return
            conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
            conn.request(self.command, self.path, headers=dict(self.headers.items()))
            response = conn.getresponse()
            body = response.read() if self.command == "GET" else b""
            conn.close()
            if delay:  # from the request: the store's time to its first byte
                time.sleep(max(0.0, asked + delay - time.monotonic()))
            if rule is not None and n < rule.stall:  # silent until the client gives up on it
                select.select([self.connection], [], [], rule.stall_s)  # readable: its close (EOF)
                self.close_connection = True
                return
            if rule is not None:
                n -= rule.stall
            if rule is not None and n < rule.fail:
                self._reply(503, b"<Error><Code>SlowDown</Code></Error>", {})
                return
            headers = {k: v for k, v in response.getheaders() if k.lower() not in ("connection", "transfer-encoding")}
            if skew and "Date" in headers:
                served = email.utils.parsedate_to_datetime(headers["Date"]).timestamp() + skew
                headers["Date"] = email.utils.formatdate(served, usegmt=True)
            if self.command == "HEAD":
                self._reply(response.status, b"", headers, length=headers.get("Content-Length"))
                return
            if rule is not None:
                n -= rule.fail
                if n < rule.reset:
                    self._reply(response.status, body, headers, cut=len(body) // 2, reset=True, then=rule.then)
                    return
                n -= rule.reset
                if n < rule.truncate:
                    self._reply(response.status, body, headers, cut=len(body) // 2, then=rule.then)
                    return
                n -= rule.truncate
                if (n < rule.corrupt or rule.corrupt < 0) and body:
                    mid = len(body) // 2
                    body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]
            self._reply(response.status, body, headers, rule=rule)

        def _write(self, key: str, rule: Faults | None, n: int) -> None:
            """An upload request forwarded, or failed as ``rule`` says (see Faults)."""
            length = int(self.headers.get("Content-Length", 0))
            if rule is not None and rule.fail + rule.reset <= n < rule.fail + rule.reset + rule.truncate:
                self.rfile.read(length // 2)  # cut off mid-body: the server sees nothing
                self._hang_up()
                return
            body = self.rfile.read(length)
            with proxy.lock:
                proxy.received[key] += len(body)
            if rule is not None and n < rule.fail:
                self._reply(503, b"<Error><Code>SlowDown</Code></Error>", {})
                return
            conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
            conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
            response = conn.getresponse()
            answer = response.read()
            conn.close()
            if rule is not None and n < rule.fail + rule.reset:  # landed, and the writer never hears it
                self._hang_up()
                return
            headers = {k: v for k, v in response.getheaders() if k.lower() not in ("connection", "transfer-encoding")}
            self._reply(response.status, answer, headers)

        def _hang_up(self) -> None:
            """Reset the connection (RST): the client sees it broken, with no answer."""
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True

        def _reply(
            self,
            status: int,
            body: bytes,
            headers: dict[str, str],
            *,
            length: str | None = None,
            cut: int | None = None,
            reset: bool = False,
            rule: Faults | None = None,
            then: Callable[[], object] | None = None,
        ) -> None:
            self.send_response_only(status)  # the store's own Date and Server, not a second pair of the proxy's
            for k, v in headers.items():
                if k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", length if length is not None else str(len(body)))
            self.end_headers()
            out = memoryview(body if cut is None else body[:cut])  # pieces sliced without copies
            step = 64 << 10
            began = time.monotonic()
            mine = began  # when this response's own cap (stream_rate) is free again
            for at in range(0, len(out), step):
                piece = out[at : at + step]
                if rule is not None and (rule.rate or rule.stream_rate):  # wait for this piece's share
                    with proxy.lock:
                        now = time.monotonic()
                        # buckets of BURST_S: a sleep that overslept is made up (the caps hold on average)
                        if rule.rate:
                            rule.free_at = max(now - BURST_S, rule.free_at) + len(piece) / rule.rate
                        if rule.stream_rate:
                            mine = max(now - BURST_S, mine) + len(piece) / rule.stream_rate
                        wait = max(rule.free_at if rule.rate else now, mine) - now
                    time.sleep(max(0.0, wait))
                self.wfile.write(piece)
            self.wfile.flush()
            key = unquote(urlsplit(self.path).path)
            with proxy.lock:
                proxy.sent[key] += len(out)
                if self.command == "GET":
                    proxy.spans.append(
                        (key, self.headers.get("Range", ""), self.client_address[1], began, time.monotonic())
                    )
            if cut is not None:
                if then is not None:
                    then()
                if reset:  # RST instead of FIN: the client sees a connection reset
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR) if not reset else None

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    return proxy, server


def serve_folder(root: Path) -> tuple[str, ThreadingHTTPServer]:
    """A plain web server of ``root`` on 127.0.0.1 with single Range requests, ETags and If-Match
    (as a static host or a public bucket's https:// address serves a dataset): its URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = root / unquote(urlsplit(self.path).path).lstrip("/")
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data, st = path.read_bytes(), path.stat()
            etag = f'"{st.st_size}-{st.st_mtime_ns}"'
            if self.headers.get("If-Match", etag) != etag:
                self.send_response(412)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
            start, end = (int(found.group(1)), min(int(found.group(2)) + 1, len(data))) if found else (0, len(data))
            self.send_response(206 if found else 200)
            if found:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("ETag", etag)
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server
