"""``packer clean``: delete a dataset, its interrupted build and its replaced copy, under the build's
lock, and only what packer made (:func:`packer.builder.paths.made_by_packer`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..builder.paths import build_lock, dataset_path, made_by_packer
from ..builder.staging import old_path, staging_path
from ..errors import BuildError, local_path

__all__ = ["clean"]


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
