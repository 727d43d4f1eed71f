"""Issue 39's soak: DDP ranks on one node, sharing one cache of half the data in the real S3
server, never hang (tests/store/soak.py: the harness, its watchdog and its checks). The default
run has 4 ranks whose workers are forked (ranks 0 and 2) and spawned (1 and 3), about a minute
on 2 cores; the same with every rank's workers forked, and spawned, runs with ``-m soak`` (two
minutes more). The long run (8 ranks, minutes) is scripts/soak_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from packer.read.remote import settings

from .seaweed import S3Server
from .soak import Soak, soak, verdict

CONTEXTS = [
    pytest.param(("fork", "spawn"), id="fork-and-spawn"),
    *(pytest.param((context,), marks=pytest.mark.soak, id=context) for context in ("fork", "spawn")),
]


@pytest.mark.parametrize("contexts", CONTEXTS)
def test_ddp_ranks_through_half_a_cache_never_hang(
    contexts: tuple[str, ...], s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 spawned gloo ranks x 2 persistent DataLoader workers (forked or spawned, rank by rank), an
    all_reduce per batch, the default ShardSampler, 20 epochs of 1,024 records (64 units) through
    a cache_limit of half the units, a refresh published (and read whole by a fresh open on the
    same cache) after epoch 10 while the ranks read: every rank makes progress (no 30 s without a
    batch, else every process's stacks and the cache's flocks are in the failure) and ends, reads
    its share of every epoch, each sample the first version's record its sampler drew; the fresh
    open reads the new version right; ``du`` of the cache never exceeds the limit."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "publisher-cache"))
    monkeypatch.setattr(settings, "UNIT_BYTES", settings.UNIT_BYTES)  # prepare() sets the soak's
    shape = Soak(ranks=4, workers=2, epochs=20, contexts=contexts, publish_every=10)
    run = soak(s3_server, tmp_path, shape, say=print)
    assert not verdict(run), "\n".join(verdict(run))
    assert run.epochs == 20 and len(run.published) == 1 and run.fresh == [""]
    assert 0 < run.peak <= run.limit
