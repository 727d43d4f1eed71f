"""The documented path of the error a reader of a replaced dataset raises (docs/DATASET.md); see packer.errors."""

from .errors import DatasetReplaced  # noqa: F401
