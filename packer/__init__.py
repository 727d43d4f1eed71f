"""packer: preprocess an image folder once, pack it into LMDB or memmap shards, train from it fast.

``import packer`` stays light: torch is imported only when ShardDataset or ShardSampler is first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "BuildError",
    "BuildOptions",
    "BuildReport",
    "DatasetError",
    "Labelling",
    "MixDataset",
    "PackerError",
    "ShardDataset",
    "ShardSampler",
    "__version__",
    "build",
]


def __getattr__(name: str) -> Any:
    if name in ("build", "BuildOptions", "BuildReport", "BuildError"):
        from . import pipeline as _pipeline

        return getattr(_pipeline, name)
    if name == "PackerError":
        from .errors import PackerError

        return PackerError
    if name == "Labelling":
        from .labels import Labelling

        return Labelling
    if name == "DatasetError":
        from .format import DatasetError

        return DatasetError
    if name == "ShardDataset":
        from .dataset import ShardDataset

        return ShardDataset
    if name == "MixDataset":
        from .mix import MixDataset

        return MixDataset
    if name == "ShardSampler":
        from .sampler import ShardSampler

        return ShardSampler
    raise AttributeError(f"module 'packer' has no attribute {name!r}")
