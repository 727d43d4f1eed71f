"""``packer clean``: delete a dataset, its interrupted build and its replaced copy, under the build's
lock, and only what packer made (:func:`packer.builder.paths.made_by_packer`).

For a published dataset (a URL, :func:`clean_url`), what an interrupted publish left behind: its
multipart uploads (their parts are stored, and paid for, until aborted), the version folders no
pointer named (no files.json, or never committed), and a dead writer's expired lease (taken over,
and said). The published versions stay: readers may be using them (``packer gc`` drops old ones);
to delete the whole dataset, delete its prefix with the store's own tools."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..builder.paths import build_lock, dataset_path, made_by_packer
from ..builder.staging import old_path, staging_path
from ..errors import BuildError, local_path
from ..store import open_store
from ..store.published import Lease, utc
from .gc import gc

__all__ = ["clean", "clean_url"]


def clean(out: str | os.PathLike) -> list[Path]:
    """Delete the dataset at OUT, its interrupted build and its replaced copy (``.NAME.packer-tmp``,
    ``.NAME.packer-old``), and nothing else; returns what was deleted. Behind a symlink, the dataset
    the link points to goes, then the link. Refuses (BuildError) anything that is not packer's, and
    an OUT that a build holds."""
    given, out = local_path(out), dataset_path(out)
    if not out.parent.is_dir():  # nothing there to delete (and no folder to make for a lock file)
        if given.is_symlink():
            given.unlink()
            return [given]
        return []
    with build_lock(out):
        doomed = [path for path in (out, staging_path(out), old_path(out)) if path.exists() or path.is_symlink()]
        for path in doomed:
            if not made_by_packer(path, sibling=path != out):
                raise BuildError(f"{path} is not a packer dataset or build folder; refusing to delete it")
        for path in doomed:
            shutil.rmtree(path)
        if given.is_symlink():
            given.unlink()
            doomed.append(given)
    return doomed


def clean_url(url: str, *, wait: bool = False, quiet: bool = False) -> list[str]:
    """Clean up after interrupted publishes of the dataset at ``url`` (see the module), under its
    lease; returns what was deleted or aborted, one line each."""
    store = open_store(url)
    with Lease(store, wait=wait, quiet=quiet):
        uploads = store.uploads()
        for upload in uploads:
            store.abort(upload)
        done = [f"the unfinished upload of {store.name(u.key)} (begun {utc(u.initiated)})" for u in uploads]
        # every version the pointer named is kept, however old; only what no pointer named goes
        report = gc(store, keep_versions=sys.maxsize, keep_age_s=0)
    return done + [store.name(o.key) for o in report.deleted]
