"""The documented path of the Dask build (docs/DISTRIBUTED.md); it lives in packer.builder.dask."""

from .builder.dask import build_dask  # noqa: F401
