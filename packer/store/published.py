"""A dataset published to an object store at URL ``U`` (docs/OBJECT-STORAGE.md, "Layout"):
``U/manifest.json``, the pointer, holds the current version's manifest and is written last, in one
PUT conditional on the previous pointer; each version's metadata lives, immutable, under
``U/versions/<id>/``, whose ``files.json`` (written last inside it) says where each data file's
bytes are. No object is ever overwritten but the pointer, so a reader pinned to an older version
keeps reading it until gc deletes what no kept version names.

This module holds the names and the ``files.json`` format, read and written the same way by the
publish, the read side, gc and verify, and the one-writer :class:`Lease`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, Optional, TypeGuard

from ..errors import BuildError, DatasetError, ObjectChanged, ObjectNotFound, PreconditionFailed, StoreError, say
from ..format import MANIFEST
from .base import ObjectInfo, Store

__all__ = [
    "FILES",
    "LAYOUT_META",
    "LEASE",
    "POINTER",
    "VERSIONS",
    "FileEntry",
    "Lease",
    "Pointer",
    "VersionFiles",
    "file_sha256",
    "files_json",
    "parse_files",
    "published_versions",
    "read_files",
    "read_pointer",
    "read_version",
    "version_id",
    "version_key",
]

POINTER = MANIFEST  # the current version's manifest: a synced copy (aws s3 sync) opens the same way
VERSIONS = "versions"
FILES = "files.json"
LEASE = ".packer-lease"
FILES_FORMAT = 1
POINTER_READS = 5  # reads of a pointer replaced at every resume of a broken GET, before ObjectChanged
#: The pointer's user metadata (``x-amz-meta-packer-layout``) where a publish wrote it: its version is
#: under ``versions/<id>/`` (a reader asks for its files.json and arrays at once). A copy synced as it
#: is, or one published before this was written, has none: a reader tries both places then.
LAYOUT_META = {"packer-layout": VERSIONS}
#: A lease not renewed for this long is its dead holder's, and the next writer takes it over.
LEASE_TTL_S = 120.0
#: The longest ttl a lease document is taken at (a hostile or mistyped one of years would keep every
#: writer out for as long).
MAX_LEASE_TTL_S = 86400.0
#: Refusals to create the lease (412) followed by a read that finds none, in a row, before a writer
#: without ``wait`` gives up: a store whose reads lag its writes would otherwise be asked forever.
LEASE_VANISHED = 5
DATE_RESOLUTION_S = 1.0  # of Last-Modified and Date
#: How long ``wait=True`` waits for another writer at most before it gives up.
WAIT_TIMEOUT_S = 6 * 3600.0

_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """Where data file NAME's bytes live (``key``, relative to U), their size and sha256 ("" where
    not recorded)."""

    key: str
    size: int
    sha256: str = ""


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 files.json records of the local file at ``path``, read in 1 MiB blocks (a data
    file may be many GB): what a publish uploads and what verify checks a fetched LMDB file by."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def version_id(manifest_bytes: bytes) -> str:
    """A version's id: the first 32 hex digits of its manifest's sha256, as the read cache keys it."""
    return hashlib.sha256(manifest_bytes).hexdigest()[:32]


@dataclass(frozen=True)
class Pointer:
    """One version of the pointer: its bytes (the current version's manifest), its ETag, and whether
    a publish wrote it (:data:`LAYOUT_META`)."""

    text: bytes
    etag: str
    published: bool

    @property
    def version(self) -> str:
        return version_id(self.text)


def read_pointer(store: Store) -> Optional[Pointer]:
    """The pointer's bytes and ETag, one version of it (None: no dataset there), from one plain GET
    (:meth:`Store.read`), which answers both together: a publish replacing it meanwhile is seen
    before or after, whole. Only a GET whose body broke and whose resume found the pointer
    replaced (ObjectChanged: never spliced) reads it again, the version just committed; a pointer
    replaced so at every one of :data:`POINTER_READS` reads fails."""
    for _ in range(POINTER_READS - 1):
        with contextlib.suppress(ObjectChanged):
            return _read_pointer(store)
    return _read_pointer(store)


def _read_pointer(store: Store) -> Optional[Pointer]:
    try:
        data, info = store.read(POINTER)
    except ObjectNotFound:
        return None
    published = all(info.metadata.get(k) == v for k, v in LAYOUT_META.items())
    return Pointer(data, info.etag, published)


def version_key(version: str, name: str) -> str:
    """``versions/<id>/<name>``: an object of that version's folder."""
    return f"{VERSIONS}/{version}/{name}"


@dataclass(frozen=True)
class VersionFiles:
    """A version's ``files.json``: its data files, and the version it was published over
    (``parent``: "" for a first publish, None where the file does not say), which orders the
    versions for gc without comparing clocks."""

    files: dict[str, FileEntry]
    parent: Optional[str]


def files_json(entries: Mapping[str, FileEntry], *, parent: Optional[str] = None) -> bytes:
    """The bytes of a version's ``files.json`` (sorted, so one set of entries has one form);
    ``parent``: the current version this one is published over ("" for none)."""
    files = {
        name: {"key": e.key, "size": e.size, **({"sha256": e.sha256} if e.sha256 else {})}
        for name, e in sorted(entries.items())
    }
    doc: dict[str, Any] = {"format": FILES_FORMAT, "files": files}
    if parent is not None:
        doc["parent"] = parent
    return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")


def parse_files(data: bytes, *, where: str) -> dict[str, FileEntry]:
    """``files.json``'s entries; DatasetError (naming ``where``) for one packer did not write: a key
    outside U (absolute, or with ``..``) would point a reader anywhere in the bucket."""
    return _parse(data, where).files


def _parse(data: bytes, where: str) -> VersionFiles:
    try:
        doc = json.loads(data)
        if doc.get("format") != FILES_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this packer reads {FILES_FORMAT}")
        parent = doc.get("parent")
        if parent is not None and not (isinstance(parent, str) and (parent == "" or _ID.fullmatch(parent))):
            raise ValueError(f"parent {parent!r}")
        found: dict[str, FileEntry] = {}
        for name, e in doc["files"].items():
            key, size, sha = e["key"], e["size"], e.get("sha256", "")
            if not isinstance(key, str) or not key or key.startswith("/") or ".." in key.split("/"):
                raise ValueError(f"{name}: key {key!r} is not inside the dataset")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"{name}: size {size!r}")
            if sha and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
                raise ValueError(f"{name}: sha256 {sha!r}")
            found[name] = FileEntry(key, size, sha)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DatasetError(f"{where}: not a files.json packer wrote ({e})") from None
    return VersionFiles(found, parent)


