"""Record readers over one pinned version of a dataset (see packer.backends.pin): the reader of its backend
(packer.backends.lmdb, packer.backends.memmap)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..backends import BACKENDS, Reader
from ..backends.pin import Pinned, pin
from ..format import DatasetError, Manifest


def open_reader(
    root: str | os.PathLike,
    manifest: Optional[Manifest] = None,
    index: Optional[np.ndarray] = None,
    pinned: Optional[Pinned] = None,
) -> Reader:
    """A reader of ``pinned``, or of the dataset at ``root`` as it is now (pinned here). ``manifest``
    must be that version's when given (a caller that loaded it by path earlier); ``index`` replaces the
    pinned one's rows (the caller checked it; tests pass edited copies)."""
    pinned = pinned or pin(str(Path(root).resolve()))
    if manifest is not None and (manifest.digest != pinned.manifest.digest or manifest.count != pinned.manifest.count):
        raise DatasetError(f"{pinned.root}: the dataset changed since its manifest was read; open it again")
    return BACKENDS[pinned.manifest.backend].reader(pinned, index)
