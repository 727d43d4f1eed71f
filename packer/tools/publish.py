"""A dataset in object storage (``s3://bucket/prefix/train.lmdb``), built, refreshed and compacted:
``packer build raw/ URL [--update]`` and ``packer compact URL``.

The dataset is staged on this machine first, by the local build (packer.builder) into a local copy
of it under the cache directory (or ``--staging DIR``), then published in the order that keeps the
remote dataset whole at every moment (the layout: packer.store.published): the data files the store
does not hold yet, each under ``versions/<id>/`` of the new version (never overwriting an object),
then that version's metadata, then its ``files.json``, and last the pointer ``manifest.json``, one
PUT conditional on the ETag of the version it replaces (``If-Match``; ``If-None-Match`` on the first
publish). Until that PUT succeeds readers see the previous version, whole; a publish that stops
before it is finished by running the same command again: the staged copy is still there (it is
kept after a publish, for the next refresh), is found up to date, and only what the store does not
hold yet is uploaded, an object counting as there when its size and ``sha256`` metadata match.

A refresh (``--update``) reuses the local copy when it is the version the store's pointer names
(the one this machine published last); otherwise (another machine published, or the staging folder
was deleted) it starts from the store's current version: its manifest, index and label arrays from
the read cache (packer.read.remote), not its data files, which the refresh keeps where they are
(packer.builder.segments, ``Base.elsewhere``): only the new segment is written and uploaded. A
refresh that rewrites records (past the dead-bytes or segment threshold) and ``packer compact URL``
fetch the data files whose records they copy through the read cache.

Two publishers of one URL: the store's one-writer lease (packer.store.published.Lease) is held
while publishing, and the pointer's If-Match stops a publish built on a version that another writer
replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..backends import data_files
from ..builder.options import SHARD_SIZE, BuildError, BuildOptions
from ..builder.paths import build_lock
from ..builder.pipeline import LocalEngine, run_build
from ..builder.segments import Fetch
from ..builder.split import TRAIN, split_path
from ..builder.staging import BUILD_OPTIONS, WRITER_OPTIONS, BuildReport, OptionNames, write_json_atomic
from ..builder.writer import Writer as LocalWriter
from ..errors import DatasetError, PreconditionFailed, URLNotSupported, is_url, say
from ..format import INDEX, LABELS, MANIFEST, REPORT, SOURCES, TARGETS, Manifest
from ..read.remote import Remote, default_cache_dir
from ..store import ObjectNotFound, Store, open_store
from ..store.published import (
    FILES,
    LAYOUT_META,
    FileEntry,
    Lease,
    Pointer,
    file_sha256,
    files_json,
    read_files,
    read_pointer,
    version_id,
    version_key,
)
from .compact import compact as compact_local

__all__ = ["Published", "Writer", "pack", "publish_build", "publish_compact"]

#: The metadata files of a version, uploaded into its ``versions/<id>/`` folder (those it has).
METADATA = (MANIFEST, INDEX, SOURCES, LABELS, TARGETS, REPORT)


@dataclass
class Published:
    """What a publish did: the version now current at ``url``, and what it uploaded (objects and
    bytes) and found already there (a rerun's)."""

    url: str
    version: str
    uploaded: int = 0
    uploaded_bytes: int = 0
    present: int = 0
    up_to_date: bool = False

    def summary(self) -> str:
        if self.up_to_date:
            return f"packer: {self.url} already is version {self.version}; nothing uploaded"
        return (
            f"packer: {self.url} is now version {self.version}: uploaded {self.uploaded} objects "
            f"({self.uploaded_bytes / 1e6:.1f} MB), {self.present} already there"
        )


@dataclass
class _Target:
    """One dataset at ``url`` and its local copy ``local`` (a --split build has one per split), with
    ``record``: what this machine last published there (a ``published*.json`` in the staging folder)."""

    url: str
    local: Path
    record: Path
    store: Store = field(init=False)

    def __post_init__(self) -> None:
        self.store = _writable_store(self.url)


def _writable_store(url: str) -> Store:
    """The store at ``url``, refused in one line where it is read-only (https://)."""
    store = open_store(url)
    if not store.writable:
        raise URLNotSupported(
            f"{url}: this store is read-only (packer publishes to s3:// URLs, and reads https:// ones)"
        )
    return store


def _work_folder(url: str, staging: Optional[str | os.PathLike]) -> Path:
    """Where the dataset at ``url`` is staged: ``staging`` or the cache directory's ``publish/``, in a
    folder named after the URL (as the read cache names its own)."""
    root = Path(staging) if staging is not None else default_cache_dir() / "publish"
    return root / Remote(url, cache_dir=root).home.name


def _load_record(path: Path) -> Optional[dict[str, Any]]:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def _inode(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size]


def _seed(t: _Target, current: Pointer) -> None:
    """Make ``t.local`` the store's current version ``current``: its metadata from the read cache, its
    data files left in the store, each listed in the record with its object (a synced copy's, with no
    files.json: at U/NAME, no sha256)."""
    remote = Remote(t.url)
    pinned = remote.pin()
    if remote.version != current.version:
        raise BuildError(f"{t.url} changed while it was being read (another publish?); run the build again")
    root = Path(pinned.root)
    seed = t.local.parent / f".{t.local.name}.seed"
    shutil.rmtree(seed, ignore_errors=True)
    seed.mkdir(parents=True)
    for name in METADATA:
        if (root / name).is_file():
            shutil.copyfile(root / name, seed / name)
    listed = read_files(t.store, current.version)
    with contextlib.suppress(ObjectNotFound):  # the files skipped last time, which a refresh tries again
        (seed / REPORT).write_bytes(t.store.get(version_key(current.version, REPORT) if listed else REPORT))
    if listed is None:
        listed = {name: FileEntry(name, t.store.head(name).size) for name in data_files(pinned.manifest)}
    del pinned
    shutil.rmtree(t.local, ignore_errors=True)
    seed.rename(t.local)
    _write_record(t, current.version, listed, {})


def _write_record(t: _Target, version: str, entries: dict[str, FileEntry], inodes: dict[str, list[int]]) -> None:
    """What this machine published at ``t.url`` last: each data file's object, and the local file's
    inode (device, inode, size) where it has one: the same file in a later version is not uploaded again."""
    files = {
        name: {"key": e.key, "size": e.size, "sha256": e.sha256, "inode": inodes.get(name)}
        for name, e in entries.items()
    }
    write_json_atomic(t.record, {"url": t.url, "version": version, "files": files})


def _fetch(targets: dict[Path, _Target]) -> Fetch:
    """The build's ``fetch``: old data files of a target's local copy brought in from the store,
    through the read cache (checked against the index on the way), for the records a rewrite copies."""

    def fetch(out: Path, names: list[str]) -> None:
        t = targets[out]
        remote = Remote(t.url)
        pinned = remote.pin()
        root = Path(pinned.root)
        record = _load_record(t.record) or {}
        if remote.version != record.get("version"):  # the files not on this disk are that version's
            raise BuildError(f"{t.url} changed while this build read it (another publish?); run the build again")
        for name in names:
            os.close(remote._open_file(root, name))
            _link_or_copy(root / name, out / name)

    return fetch


def _prepare(t: _Target, options: BuildOptions, names: OptionNames = BUILD_OPTIONS) -> Optional[Pointer]:
    """Before the build: the store's current version, with ``t.local`` made the copy the build
    refreshes (kept when it is that version or a staged one built on it, else seeded from the store)."""
    current = read_pointer(t.store)
    record = _load_record(t.record)
    if current is None:
        if record is not None:  # the store's dataset was deleted: everything is uploaded again
            t.record.unlink()
            if (t.local / MANIFEST).is_file() and any(
                not os.path.lexists(t.local / name) for name in data_files(Manifest.load(t.local))
            ):
                shutil.rmtree(t.local)  # it named data files that were only in the store
        return None
    if not (options.force or options.update or options.resume):
        raise BuildError(f"{t.url} already exists (use {names.force} to replace it, or {names.update} to refresh it)")
    ours = record is not None and record.get("version") == current.version and (t.local / MANIFEST).is_file()
    if not ours:
        if options.force:  # rebuilt whole: nothing of the store's version to start from
            shutil.rmtree(t.local, ignore_errors=True)
            _write_record(t, current.version, {}, {})
        else:
            _seed(t, current)
    return current


def _upload(store: Store, key: str, source: Path | bytes, done: Published) -> str:
    """``source`` (a file, or bytes) as object ``key`` unless the store holds it already: same size
    and ``sha256`` metadata (never the name alone: a rerun finds a half-sent object, or another
    version's); its sha256."""
    if isinstance(source, bytes):
        size, sha256 = len(source), hashlib.sha256(source).hexdigest()
    else:
        size, sha256 = os.path.getsize(source), file_sha256(source)
    with contextlib.suppress(ObjectNotFound):
        info = store.head(key)
        if info.size == size and info.metadata.get("sha256") == sha256:
            done.present += 1
            return sha256
    if isinstance(source, bytes):
        store.put(key, source, metadata={"sha256": sha256})
    else:
        store.put_file(key, source, metadata={"sha256": sha256})
    done.uploaded += 1
    done.uploaded_bytes += size
    return sha256


def _link_or_copy(source: Path, target: Path) -> None:
    """A data file from the read cache into a local copy: linked (no bytes copied), copied where the
    cache is on another filesystem."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _overtaken(t: _Target) -> BuildError:
    """Another writer published while this build ran: its version is not the one this build refreshed."""
    return BuildError(f"{t.url} was published by another writer while this build ran; {t.local} is kept: run it again")


def _publish(
    t: _Target, seen: Optional[Pointer], wait: bool, quiet: bool, names: OptionNames = BUILD_OPTIONS
) -> Optional[Published]:
    """Upload the local copy's version to ``t.url`` and make it current, under the store's lease;
    ``seen``: the pointer the build started from. None, with nothing committed, where another writer
    published since (:func:`_overtaken`)."""
    text = (t.local / MANIFEST).read_bytes()
    version = version_id(text)
    done = Published(t.url, version)
    if seen is not None and seen.version == version:
        done.up_to_date = True
        return done
    record = _load_record(t.record) or {"files": {}}
    known: dict[str, Any] = record["files"]
    with Lease(t.store, wait=wait, quiet=quiet) as lease:
        current = read_pointer(t.store)
        if (current.etag if current else None) != (seen.etag if seen else None):
            return None
        manifest = Manifest.load(t.local)
        entries: dict[str, FileEntry] = {}
        inodes: dict[str, list[int]] = {}
        for name in data_files(manifest):
            path = t.local / name
            old = known.get(name)
            if not os.path.lexists(path):
                if old is None:
                    raise BuildError(
                        f"{t.local}: {name} is neither on this disk nor in {t.url}; {names.run} with {names.force}"
                    )
                entries[name] = FileEntry(old["key"], int(old["size"]), old["sha256"])
                continue
            inode = _inode(path)
            if old is not None and old.get("inode") == inode:  # the same file as the version published
                entries[name] = FileEntry(old["key"], int(old["size"]), old["sha256"])
            else:
                key = version_key(version, name)
                entries[name] = FileEntry(key, inode[2], _upload(t.store, key, path, done))
            inodes[name] = inode
        for name in METADATA:
            if (t.local / name).is_file():
                _upload(t.store, version_key(version, name), t.local / name, done)
        parent = seen.version if seen is not None else ""  # the chain gc orders versions by
        _upload(t.store, version_key(version, FILES), files_json(entries, parent=parent), done)
        lease.check()  # still ours (a renewal refused: another writer took it over)
        try:
            t.store.put(
                MANIFEST, text, if_match=seen.etag if seen else "", if_none_match=seen is None, metadata=LAYOUT_META
            )
        except PreconditionFailed:
            return None
        done.uploaded += 1
        done.uploaded_bytes += len(text)
    _write_record(t, version, entries, inodes)
    return done


def _targets(url: str, options: BuildOptions, staging: Optional[str | os.PathLike]) -> tuple[Path, list[_Target]]:
    """The local copy of ``url`` (a --split build: a folder of them) and each dataset to publish."""
    url = url.rstrip("/")
    work = _work_folder(url, staging)
    last = url.split("://", 1)[-1].rsplit("/", 1)[-1]
    local = work / (re.sub(r"[^A-Za-z0-9._-]+", "_", last).strip(".") or "dataset")
    if not options.split:
        return local, [_Target(url, local, work / "published.json")]
    backend = options.resolved(local, SHARD_SIZE).backend
    parts = [split_path(local, name, backend) for name in (TRAIN, *options.split)]
    return local, [_Target(f"{url}/{p.name}", p, work / f"published-{p.name}.json") for p in parts]


def publish_build(
    raw_dir: str | os.PathLike,
    url: str,
    options: Optional[BuildOptions] = None,
    *,
    quiet: bool = False,
    staging: Optional[str | os.PathLike] = None,
    dask_address: Optional[str] = None,
    names: OptionNames = BUILD_OPTIONS,
    **changes: Any,
) -> tuple[BuildReport, list[Published]]:
    """``packer build raw/ URL``: stage the dataset locally (``staging``, default the cache directory;
    on this machine's cores, or on Dask at ``dask_address``), then publish it (see the module
    docstring); the build's report and each dataset's publish (one per --split)."""
    options = (options or BuildOptions()).but(**changes)
    local, targets = _targets(url, options, staging)
    by_path = {t.local: t for t in targets}
    # the local copy is refreshed, not rebuilt, unless --force: a staged copy that a publish did not
    # finish, or the store's version, is reused (what a rebuild would write, decoded only where changed)
    here = options if options.force else options.but(update=True)
    with build_lock(local.with_name(local.name + ".publish"), options.wait, quiet):
        while True:
            seen = {t.local: _prepare(t, options, names) for t in targets}
            if dask_address is not None:
                from ..builder.dask import build_dask

                report = build_dask(raw_dir, local, here, address=dask_address, quiet=quiet, fetch=_fetch(by_path))
            else:
                engine = LocalEngine(Path(raw_dir), quiet)
                report = run_build(raw_dir, local, here, quiet, engine, fetch=_fetch(by_path), names=names)
            done = [(t, _publish(t, seen[t.local], options.wait, quiet, names)) for t in targets]
            published = [p for _, p in done if p is not None]
            late = [t for t, p in done if p is None]
            if not late:
                break
            if not options.wait:
                raise _overtaken(late[0])
            say(f"{_overtaken(late[0])}; --wait: refreshing its version instead", quiet)
    report.out = url
    return report, published


class Writer(LocalWriter):
    """``packer.Writer``, whose OUT may also be an ``s3://`` URL: the dataset is written into its
    local copy (under the cache directory, or ``staging``), then published when the Writer closes,
    as ``packer build raw/ URL`` publishes (see the module docstring); ``published`` says what the
    publish did. Over a dataset the store holds already: ``update=True`` refreshes it (keyed by each
    sample's ``source``: only the new records' data file is uploaded), ``force=True`` replaces it.
    Another writer publishing meanwhile is a BuildError (the samples cannot be given again here:
    run it again, the local copy makes that a refresh)."""

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        fields: Any = None,
        options: Optional[BuildOptions] = None,
        staging: Optional[str | os.PathLike] = None,
        quiet: bool = True,
        **changes: Any,
    ) -> None:
        self.published: Optional[Published] = None
        self._target: Optional[_Target] = None
        self._lease = contextlib.ExitStack()
        if not is_url(out):
            super().__init__(out, fields=fields, options=options, quiet=quiet, **changes)
            return
        options = (options or BuildOptions()).but(**changes)
        local, targets = _targets(os.fspath(out), options.but(split=None), staging)  # split: refused below
        (t,) = targets
        # the local copy is refreshed with update (the samples keyed by source), else written whole
        here = options.but(force=not options.update or options.force)
        try:
            self._lease.enter_context(build_lock(local.with_name(local.name + ".publish"), options.wait, quiet))
            self._seen = _prepare(t, options, WRITER_OPTIONS)
            self._fetch = _fetch({t.local: t})
            super().__init__(t.local, fields=fields, options=here, quiet=quiet)
        except BaseException:
            self._lease.close()
            raise
        self._target = t

    def close(self) -> BuildReport:
        """Finish the local copy, then publish it (once)."""
        t = self._target
        if t is None or self.published is not None:
            return super().close()
        try:
            report = super().close()
            done = _publish(t, self._seen, self.options.wait, self._quiet, WRITER_OPTIONS)
            if done is None:
                raise _overtaken(t)
            self.published = done
        finally:
            self._lease.close()
        report.out = t.url
        return report

    def abort(self) -> None:
        super().abort()
        self._lease.close()


def pack(
    samples: Iterable[dict[str, Any]], out: str | os.PathLike, *, fields: Any = None, **options: Any
) -> BuildReport:
    """``packer.pack``: every sample of ``samples`` into a dataset at ``out``, a local path or an
    ``s3://`` URL (:class:`Writer`)."""
    return Writer.pack(samples, out, fields=fields, **options)


def publish_compact(
    url: str, *, quiet: bool = False, staging: Optional[str | os.PathLike] = None, wait: bool = False
) -> tuple[Manifest, Manifest, Published]:
    """``packer compact URL``: the store's current version fetched (through the read cache), rewritten
    into one segment on this machine (packer.tools.compact), published as a new version."""
    local, (t,) = _targets(url, BuildOptions(), staging)
    with build_lock(local.with_name(local.name + ".publish"), wait, quiet):
        seen = _prepare(t, BuildOptions(update=True))
        if seen is None:
            raise DatasetError(f"{t.url}: not a packer dataset (no {MANIFEST}; wrong URL?)")
        manifest = Manifest.load(t.local)
        missing = [name for name in data_files(manifest) if not os.path.lexists(t.local / name)]
        if missing:
            _fetch({t.local: t})(t.local, missing)
        old, new = compact_local(t.local, quiet)
        done = _publish(t, seen, wait, quiet)
        if done is None:
            raise _overtaken(t)
        return old, new, done
