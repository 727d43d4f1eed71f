"""packer: preprocess an image folder once, pack it into LMDB or memmap shards, train from it fast.

``import packer`` stays light: torch is imported only when ShardDataset or ShardSampler is first used.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .errors import (
    BuildError,
    CacheWaitTimeout,
    DatasetError,
    DatasetReplaced,
    LabelError,
    ObjectChanged,
    ObjectNotFound,
    PackerError,
    PreconditionFailed,
    ScanError,
    ShardError,
    StoreError,
    URLNotSupported,
    VersionsDiffer,
)

__all__ = [
    "BuildError",
    "BuildOptions",
    "BuildReport",
    "CacheWaitTimeout",
    "DatasetError",
    "DatasetReplaced",
    "LabelError",
    "Labelling",
    "MixDataset",
    "ObjectChanged",
    "ObjectNotFound",
    "PackerError",
    "PreconditionFailed",
    "ScanError",
    "ShardDataset",
    "ShardError",
    "ShardSampler",
    "StoreError",
    "URLNotSupported",
    "VersionsDiffer",
    "Writer",
    "__version__",
    "build",
    "pack",
    "publish",
]


def __getattr__(name: str) -> Any:
    if name in ("build", "BuildOptions", "BuildReport"):
        from .builder import pipeline as _pipeline

        return getattr(_pipeline, name)
    if name == "publish":  # build to a URL: stage locally, then upload (packer.tools.publish)
        from .tools.publish import publish_build

        return publish_build
    if name in ("Writer", "pack"):  # a dataset from code, with fields (packer.builder.writer), to a URL too
        from .tools import publish as _publish

        return getattr(_publish, name)
    if name == "Labelling":
        from .builder.labels import Labelling

        return Labelling
    if name == "ShardDataset":
        from .read.dataset import ShardDataset

        return ShardDataset
    if name == "MixDataset":
        from .read.mix import MixDataset

        return MixDataset
    if name == "ShardSampler":
        from .read.sampler import ShardSampler

        return ShardSampler
    raise AttributeError(f"module 'packer' has no attribute {name!r}")
