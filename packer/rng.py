"""The documented path of the per-draw seeding for user transforms (docs/DATASET.md); it lives in packer.read.rng."""

from .read.rng import generator, sample_seed  # noqa: F401
