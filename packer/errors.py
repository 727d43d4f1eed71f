"""packer's one base error type, so that callers (and the CLI) catch one type for every failure packer
expects: bad arguments or input (BuildError, ScanError, LabelError), a damaged, hostile or replaced dataset
(DatasetError), a failed distributed task (ShardError). Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys


class PackerError(Exception):
    """An expected failure; the message is one line that names the file, record or option at fault."""


def say(message: str, quiet: bool = False) -> None:
    """One line to the user on stderr, prefixed ``packer:`` (unless ``quiet``): how the build tells
    what it does instead of what was asked (a rewrite, a reused dataset it cannot read, a note)."""
    if not quiet:
        print(f"packer: {message}", file=sys.stderr, flush=True)
