"""A small uploader of a locally built dataset in the published layout (docs/OBJECT-STORAGE.md),
for the tools tests: data files not in the previous version (by name, size and sha256) under
versions/<id>/, the metadata, files.json, then the pointer, conditional on the previous one."""

from __future__ import annotations

import hashlib
from pathlib import Path

from packer.backends import data_files
from packer.format import INDEX, LABELS, MANIFEST, SOURCES, TARGETS, Manifest
from packer.store import ObjectNotFound
from packer.store.base import Store
from packer.store.published import (
    FILES,
    LAYOUT_META,
    POINTER,
    FileEntry,
    files_json,
    read_files,
    version_id,
    version_key,
)


def publish(store: Store, local: Path) -> str:
    """Publish the dataset at ``local`` as the new current version of ``store``'s URL; its id."""
    text = (local / MANIFEST).read_bytes()
    version = version_id(text)
    try:
        pointer = store.head(POINTER)
        parent = version_id(store.get(POINTER))
        before = read_files(store, parent) or {}
    except ObjectNotFound:
        pointer, parent, before = None, "", {}
    entries = {}
    for name in data_files(Manifest.load(local)):
        sha = hashlib.sha256((local / name).read_bytes()).hexdigest()
        old = before.get(name)
        if old is not None and old.sha256 == sha:
            entries[name] = old
            continue
        key = version_key(version, name)
        entries[name] = FileEntry(key, store.put_file(key, local / name, metadata={"sha256": sha}).size, sha)
    for name in (MANIFEST, INDEX, SOURCES, LABELS, TARGETS):
        if (local / name).exists():
            store.put(version_key(version, name), (local / name).read_bytes())
    store.put(version_key(version, FILES), files_json(entries, parent=parent))
    store.put(
        POINTER, text, metadata=LAYOUT_META, **({"if_match": pointer.etag} if pointer else {"if_none_match": True})
    )
    return version
