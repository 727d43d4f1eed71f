"""Issue 39's soak: DDP ranks on one node, sharing one cache of half the data in the real S3
server, never hang (tests/store/soak.py: the harness, its watchdog and its checks). The long run
(more ranks, minutes) is scripts/soak_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from packer.read.remote import settings

from .seaweed import S3Server
from .soak import Soak, soak, verdict


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ddp_ranks_through_half_a_cache_never_hang(
    context: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 spawned gloo ranks x 2 persistent DataLoader workers (``context``), an all_reduce per
    batch, default ShardSampler, 20 epochs through a cache_limit of half the data's units, a
    refresh published (and read whole by a fresh open on the same cache) after epoch 10 while the
    ranks read: every rank makes progress (no 30 s without a batch, else every process's stacks are
    in the failure), reads its share of every epoch, each sample the first version's record its
    sampler drew; the fresh open reads the new version right; ``du`` of the cache never exceeds
    the limit."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    monkeypatch.setattr(settings, "UNIT_BYTES", settings.UNIT_BYTES)  # prepare() sets the soak's
    shape = Soak(ranks=4, workers=2, epochs=20, context=context, publish_every=10)
    run = soak(s3_server, tmp_path, shape, say=print)
    assert not verdict(run), "\n".join(verdict(run))
    assert run.epochs == 20 and len(run.published) == 1 and run.fresh == [""]
    assert 0 < run.peak <= run.limit
