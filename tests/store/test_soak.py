"""Issue 39's soak: DDP ranks on one node, sharing one cache of half the data in the real S3
server, never hang (tests/store/soak.py: the harness, its watchdog and its checks). The default
run has 2 ranks, one's workers forked and the other's spawned (about a minute on 2 cores); the
issue's 4 ranks x fork and spawn take about three, so they run with ``-m soak``; the long run
(8 ranks, minutes) is scripts/soak_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from packer.read.remote import settings

from .seaweed import S3Server
from .soak import Soak, soak, verdict

FULL = [pytest.param(4, (context,), marks=pytest.mark.soak, id=f"4-ranks-{context}") for context in ("fork", "spawn")]


@pytest.mark.parametrize("ranks,contexts", [pytest.param(2, ("fork", "spawn"), id="2-ranks-fork-spawn"), *FULL])
def test_ddp_ranks_through_half_a_cache_never_hang(
    ranks: int, contexts: tuple[str, ...], s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spawned gloo ranks x 2 persistent DataLoader workers (forked or spawned), an all_reduce per
    batch, the default ShardSampler, 20 epochs through a cache_limit of half the data's units, a
    refresh published (and read whole by a fresh open on the same cache) after epoch 10 while the
    ranks read: every rank makes progress (no 30 s without a batch, else every process's stacks are
    in the failure), reads its share of every epoch, each sample the first version's record its
    sampler drew; the fresh open reads the new version right; ``du`` of the cache never exceeds
    the limit."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    monkeypatch.setattr(settings, "UNIT_BYTES", settings.UNIT_BYTES)  # prepare() sets the soak's
    shape = Soak(ranks=ranks, workers=2, epochs=20, contexts=contexts, publish_every=10)
    run = soak(s3_server, tmp_path, shape, say=print)
    assert not verdict(run), "\n".join(verdict(run))
    assert run.epochs == 20 and len(run.published) == 1 and run.fresh == [""]
    assert 0 < run.peak <= run.limit