def read_files(store: Store, version: str) -> Optional[dict[str, FileEntry]]:
    """Version ``version``'s data files as its ``files.json`` lists them; None where it has none (a
    dataset copied as it is, whose data files sit at U/NAME)."""
    found = read_version(store, version)
    return found.files if found is not None else None


def published_versions(store: Store) -> list[str]:
    """The ids of the versions whose folder has its files.json (published whole), in key order;
    empty for a dataset synced as it is."""
    suffix = "/" + FILES
    return [o.key.split("/")[1] for o in store.list(f"{VERSIONS}/") if o.key.endswith(suffix) and o.key.count("/") == 2]


def read_version(store: Store, version: str) -> Optional[VersionFiles]:
    """Version ``version``'s ``files.json``; None where it has none."""
    if not _ID.fullmatch(version):
        raise DatasetError(f"{store.url}: {version!r} is not a version id")
    key = version_key(version, FILES)
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None
    return _parse(data, store.name(key))


def utc(t: float) -> str:
    """A time for messages: ``2026-12-01 03:00:02 UTC``."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Lease:
    """The one-writer lease of the dataset at the store's URL, held for a ``with`` block: the object
    ``U/.packer-lease`` names its holder, and only the holder publishes, compacts or collects garbage.

    Taken with ``PUT If-None-Match: *`` (only one writer can create it), renewed every ``ttl_s / 3``
    by a thread with ``PUT If-Match`` on the ETag it last wrote, deleted (``If-Match`` again) at
    the end. A holder that died (kill -9, a lost machine) stops renewing: once the lease's age by the
    store's own clock (its Date minus the lease's Last-Modified, so no two machines' clocks are
    compared) passes the holder's ``ttl_s``, the next writer takes it over with ``If-Match`` on the
    ETag it saw; one of this machine (the same kernel and pid namespace) whose process is gone, at
    once. Another live holder: BuildError "U is being built by HOST pid N since ...", the local
    build lock's wording, or with ``wait`` a wait for it (``wait_timeout_s`` at most).

    What the store must support: conditional PUTs (AWS S3 does since 2024; SeaweedFS does, see
    docs/OBJECT-STORAGE.md). A store that ignores them would let two writers both "win"; the lease
    probes for that once (a second If-None-Match PUT of its own bytes must be refused) and then
    refuses to go on, unless ``unguarded``: the user's word that no second writer runs. SeaweedFS
    checks If-Match without a lock (two racing takeovers can both succeed), so the lease reads itself
    back after a takeover, a renewal that is refused marks it lost, and :meth:`check` (called by the
    publish right before its commit, the pointer PUT) raises once it is lost.
    """

    def __init__(
        self,
        store: Store,
        *,
        holder: str = "",
        wait: bool = False,
        ttl_s: float = LEASE_TTL_S,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
        unguarded: bool = False,
        quiet: bool = False,
    ) -> None:
        self.store, self.wait, self.ttl_s, self.wait_timeout_s = store, wait, ttl_s, wait_timeout_s
        self.holder = holder or f"{socket.gethostname()} pid {os.getpid()}"
        self.unguarded, self.quiet = unguarded, quiet
        self.token = uuid.uuid4().hex
        self.etag = ""
        self.lost = ""  # why the lease is no longer this holder's ("" while it is)
        self._since = 0.0
        self._renewed = 0.0  # when the last write of the lease that the store took was sent (monotonic)
        self._renewals = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def name(self) -> str:
        return self.store.name(LEASE)

    def _body(self) -> bytes:
        doc = {"holder": self.holder, "token": self.token, "since": self._since, "ttl_s": self.ttl_s}
        doc |= {"machine": _machine(), "pid": os.getpid()}
        return json.dumps(doc | {"renewal": self._renewals}).encode("utf-8")

    def __enter__(self) -> Lease:
        self._take()
        self._thread = threading.Thread(target=self._renew, name="packer-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: Optional[type[BaseException]], error: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        try:
            self.store.delete(LEASE, if_match=self.etag)
        except PreconditionFailed:
            pass  # taken over meanwhile: the lease is someone else's now
        except StoreError as e:
            say(f"warning: {self.name} not removed ({e}); it expires {self.ttl_s:.0f} s after its last renewal")

    def check(self) -> None:
        """BuildError when the lease is no longer this holder's (a commit now could race another writer),
        or may not be: its last renewal the store took was sent two renewal periods ago (a renewal
        stuck in a slow store), as long as another writer waits before it takes a lease over."""
        lost = self.lost
        stale = time.monotonic() - self._renewed
        if not lost and stale >= 2 * self.ttl_s / 3:
            lost = f"not renewed for {stale:.0f} s: another writer may have taken it over"
        if lost:
            raise BuildError(
                f"{self.store.url}: this publish lost its lease ({lost}); nothing was committed, run it again"
            )

    def _read(self) -> Optional[tuple[ObjectInfo, dict[str, Any]]]:
        """The lease as it is (its size, version and dates, and its document), None when there is none."""
        try:
            data, info = self.store.read(LEASE)
            doc = json.loads(data)
        except (ObjectNotFound, ObjectChanged):
            return None
        except (ValueError, RecursionError):  # not a lease packer wrote: treated as one held for the default time
            doc = {}
        return info, _lease_fields(doc)

    def _take(self) -> None:
        """Create the lease, or take over an expired one, or raise/wait while another holds it."""
        deadline = time.monotonic() + self.wait_timeout_s
        first_seen: dict[str, float] = {}  # ETag -> when this process first saw it (a store giving no dates)
        announced = False
        vanished = 0  # refusals to create it in a row whose read found none
        while True:
            self._since = time.time()  # when it was taken, not when the wait for it began
            try:
                sent = time.monotonic()
                self.etag = self.store.put(LEASE, self._body(), if_none_match=True).etag
                self._renewed = sent
                self._probe()
                return
            except PreconditionFailed:
                pass
            current = self._read()
            if current is None:  # released meanwhile: try to create it again, a few times at once
                vanished += 1
                if vanished % LEASE_VANISHED:
                    continue
                if not self.wait or time.monotonic() > deadline:
                    raise BuildError(
                        f"{self.name}: the store refused to create it (it exists) and then had none to read, "
                        f"{vanished} times in a row (a store whose reads lag its writes?); run it again"
                    )
                time.sleep(min(5.0, self.ttl_s / 4))
                continue
            vanished = 0
            info, doc = current
            ttl = doc["ttl_s"]
            seen = time.monotonic() - first_seen.setdefault(info.etag, time.monotonic())
            age = info.served - info.modified if info.modified and info.served else seen
            # HTTP dates are whole seconds: the age by them may be a second too long. They are the store's
            # (its Date and Last-Modified may come from two nodes whose clocks disagree), so a lease they
            # call expired is taken over only once seen unchanged for two of its renewal periods too.
            old = age - DATE_RESOLUTION_S >= ttl and seen >= 2 * ttl / 3
            expired = seen >= ttl or old or _died_here(doc)
            if expired and self._take_over(info, doc):
                return
            holder = doc["holder"]
            since = f" since {utc(doc['since'])}" if "since" in doc else ""
            if not self.wait:
                raise BuildError(
                    f"{self.store.url} is being built by {holder}{since} (lease renewed {max(0.0, age):.0f} s ago, "
                    f"taken over {ttl:.0f} s after its last renewal if its holder died; wait for it with --wait)"
                )
            if time.monotonic() > deadline:
                raise BuildError(
                    f"{self.store.url} is being built by {holder}{since}; gave up waiting after "
                    f"{self.wait_timeout_s:.0f} s"
                )
            if not announced:
                say(f"waiting for {holder}, which is building {self.store.url}", self.quiet)
                announced = True
            time.sleep(min(5.0, ttl / 4))

    def _take_over(self, info: ObjectInfo, doc: dict[str, Any]) -> bool:
        """Replace the expired lease ``info`` with ours; False when another writer got there first."""
        try:
            sent = time.monotonic()
            self.etag = self.store.put(LEASE, self._body(), if_match=info.etag).etag
            self._renewed = sent
        except PreconditionFailed:
            return False
        mine = self._read()  # a store that checks If-Match without a lock may let two takers both win
        if mine is None or mine[1].get("token") != self.token:
            return False
        why = "its process is gone" if _died_here(doc) else "expired"
        say(f"took over the lease of {doc['holder']} on {self.store.url} ({why})", self.quiet)
        return True

    def _probe(self) -> None:
        """Refuse a store that ignores If-None-Match (it would let a second writer in) unless unguarded."""
        probe = json.dumps(json.loads(self._body()) | {"probe": True}).encode("utf-8")  # still our lease
        try:  # other bytes than the lease's, so that a retry's read-back (Store.put) cannot take them for ours
            self.etag = self.store.put(LEASE, probe, if_none_match=True).etag
        except PreconditionFailed:
            return
        if self.unguarded:
            say(
                f"warning: {self.store.url}: the store ignores conditional writes; nothing keeps a second writer out",
                self.quiet,
            )
            return
        self.store.delete(LEASE)
        raise BuildError(
            f"{self.store.url}: the store ignores conditional writes (If-None-Match), so packer cannot keep two "
            "writers of the dataset apart; make sure only one runs and publish unguarded"
        )

    def _renew(self) -> None:
        """Renew every ttl/3 until stopped; a refused renewal, or none for ttl_s, marks the lease lost."""
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            self._renewals += 1
            try:
                sent = time.monotonic()
                self.etag = self.store.put(LEASE, self._body(), if_match=self.etag).etag
                last_ok = self._renewed = sent
            except PreconditionFailed:
                current = self._read()
                if current is not None and current[1]["token"] == self.token:
                    # a renewal the store took although its answer was lost (StoreError below): still ours
                    self.etag = current[0].etag
                    continue
                who = current[1]["holder"] if current else "nobody"
                self.lost = f"{self.name} is now held by {who}"
                return
            except StoreError as e:
                if time.monotonic() - last_ok >= self.ttl_s:
                    self.lost = f"not renewed for {self.ttl_s:.0f} s: {e}"
                    return


def _lease_fields(doc: object) -> dict[str, Any]:
    """A lease document's fields as the lease uses them, whoever wrote it: a holder of one short line,
    a finite ttl >= 0 (the default where it has none), and a ``since`` and ``pid`` only where they can
    be one, so that a hostile or mangled lease ends in one line of BuildError, or an expiry, not a
    crash or a message of its own size."""
    doc = doc if isinstance(doc, dict) else {}
    holder = str(doc.get("holder", "another writer")).splitlines() or [""]
    shown = "".join(c if c.isprintable() else "?" for c in holder[0][:200])  # no terminal escapes
    out: dict[str, Any] = {"holder": shown or "another writer", "token": doc.get("token")}
    ttl = doc.get("ttl_s", LEASE_TTL_S)
    out["ttl_s"] = min(MAX_LEASE_TTL_S, max(0.0, float(ttl))) if _number(ttl) else LEASE_TTL_S
    since = doc.get("since")
    if _number(since) and 0 <= since < 1e11:  # up to year 5138
        out["since"] = float(since)
    pid = doc.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31:
        out["pid"] = pid
    out["machine"] = str(doc.get("machine", ""))
    return out


def _number(value: object) -> TypeGuard[float]:
    """A finite JSON number (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _machine() -> str:
    """This kernel's boot and process-id namespace ("" where unknown): two lease holders with the
    same value see the same processes, so one can tell whether the other's pid still runs (a host
    name alone would not do: containers and cloned machines share them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _died_here(doc: dict[str, Any]) -> bool:
    """The lease ``doc`` is held by a process of this machine that no longer runs (kill -9, a crash):
    taken over at once instead of after its ttl. A pid since reused by another process only delays it."""
    pid, machine = doc.get("pid"), _machine()
    if not machine or doc.get("machine") != machine or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False
