"""The offline optimum a cache_limit is measured against (tests/store/test_s3.py and
scripts/bench_remote.py): bytes fetched by furthest-future eviction (Belady) of a known order."""

from __future__ import annotations

from typing import Optional


def furthest_future_bytes(
    uses: list[list[str]], sizes: dict[str, int], limit: int, room: Optional[dict[str, int]] = None
) -> int:
    """Bytes an offline cache of ``limit`` bytes fetches for ``uses`` (each batch's units, in order)
    when it evicts the unit needed furthest in the future (Belady), every batch's units held while
    it is read. ``room``: what each unit takes of the limit once cached (default: its size)."""
    room = room or sizes
    cached: set[str] = set()
    fetched = 0
    for t, batch in enumerate(uses):
        for name in batch:
            if name in cached:
                continue
            while sum(room[c] for c in cached) + room[name] > limit:
                later = {c: next((u for u in range(t, len(uses)) if c in uses[u]), len(uses)) for c in cached}
                cached.remove(max((c for c in cached if c not in batch), key=later.__getitem__))
            cached.add(name)
            fetched += sizes[name]
    return fetched
