"""ShardDataset and the store clients against a real S3 server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from packer import ShardDataset

from .conftest import S3Server


def _same(a: ShardDataset, b: ShardDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x[0], y[0]) and x[1] == y[1]


@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_s3_dataset_reads_as_local(built, s3_server: S3Server, tmp_path: Path, backend: str) -> None:
    local = built(backend, "jpeg")
    url = s3_server.upload(local, f"same/{backend}")
    remote = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=tmp_path / "cache")
    _same(remote, ShardDataset(local, crop_size=None, dtype=torch.uint8))
