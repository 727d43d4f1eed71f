"""Every error type packer raises on purpose, in one place, under one base (PackerError), so that
callers (and the CLI) catch one type for every failure packer expects: bad arguments or input
(BuildError, ScanError, LabelError), a damaged, hostile or replaced dataset (DatasetError,
DatasetReplaced), a failed distributed task (ShardError), a URL where only local paths work yet
(URLNotSupported), an object store's refusals (StoreError and its kinds, PreconditionFailed: a
conditional write that lost). Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
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


class VersionsDiffer(DatasetError):
    """The ranks of a distributed job opened different versions of a dataset (a refresh landed
    between their opens) and cannot all read one: their step counts would differ and DDP hang."""


class CacheWaitTimeout(DatasetError):
    """A wait of the node cache (packer.read.remote: a lock, a download, room in the cache) ran past
    its deadline; the message names the unit, its object and the process holding it."""


class LockDisciplineError(AssertionError):
    """A thread broke the node cache's lock discipline (packer.read.remote's docstring): it waited
    while holding a node lock, or took node locks out of their order. A bug, raised only where
    ``PACKER_LOCK_CHECK=1`` turns the check on (the test suite)."""


class ShardError(PackerError):
    """A task failed; the message names the shard and the file being processed."""


class URLNotSupported(PackerError):
    """A URL (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``...) where packer takes local paths only."""


class StoreError(DatasetError):
    """An object store refused a request, or kept failing it; the message names the object."""


class ObjectNotFound(StoreError):
    """The object does not exist (404)."""


class ObjectChanged(StoreError):
    """The object was replaced while it was being read (its ETag no longer matches)."""


class PreconditionFailed(StoreError):
    """A conditional write lost: the object exists (``If-None-Match: *``) or is no longer the version
    named (``If-Match``); HTTP 412, or S3's 409 ConditionalRequestConflict for a concurrent one."""


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")  # two letters at least: not a Windows drive (C://)


def is_url(path: str | os.PathLike) -> bool:
    """``scheme://...``: a URL, not a local path."""
    return _URL.match(os.fsdecode(path)) is not None


def local_path(path: str | os.PathLike) -> Path:
    """``path`` as a local Path; a URL raises URLNotSupported. ``Path("s3://b/x")`` is the relative
    path ``s3:/b/x``: a build would write a folder named ``s3:`` in the working directory. Every entry
    point that does not read a URL passes its paths through here (build's raw folder and OUT, clean,
    compact); verify, ShardDataset and the commands that read a dataset take URLs
    (packer.read.remote), and the CLI's build and compact publish to them (packer.tools.publish)."""
    text = os.fsdecode(path)
    if is_url(text):
        raise URLNotSupported(
            f"{text}: URLs are not supported here; give a local path (packer reads datasets from object storage; "
            "`packer build RAW s3://...`, `packer compact s3://...` and packer.publish(RAW, URL) publish to it)"
        )
    return Path(text)


def say(message: str, quiet: bool = False) -> None:
    """One line to the user on stderr, prefixed ``packer:`` (unless ``quiet``): how the build tells
    what it does instead of what was asked (a rewrite, a reused dataset it cannot read, a note)."""
    if not quiet:
        print(f"packer: {message}", file=sys.stderr, flush=True)
