"""ShardSampler and user transforms through real DataLoaders: worker-count independence of global-RNG
transforms, draws (not records) keying augmentation, elastic determinism over world sizes, and
bit-exact mid-epoch resume in a new process (gloo processes for world size 2)."""

from __future__ import annotations

import collections
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from packer import ShardSampler, rng
from packer.dataset import ShardDataset
from packer.sampler import Draw

from . import _sampler_run as run
from ._sampler_run import BATCH, CROP, jitter

ROOT = Path(__file__).resolve().parents[1]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def draws_seen(path: Path, **sampler_args: Any) -> list[tuple[int, bytes]]:
    """(record, image bytes) of every draw one rank's loader yields in epoch 1 (num_workers=0)."""
    loader, sampler = run.make(str(path), 0, **sampler_args)
    listing = ShardSampler(loader.dataset, **sampler_args)  # the same draws, listed
    listing.set_epoch(1)
    drawn = list(listing)
    sampler.set_epoch(1)
    batches = list(loader)
    images, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert labels.tolist() == loader.dataset.labels[drawn].tolist()
    return [(int(d), images[k].numpy().tobytes()) for k, d in enumerate(drawn)]


def _numpy_key() -> np.ndarray:
    """numpy's global Mersenne Twister key (get_state()'s legacy tuple, its default)."""
    state = np.random.get_state()
    assert isinstance(state, tuple)
    return state[1]


def test_global_rng_transform_is_worker_independent_and_restores_state(built) -> None:
    path = built("memmap", "jpeg")
    results = {}
    for workers in (0, 2):
        loader, sampler = run.make(str(path), workers)
        results[workers] = run.batches(loader, sampler, 1)
    assert same(results[0], results[2])
    images = torch.cat([b[0] for b in results[0]])
    assert len({im.numpy().tobytes() for im in images}) == len(images)  # every draw its own jitter

    ds = ShardDataset(path, crop_size=CROP, seed=run.SEED, dtype=torch.uint8, transform=jitter)
    plain = ShardDataset(path, crop_size=CROP, seed=run.SEED, dtype=torch.uint8)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    before = torch.get_rng_state(), _numpy_key().copy(), random.getstate()
    a = ds[3][0]
    assert torch.equal(torch.get_rng_state(), before[0]) and np.array_equal(_numpy_key(), before[1])
    assert random.getstate() == before[2]  # the process's own streams are untouched
    assert torch.equal(a, ds[3][0]) and not torch.equal(a, plain[3][0])
    with pytest.raises(RuntimeError, match="only defined inside"):
        rng.generator()


def test_kornia_transform_is_worker_independent(built) -> None:
    pytest.importorskip("kornia", reason="kornia is not installed (optional: pip install kornia)")
    path = built("lmdb", "jpeg")
    results = []
    for workers in (0, 2):
        ds = ShardDataset(path, crop_size=CROP, dtype=torch.uint8, transform=run.kornia_jiggle)
        sampler = ShardSampler(ds)
        sampler.set_epoch(2)
        results.append(list(DataLoader(ds, batch_size=BATCH * 2, sampler=sampler, num_workers=workers)))
    assert same(results[0], results[1])
    plain = ShardDataset(path, crop_size=CROP, dtype=torch.uint8)
    sampler = ShardSampler(plain)
    sampler.set_epoch(2)
    images, labels = next(iter(DataLoader(plain, batch_size=BATCH * 2, sampler=sampler)))
    assert torch.equal(labels, results[0][0][1]) and not torch.equal(images, results[0][0][0])  # it did jiggle


