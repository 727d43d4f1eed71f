"""Reused shared-memory batches (packer.read.batchpool) through real DataLoader workers: a batch the
consumer still holds is never overwritten, freed segments are reused, forks and pickling are safe."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence

import pytest
import torch
from torch.utils.data import DataLoader

from packer.read import batchpool
from packer.read.dataset import Sample, ShardDataset, TargetSample, collate_samples

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux-only: no pool")


class PoolSize(ShardDataset):
    """Labels replaced by the worker's pool size when the batch was made (to watch reuse)."""

    def __getitems__(self, indices: Sequence[int]) -> list[Sample | TargetSample]:
        samples = super().__getitems__(indices)
        return [Sample(s.image, len(batchpool._own_pool())) for s in samples]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_held_batches_are_never_overwritten_and_freed_ones_are_reused(built, dtype: torch.dtype) -> None:
    ds = PoolSize(built("lmdb", "jpeg"), crop_size=32, seed=2, dtype=dtype)
    loader = DataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        shuffle=True,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    sizes = []
    for epoch in range(6):
        ds.set_epoch(epoch)
        for k, (images, pool_size) in enumerate(loader):
            assert type(images) is torch.Tensor and images.is_contiguous(memory_format=torch.channels_last)
            sizes.append(int(pool_size[0]))
            if epoch == 1 and k < 3:
                held.append((images, images.clone()))  # kept alive across all later batches
    assert all(torch.equal(kept, copy) for kept, copy in held)
    # 36 batches per worker; held ones pin their segments, freed ones come back
    assert max(sizes) <= 2 + len(held) + 3


def test_lend_reuses_a_segment_once_every_tensor_over_it_is_gone() -> None:
    shape = (3, 5, 7, 3)  # a size no other test lends
    a = batchpool.lend(shape, torch.uint8)
    assert a is not None
    address = a.data_ptr()
    view = a[1:]
    del a
    b = batchpool.lend(shape, torch.uint8)
    assert b is not None and b.data_ptr() != address  # a view still uses the first segment
    del view
    c = batchpool.lend(shape, torch.uint8)
    assert c is not None and c.data_ptr() == address  # every tensor over it gone: lent again


def test_a_batch_pickled_twice_is_copied_for_the_second_receiver(built) -> None:
    """Only one receiver can own a segment's release; a second pickle of it sends a copy."""
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=16, seed=4, dtype=torch.uint8)
    twice = DataLoader(
        ds,
        batch_size=3,
        num_workers=1,
        multiprocessing_context="fork",
        collate_fn=lambda b: (collate_samples(b)[0], collate_samples(b)[0]),
    )
    for first, second in twice:
        assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    expected = torch.stack([ds[i][0] for i in range(3)])
    assert torch.equal(next(iter(twice))[0], expected)


def test_pool_is_bounded() -> None:
    held = [batchpool.lend((1024,), torch.uint8) for _ in range(batchpool.POOL_MAX + 2)]
    assert held[-1] is None and sum(t is not None for t in held) <= batchpool.POOL_MAX


def test_in_process_batches_are_plain_tensors(built, tmp_path) -> None:
    """Outside a worker a batch is never the fd-pickling subclass: torch.save and pickle work."""
    ds = ShardDataset(built("memmap", "raw"), crop_size=16, dtype=torch.uint8)
    images, _ = next(iter(DataLoader(ds, batch_size=4)))
    assert type(images) is torch.Tensor
    torch.save(images, tmp_path / "b.pt")
    assert torch.equal(torch.load(tmp_path / "b.pt"), images)
    assert torch.equal(pickle.loads(pickle.dumps(images)), images)


def test_a_forked_child_dropping_a_received_batch_does_not_free_it(built) -> None:
    ds = ShardDataset(built("lmdb", "raw"), crop_size=16, seed=1, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(loader)
    images, _ = next(it)
    copy = images.clone()
    pid = os.fork()
    if pid == 0:  # the child lets go of its inherited reference, collects, exits
        import gc

        del images
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in range(3):
        for _batch in loader:
            pass
    assert torch.equal(images, copy)


def test_more_held_batches_than_the_pool_holds_fall_back_to_fresh_memory(built) -> None:
    ds = ShardDataset(built("memmap", "raw"), crop_size=16, seed=3, dtype=torch.uint8)
    loader = DataLoader(ds, batch_size=1, num_workers=1, persistent_workers=True)
    held = []
    for _ in range(2):
        held += [(images, images.clone()) for images, _ in loader]  # 36 batches alive at once
    assert len(held) > batchpool.POOL_MAX
    assert all(torch.equal(kept, copy) for kept, copy in held)


def test_without_memfd_batches_use_torch_shared_memory(built, monkeypatch) -> None:
    """Where memfd_create is missing (macOS, Windows) nothing is pooled and batches still arrive."""
    monkeypatch.delattr(os, "memfd_create")
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=16, seed=3, dtype=torch.uint8)
    assert batchpool.lend((2, 2), torch.uint8) is None
    expected = torch.stack([ds[i][0] for i in range(6)])
    got = torch.cat([b[0] for b in DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")])
    assert torch.equal(got[:6], expected)


def test_small_tensors_pickle_by_value_only_in_a_worker(built) -> None:
    """A worker's small batch tensors and lists of per-sample tensors pickle as their bytes and come
    back as plain tensors and lists; outside a worker, or past INLINE_MAX, nothing is marked."""
    from multiprocessing.reduction import ForkingPickler

    labels, boxes = torch.arange(6), list(torch.rand(10, 4).split([3, 0, 7]))
    assert batchpool.inline(labels) is labels and batchpool.inline(boxes) is boxes  # not a worker
    ds = ShardDataset(built("lmdb", "jpeg"), crop_size=32, dtype=torch.uint8)
    _, got = next(iter(DataLoader(ds, batch_size=4, num_workers=1)))
    assert type(got) is torch.Tensor and not got.is_shared() and got.tolist() == ds.labels[:4].tolist()
    for value in (labels, boxes):
        marked = batchpool.InlineList(value) if isinstance(value, list) else value.as_subclass(batchpool.InlineBatch)
        back = pickle.loads(ForkingPickler.dumps(marked))
        if isinstance(value, list):
            assert type(back) is list and [type(t) for t in back] == [torch.Tensor] * 3
            assert all(torch.equal(x, y) for x, y in zip(back, value)) and back[1].shape == (0, 4)
        else:
            assert type(back) is torch.Tensor and torch.equal(back, value)
