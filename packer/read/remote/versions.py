"""A dataset's versions: the pointer read, and the version's manifest, index and label arrays
fetched, checked and renamed into its directory of the cache whole."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ...format import INDEX, LABELS, MANIFEST, SOURCES, TARGETS, DatasetError, Manifest, map_npy, open_regular
from ...store import ObjectNotFound, Store
from ...store.published import FILES, files_json, read_files, read_pointer, version_key
from . import settings
from .checks import metadata_problem
from .eviction import Files
from .locks import locked
from .paths import LOCKS, PARTIAL, RECHECK, UNITS, VERSIONS


def fetch_version(store: Store, url: str, home: Path, *, reserve: Callable[[Files], None]) -> str:
    """The current version's key of the dataset at ``url`` (``store``) cached in ``home``, its
    manifest and index fetched and checked into the cache first (written by ``reserve``, which
    makes their room under the cache limit). An index that does not match the manifest (a refresh
    was publishing between the two reads) is fetched again with the manifest. A cached version
    whose files.json a read found wrong (:func:`suspect_files`) has it read again first."""
    for d in (UNITS, PARTIAL, VERSIONS, LOCKS):
        (home / d).mkdir(parents=True, exist_ok=True)
    (home / "url").write_text(url + "\n")
    problem = ""
    for _ in range(settings.VERIFY_ATTEMPTS):
        pointer = read_pointer(store)
        if pointer is None:
            raise DatasetError(f"{url}: not a packer dataset (no {MANIFEST}; wrong URL?)")
        text, version = pointer.text, pointer.version
        root = home / VERSIONS / version
        if (root / MANIFEST).is_file() and not (root / RECHECK).exists():
            return version
        with locked(home / LOCKS / f"version-{version}", named=f"{url} (version {version})"):
            if (root / MANIFEST).is_file():
                if (root / RECHECK).exists():
                    _recheck_files(store, home, root, published=pointer.published, reserve=reserve)
                return version
            problem = _fetch_metadata(store, url, home, text, root, published=pointer.published, reserve=reserve)
            if not problem:
                return version
    raise DatasetError(f"{url}: {problem} after {settings.VERIFY_ATTEMPTS} downloads")


def suspect_files(root: Path) -> None:
    """Mark the cached version at ``root`` as one whose files.json a read of its data found wrong
    (an object it names missing, of another size, or of other bytes): the next open reads the
    bucket's files.json again (:func:`_recheck_files`), so that one repaired there is seen without
    clearing the cache. A synced copy (no files.json) has nothing to read again."""
    if (root / FILES).is_file():
        with contextlib.suppress(FileNotFoundError):  # the version evicted meanwhile
            (root / RECHECK).touch()


def _recheck_files(store: Store, home: Path, root: Path, *, published: bool, reserve: Callable[[Files], None]) -> None:
    """The files.json of the cached version at ``root`` replaced by the bucket's where they differ
    (renamed into place whole: a reader that read the old one keeps it), then trusted again; one
    the bucket no longer has dropped where the pointer is a synced copy's (its data files are at
    U/NAME). One that does not parse, or none where the pointer says it was published, fails the
    open in one line naming it, as the version's first open does."""
    listed = read_files(store, root.name)
    if listed is None and published:
        name = version_key(root.name, FILES)
        raise DatasetError(f"{store.url}: {name} is missing (the pointer says it was published)")
    if listed is None:
        (root / FILES).unlink()
    elif (root / FILES).read_bytes() != (text := files_json(listed)):
        staging = home / PARTIAL / f"{root.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            reserve({staging: None, staging / FILES: text})
            os.replace(staging / FILES, root / FILES)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    (root / RECHECK).unlink()


def _fetch_metadata(
    store: Store, url: str, home: Path, text: bytes, root: Path, *, published: bool, reserve: Callable[[Files], None]
) -> str:
    """Manifest ``text``'s index and label arrays downloaded and checked into ``root`` (renamed
    into place whole); what did not match ("" when all did). ``published``: the pointer says
    its version is under ``versions/<id>/`` (packer.store.published.LAYOUT_META)."""
    staging = home / PARTIAL / f"{root.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        reserve({staging: None, staging / MANIFEST: text})  # the folder counted too: it becomes the version's
        fd = open_regular(staging / MANIFEST)
        try:
            manifest = Manifest.read(fd, f"{url}/{MANIFEST}")
        finally:
            os.close(fd)
        if manifest.manifest_digest and manifest.computed_digest != manifest.manifest_digest:
            return f"{MANIFEST}: its content does not match its manifest_digest"
        names = [INDEX, SOURCES]
        names += [LABELS] if manifest.label_kind == "multi" else []
        names += [TARGETS] if manifest.targets else []
        # asked together (one first-byte wait): the version's files.json (None: a synced copy) and
        # the arrays where the pointer says they are, or (it does not say) where a synced copy has them
        with concurrent.futures.ThreadPoolExecutor(2 * len(names) + 1) as pool:
            listing = pool.submit(read_files, store, root.name)
            keys = [version_key(root.name, name) if published else name for name in names]
            bodies = [pool.submit(store.get, key) for key in keys]
            listed = listing.result()
            if listed is None and published:
                return f"{version_key(root.name, FILES)} is missing (the pointer says it was published)"
            contents: Files = {}
            if listed is not None:  # published (packer.tools.publish): the version's folder and files.json
                contents[staging / FILES] = files_json(listed)
                if not published:  # by a packer that did not mark the pointer: the arrays are there too
                    keys = [version_key(root.name, name) for name in names]
                    bodies = [pool.submit(store.get, key) for key in keys]
        for name, key, body in zip(names, keys, bodies):
            try:
                contents[staging / name] = body.result()
            except ObjectNotFound:
                raise DatasetError(f"{store.name(key)}: missing (the manifest names it)") from None
        reserve(contents)
        arrays = {}
        for name in names:
            fd = open_regular(staging / name)
            try:
                arrays[name] = map_npy(fd, f"{url}/{name}")
            finally:
                os.close(fd)
        problem = metadata_problem(manifest, arrays)
        if problem:
            return problem
        if root.is_dir() and not (root / MANIFEST).is_file():  # a folder left without its manifest: no reader pins it
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(staging, root)
        except OSError:
            if not (root / MANIFEST).is_file():
                raise
        return ""
    finally:
        shutil.rmtree(staging, ignore_errors=True)
