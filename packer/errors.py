"""Every error type packer raises on purpose, in one place, under one base (PackerError), so that
callers (and the CLI) catch one type for every failure packer expects: bad arguments or input
(BuildError, ScanError, LabelError), a damaged, hostile or replaced dataset (DatasetError,
DatasetReplaced), a failed distributed task (ShardError). Anything else is a bug and keeps its
traceback."""

from __future__ import annotations

import sys
from typing import Optional


class PackerError(Exception):
    """An expected failure; the message is one line that names the file, record or option at fault."""


class BuildError(PackerError):
    """An expected failure (bad arguments, existing OUT, unusable raw/); the CLI prints it in one line."""


class ScanError(PackerError):
    """raw/ or the labels file cannot be used as given; the message says why."""


class LabelError(PackerError):
    """The labels CSV or class list cannot be used as given; the message names the file and line."""


class DatasetError(PackerError):
    """A dataset on disk is missing, damaged or not one packer can read; the message says which.
    ``record`` is the damaged record's index, when one is to blame."""

    def __init__(self, message: str, record: Optional[int] = None) -> None:
        super().__init__(message)
        self.record = record


class DatasetReplaced(DatasetError):
    """The dataset at a reader's path is no longer the version the reader opened."""


class ShardError(PackerError):
    """A task failed; the message names the shard and the file being processed."""


def say(message: str, quiet: bool = False) -> None:
    """One line to the user on stderr, prefixed ``packer:`` (unless ``quiet``): how the build tells
    what it does instead of what was asked (a rewrite, a reused dataset it cannot read, a note)."""
    if not quiet:
        print(f"packer: {message}", file=sys.stderr, flush=True)