def test_float_output_batch_transform_and_shape_errors(built) -> None:
    path = built("lmdb", "raw")
    u8 = ShardDataset(path, crop_size=CROP, dtype=torch.uint8, transform=jitter)
    f32 = ShardDataset(path, crop_size=CROP, transform=jitter)
    images = next(iter(DataLoader(f32, batch_size=4)))[0]
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    from packer.transform import to_device

    assert torch.equal(images, to_device(next(iter(DataLoader(u8, batch_size=4)))[0], "cpu"))  # float last

    gray = ShardDataset(
        path,
        crop_size=None,
        dtype=torch.uint8,  # whole images, user crop: one batch
        transform=lambda x: x[:, :16, :20].float().mean(0, keepdim=True),
    )
    images, _labels = next(iter(DataLoader(gray, batch_size=4, num_workers=2)))
    assert images.shape == (4, 1, 16, 20) and images.dtype == torch.float32

    def swap(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return images.flip(0), 1 - labels

    flipped = ShardDataset(path, crop_size=CROP, dtype=torch.uint8, batch_transform=swap)
    plain = ShardDataset(path, crop_size=CROP, dtype=torch.uint8)
    a, b = next(iter(DataLoader(flipped, batch_size=4))), next(iter(DataLoader(plain, batch_size=4)))
    assert torch.equal(a[0], b[0].flip(0)) and torch.equal(a[1], 1 - b[1])

    ragged = ShardDataset(path, crop_size=None, transform=lambda x: x)  # whole images differ in size
    with pytest.raises(ValueError, match=r"record \d+ is torch.uint8 \(3, \d+, \d+\), the batch's first \(record 0\)"):
        ragged.__getitems__(list(range(len(ragged))))
    with pytest.raises(ValueError, match="batch_transform needs images of one size"):
        ShardDataset(path, crop_size=None, batch_transform=swap)


def sometimes_float(x: torch.Tensor) -> torch.Tensor:
    """A transform whose output dtype depends on the sample (the parity of its first pixel)."""
    return x.float().div(255) if int(x[0, 0, 0]) % 2 else x


def test_transform_output_contract_names_the_sample(built) -> None:
    """Mixed uint8/float outputs, a uint8 output that cannot be normalized, and a batch_transform that
    returns another number of labels or images are errors naming the record(s), through DataLoader
    workers, not a batch mixing normalized and raw values or a shrunk batch."""
    path = built("memmap", "raw")
    mixed = ShardDataset(path, crop_size=CROP, transform=sometimes_float)
    with pytest.raises(
        ValueError, match=r"record \d+ is torch.(uint8|float32) \(3, 32, 32\), the batch's first \(record"
    ):
        list(DataLoader(mixed, batch_size=18, num_workers=2))
    gray = ShardDataset(path, crop_size=CROP, transform=lambda x: x[:1])  # uint8, 1 channel, float32 batch
    with pytest.raises(ValueError, match=r"record 0 is torch.uint8 \(1, 32, 32\).* must be 3 x H x W"):
        list(DataLoader(gray, batch_size=4, num_workers=1))
    assert next(
        iter(DataLoader(ShardDataset(path, crop_size=CROP, dtype=torch.uint8, transform=lambda x: x[:1]), batch_size=4))
    )[0].shape == (4, 1, 32, 32)

    def three_labels(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return images, labels[:3]

    def fewer_images(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return images[:2], labels[:2]

    for bad, said in ((three_labels, "8 images, 3 labels"), (fewer_images, "2 images, 2 labels")):
        ds = ShardDataset(path, crop_size=CROP, batch_transform=bad)
        with pytest.raises(ValueError, match=rf"returned {said} for a batch of 8 \(records 0, 1, 2, 3, 4, 5, 6, 7\)"):
            list(DataLoader(ds, batch_size=8, num_workers=1))
    labels_only = ShardDataset(path, crop_size=CROP, batch_transform=lambda images, labels: labels)
    with pytest.raises(ValueError, match="batch_transform returned Tensor for a batch of 4"):
        labels_only.__getitems__([0, 1, 2, 3])


def test_a_record_drawn_twice_gets_two_crops(built) -> None:
    path = built("lmdb", "jpeg")
    for args in ({"repeats": 2}, {"balanced": True, "num_samples": 60}):
        seen = draws_seen(path, **args)
        by_record = collections.defaultdict(list)
        for record, image in seen:
            by_record[record].append(image)
        repeated = [v for v in by_record.values() if len(v) > 1]
        assert repeated and all(len(set(v)) == len(v) for v in repeated), args
    counts = collections.Counter(r for r, _ in draws_seen(path, repeats=3))
    assert set(counts.values()) == {3} and len(counts) == 18
    # without the sampler, plain indices keep today's keying: one crop per record and epoch
    plain = ShardDataset(path, crop_size=CROP, dtype=torch.uint8)
    assert torch.equal(plain[4][0], plain[4][0]) and torch.equal(plain[Draw(4, 0, 4)][0], plain[4][0])


@pytest.mark.parametrize(
    "args",
    [{}, {"repeats": 2}, {"balanced": True, "num_samples": 25}, {"order": "block", "block_size": 4, "window": 2}],
)
def test_elastic_determinism(built, args: dict) -> None:
    """World size 1, 2 and 4 (rank arguments): the same multiset of (record, crop) in an epoch with
    pad=False; padded (the default), the same plus the few draws that even out the ranks."""
    path = built("memmap", "raw")
    multisets = []
    for world in (1, 2, 4):
        drawn = [d for r in range(world) for d in draws_seen(path, num_replicas=world, rank=r, pad=False, **args)]
        multisets.append(collections.Counter(drawn))
        padded = [draws_seen(path, num_replicas=world, rank=r, **args) for r in range(world)]
        assert len({len(p) for p in padded}) == 1  # every rank as many draws
        extra = collections.Counter(d for p in padded for d in p) - multisets[-1]
        assert extra.total() == len(padded[0]) * world - len(drawn)  # only added draws, none changed
    assert multisets[0] == multisets[1] == multisets[2]
    if "balanced" not in args:  # unweighted: every record exactly once (repeats times) across the ranks
        assert collections.Counter(r for r, _ in multisets[0].elements()) == {
            r: args.get("repeats", 1) for r in range(18)
        }


def test_sampler_orders_weights_and_lengths(built) -> None:
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=CROP)
    s = ShardSampler(ds, seed=3)
    s.set_epoch(0)
    first = [int(d) for d in s]
    s.set_epoch(1)
    assert sorted(first) == list(range(18)) and first != [int(d) for d in s]
    assert ds.epoch == 1  # the sampler's set_epoch reaches the dataset
    assert [int(d) for d in ShardSampler(ds, shuffle=False)] == list(range(18))
    block = ShardSampler(ds, order="block", block_size=3, window=2).sequence(0)
    assert sorted(block) == list(range(18))
    assert all(len({r // 3 for r in block[k : k + 6]}) == 2 for k in range(0, 18, 6))  # each window: 2 blocks
    weights = np.r_[np.full(9, 1.0), np.zeros(9)]
    assert set(ShardSampler(ds, weights=weights, num_samples=50).sequence(0).tolist()) <= set(range(9))
    even = [ShardSampler(ds, num_replicas=4, rank=r, drop_last=True) for r in range(4)]
    assert [len(s) for s in even] == [4] * 4 and [len(ShardSampler(ds, num_replicas=4, rank=r)) for r in range(4)] == [
        5
    ] * 4
    assert [len(ShardSampler(ds, num_replicas=4, rank=r, pad=False)) for r in range(4)] == [5, 5, 4, 4]
    ranks = [ShardSampler(ds, num_replicas=2, rank=r) for r in range(2)]  # elastic resume: 2 ranks -> 3
    for r in ranks:
        r.set_epoch(5)
        it = iter(r)
        taken = [next(it) for _ in range(4)]
    state = ranks[1].state_dict()
    assert state["position"] == 8 and [d.draw for d in taken] == [1, 3, 5, 7]
    later = [ShardSampler(ds, num_replicas=3, rank=r) for r in range(3)]
    for r in later:
        r.load_state_dict(state)
    rest = [d for r in later for d in r]
    assert sorted(d.draw for d in rest) == list(range(8, 20)) and {d.epoch for d in rest} == {5}  # 2 padded
    first = ranks[0].sequence(5)[:2].tolist()
    assert [int(d) for d in sorted(rest, key=lambda d: d.draw)][-2:] == first  # padding repeats the first records
    with pytest.raises(ValueError, match="rank must be"):
        ShardSampler(ds, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"seed 3 .* would not continue"):
        ShardSampler(ds, seed=4).load_state_dict(s.state_dict())
    with pytest.warns(UserWarning, match="without set_epoch"):
        list(s), list(s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world", [1, 2])
def test_resume_in_a_new_process_is_bit_exact(built, tmp_path: Path, world: int) -> None:
    """Stop after k batches of epoch 1 (plain DataLoader with 0 and 2 workers: the loop saves what it
    consumed; StatefulDataLoader with 2 workers, if torchdata is installed), resume in new processes
    (world 2: two gloo ranks); the rest equals the uninterrupted run's batches bit for bit."""
    path, k = str(built("lmdb", "jpeg")), 2
    try:
        import torchdata.stateful_dataloader  # noqa: F401

        modes: tuple[str, ...] = ("0", "2", "stateful")
    except ImportError:  # an optional dependency: the plain-DataLoader modes still run
        modes = ("0", "2")
    states: dict[int, Any] = {}
    expected: dict[int, Any] = {}
    for rank in range(world):
        loader, sampler = run.make(path, 0, num_replicas=world, rank=rank)
        expected[rank] = run.batches(loader, sampler, 1)
        states[rank] = {}
        for mode in modes:
            workers, stateful = (2, True) if mode == "stateful" else (int(mode), False)
            loader, sampler = run.make(path, workers, stateful, num_replicas=world, rank=rank)
            sampler.set_epoch(1)
            it = iter(loader)
            for _ in range(k):
                next(it)
            if stateful:
                states[rank][mode] = {"epoch": sampler.epoch, "loader": loader.state_dict()}
            else:
                states[rank][mode] = sampler.state_dict(consumed=k * BATCH)
            del it
    torch.save(states, tmp_path / "states.pt")
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._sampler_run", path, str(tmp_path / "states.pt"), str(tmp_path / "out")],
            cwd=ROOT,
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    for rank in range(world):
        resumed = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        assert set(resumed) == set(modes)
        for mode in modes:
            assert same(resumed[mode], expected[rank][k:]), (rank, mode)


def mixup(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MixUp in the worker, on a float batch and multi-hot labels; lam from torch's global generator."""
    lam = float(torch.rand(()))
    return lam * images + (1 - lam) * images.flip(0), lam * labels + (1 - lam) * labels.flip(0)


def test_batch_transform_mixes_a_multi_label_batch(tmp_path: Path) -> None:
    from .test_labels import cli, make_raw, write_csv

    rels = [f"p/{k}.jpg" for k in range(6)]
    raw = make_raw(tmp_path / "raw", rels)
    csv = write_csv(
        tmp_path / "l.csv", "path,label", [f"{r},{c}" for r, c in zip(rels, ["a", "b", "a;b", "c", "", "b"])]
    )
    assert cli("build", raw, tmp_path / "out", "--labels", csv, "--multi-label", "--quiet").returncode == 0
    ds = ShardDataset(tmp_path / "out", crop_size=8, batch_transform=mixup)
    plain = ShardDataset(tmp_path / "out", crop_size=8)
    runs = []
    for workers in (0, 2):
        sampler = ShardSampler(ds)
        sampler.set_epoch(1)
        runs.append(list(DataLoader(ds, batch_size=3, sampler=sampler, num_workers=workers)))
    assert same(runs[0], runs[1])  # the batch transform's draws are seeded too
    sampler = ShardSampler(plain)
    sampler.set_epoch(1)
    for (images, labels), (x, y) in zip(runs[0], DataLoader(plain, batch_size=3, sampler=sampler)):
        assert labels.dtype == torch.float32 and labels.shape == (3, 3)
        lam = (images - x.flip(0)).flatten()[0] / (x - x.flip(0)).flatten()[0]  # recovered from the pixels
        assert torch.allclose(labels, lam * y + (1 - lam) * y.flip(0), atol=1e-4)
