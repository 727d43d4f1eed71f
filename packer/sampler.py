"""The documented path of the sampler's index type (docs/DATASET.md); it lives in packer.read.sampler."""

from .read.sampler import Draw, ShardSampler  # noqa: F401
