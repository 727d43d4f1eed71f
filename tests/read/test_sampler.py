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

from packer import ShardSampler
from packer.read import rng
from packer.read.dataset import ShardDataset
from packer.read.sampler import MIX_BATCH, MIX_TARGET, Draw, label_entropy

from .. import _sampler_run as run
from .._sampler_run import BATCH, CROP, jitter

ROOT = Path(__file__).resolve().parents[2]


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

    def only_labels(images: torch.Tensor, labels: torch.Tensor) -> Any:
        return labels

    labels_only = ShardDataset(path, crop_size=CROP, batch_transform=only_labels)
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
    from ..builder.test_labels import cli, make_raw, write_csv

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


def part_of(raw_photos: Path, out: Path, keep: int, backend: str = "memmap") -> Path:
    """A dataset of the first ``keep`` photos (sorted: landscape ones first) of the 18."""
    from packer import build

    raw = out.with_name(out.name + "-raw")
    for f in sorted(raw_photos.rglob("*.jpg"))[:keep]:
        (raw / f.parent.name).mkdir(parents=True, exist_ok=True)
        (raw / f.parent.name / f.name).write_bytes(f.read_bytes())
    build(raw, out, backend=backend, workers=1, quiet=True)
    return out


def test_ddp_ranks_take_the_same_number_of_steps(built, raw_photos: Path, tmp_path: Path) -> None:
    """Two gloo ranks (torch.multiprocessing.spawn), DataLoaders with 2 workers, an all_reduce per
    step: 11 records, batch 5, the sampler's defaults give both ranks 2 steps an epoch (padded with
    one repeated record, under its own draw key); drop_last=True 1 step each; a MixDataset with
    proportions as well, every member's draws keyed by the global draw."""
    import torch.multiprocessing as mp

    eleven, other = str(part_of(raw_photos, tmp_path / "eleven", 11)), str(built("lmdb", "jpeg"))
    scenarios = {
        "default": ([eleven], {}),
        "drop_last": ([eleven], {"drop_last": True}),
        "mix": ([eleven, other], {"proportions": [1, 2], "num_samples": 15}),
    }
    mp.spawn(run.ddp_steps, (2, free_port(), scenarios, str(tmp_path / "steps")), nprocs=2)
    ranks = [torch.load(tmp_path / f"steps.{r}", weights_only=False) for r in range(2)]
    assert [len(r["default"]) for r in ranks] == [4, 4] and [len(r["drop_last"]) for r in ranks] == [2, 2]
    for name, total, steps in (("default", 11, 2), ("drop_last", 11, 1), ("mix", 15, 2)):
        for epoch in range(2):
            draws = [d for r in ranks for step in r[name][epoch * steps : (epoch + 1) * steps] for d in step]
            assert {e for _, e, _ in draws} == {epoch}
            keys = sorted(k for _, _, k in draws)
            padded = -(-total // 2) * 2 if name != "drop_last" else total // 2 * 2
            assert keys == list(range(padded)), name  # each draw once; padding adds draws past the end
            if name == "default":
                assert {r for r, _, _ in draws} == set(range(11))  # every record, one of them twice
            if name == "mix":  # 5 draws of the first member (indices 0-10), 10 of the second
                first = [r for r, _, k in draws if k < total]
                assert sum(r < 11 for r in first) == 5 and sum(r >= 11 for r in first) == 10


def test_mixing_datasets_keys_every_draw_and_resumes(built, raw_photos: Path, tmp_path: Path) -> None:
    """MixDataset of two datasets (other backends and formats) under ShardSampler(proportions=...):
    each member's draws get the global draw's crop key (new crops each epoch, the member's own
    sample for that key), the same batches with 0 and 2 workers, each member's share as asked, a
    mid-epoch resume continues bit for bit, and a state from other proportions is refused. A torch
    ConcatDataset of packer datasets, or members that disagree on classes, are refused."""
    from torch.utils.data import ConcatDataset

    from packer import MixDataset

    a = ShardDataset(built("memmap", "raw"), crop_size=CROP, seed=1, dtype=torch.uint8)
    b = ShardDataset(built("lmdb", "jpeg"), crop_size=CROP, seed=2, dtype=torch.uint8, transform=jitter)
    mix = MixDataset([a, b])
    args = {"proportions": [3, 1], "num_samples": 24}

    def epochs(workers: int, sampler: ShardSampler, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        loader = DataLoader(mix, batch_size=4, sampler=sampler, num_workers=workers)
        out = []
        for epoch in range(first, 2):
            sampler.set_epoch(epoch)
            out += [(x.clone(), y.clone()) for x, y in loader]
        return out

    runs = [epochs(w, ShardSampler(mix, **args)) for w in (0, 2)]
    assert same(runs[0], runs[1]) and len(runs[0]) == 12
    assert all(x.is_contiguous(memory_format=torch.channels_last) for run_ in runs for x, _ in run_)
    listing = ShardSampler(mix, **args)
    images = torch.cat([x for x, _ in runs[0]])
    crops: dict[tuple[int, int], bytes] = {}
    for epoch in range(2):
        listing.set_epoch(epoch)
        draws = list(listing)
        assert sum(d >= 18 for d in draws) == 6 and len({int(d) for d in draws if d < 18}) == 18  # 3:1, a whole
        for k, d in enumerate(draws):
            image = images[epoch * 24 + k]
            member, record = (a, int(d)) if d < 18 else (b, int(d) - 18)
            assert torch.equal(image, member[Draw(record, epoch, d.draw)][0])  # the member's sample for the key
            crops[epoch, int(d)] = image.numpy().tobytes()
    both = [r for r in range(36) if (0, r) in crops and (1, r) in crops]
    assert len(both) >= 18 and all(crops[0, r] != crops[1, r] for r in both)  # new crops each epoch, both members
    assert a.epoch == b.epoch == 1  # set_epoch reached the members

    sampler = ShardSampler(mix, **args)  # stop after 3 batches of epoch 1, resume in a new sampler
    sampler.set_epoch(1)
    it = iter(DataLoader(mix, batch_size=4, sampler=sampler, num_workers=2))
    for _ in range(3):
        next(it)
    state = sampler.state_dict(consumed=12)
    del it
    resumed = ShardSampler(mix, **args)
    resumed.load_state_dict(state)
    assert same(epochs(2, resumed, first=1), runs[0][6 + 3 :])
    with pytest.raises(ValueError, match=r"proportions 18\+6 -> 12\+12"):
        ShardSampler(mix, proportions=[1, 1], num_samples=24).load_state_dict(state)

    with pytest.raises(ValueError, match=r"use packer\.MixDataset"):
        ShardSampler(ConcatDataset([a, b]))
    with pytest.raises(ValueError, match="proportions must be 2"):
        ShardSampler(mix, proportions=[1, 2, 3])
    with pytest.raises(ValueError, match=r"needs a packer\.MixDataset"):
        ShardSampler(a, proportions=[1])
    landscapes = ShardDataset(part_of(raw_photos, tmp_path / "landscapes", 9), crop_size=CROP, dtype=torch.uint8)
    assert landscapes.classes == ["landscape"]
    with pytest.raises(ValueError, match="differ in classes"):
        MixDataset([a, landscapes])
    with pytest.raises(ValueError, match=r"differ in crop size .*: 16 vs 32"):
        MixDataset([a, ShardDataset(built("memmap", "raw"), crop_size=16, dtype=torch.uint8)])


def test_a_state_from_another_configuration_is_refused(built, raw_photos: Path, tmp_path: Path) -> None:
    """Same seed and draws per epoch, another order: refused, naming what differs, and the sampler
    keeps its state; a state saved without "config" (packer before this check) still loads; bad
    arguments are ValueErrors at construction."""
    ds = ShardDataset(built("memmap", "jpeg"), crop_size=CROP)
    eleven = ShardDataset(part_of(raw_photos, tmp_path / "eleven", 11), crop_size=CROP)
    pairs = [
        (ShardSampler(ds, num_samples=22), ShardSampler(eleven, num_samples=22), "size 18 -> 11"),
        (ShardSampler(ds, repeats=2, num_samples=9), ShardSampler(ds), "num_samples 9 -> 18, repeats 2 -> 1"),
        (ShardSampler(ds, balanced=True), ShardSampler(ds), "weights [0-9a-f]+ -> \\(unset\\)"),
        (ShardSampler(ds, order="block", block_size=4), ShardSampler(ds), "block_size 4 -> \\(unset\\)"),
        (
            ShardSampler(ds, order="block", block_size=4),
            ShardSampler(ds, order="block", block_size=3),
            "block_size 4 -> 3",
        ),
        (
            ShardSampler(ds, replacement=True),
            ShardSampler(ds, shuffle=False),
            "order random -> sequential, replacement",
        ),
    ]
    for saved, other, said in pairs:
        saved.set_epoch(3)
        state = saved.state_dict(consumed=4)
        other.set_epoch(1)
        before = other.state_dict()
        with pytest.raises(ValueError, match=f"another configuration \\({said}"):
            other.load_state_dict(state)
        assert other.state_dict() == before and len(list(other)) == len(other)  # unchanged, usable

    s = ShardSampler(ds, seed=3)
    s.set_epoch(2)
    for bad, said in (
        ({**s.state_dict(), "epoch": -1}, "epoch -1 outside"),
        ({"epoch": 1, "position": 0}, "not a ShardSampler state"),
        ({**s.state_dict(), "position": 99}, "position 99 outside"),
    ):
        with pytest.raises(ValueError, match=said):
            s.load_state_dict(bad)
        assert s.epoch == 2 and ds.epoch == 2 and s.state_dict() == ShardSampler(ds, seed=3).state_dict() | {"epoch": 2}
    assert len(list(s)) == 18
    with pytest.raises(ValueError, match="epoch must be"):
        s.set_epoch(-1)
    assert s.epoch == 2

    old = {"epoch": 4, "position": 6, "seed": 3, "total": 18}  # what ShardSampler.state_dict() wrote before
    fresh = ShardSampler(ds, seed=3)
    with pytest.warns(UserWarning, match="has no 'config'"):
        fresh.load_state_dict(old)
    fresh.set_epoch(4)
    assert [d.draw for d in fresh] == list(range(6, 18))
    for bad_args in (
        {"order": "block", "block_size": -1},
        {"order": "block", "block_size": 0},
        {"repeats": 1.5},
        {"num_replicas": 0},
        {"window": 0},
    ):
        with pytest.raises(ValueError, match="must be"):
            ShardSampler(ds, **bad_args)


def test_unshuffled_validation_iterated_twice_an_epoch_does_not_warn(built) -> None:
    """Lightning runs its sanity check and then validation in one epoch: an unshuffled sampler gives
    the same draws either way, so no warning; a shuffled one still warns."""
    import warnings

    ds = ShardDataset(built("memmap", "jpeg"), crop_size=CROP, train=False)
    val = ShardSampler(ds, shuffle=False, num_replicas=2, rank=1, pad=False)
    loader = DataLoader(ds, batch_size=4, sampler=val, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, again = list(loader), list(loader)
    assert same(first, again) and sum(len(y) for _, y in first) == 9
    train = ShardSampler(ds)
    with pytest.warns(UserWarning, match="without set_epoch"):
        list(train), list(train)


def test_label_entropy_counts_bits_per_batch() -> None:
    labels = np.repeat(np.arange(64), 2)  # records 2c, 2c + 1: class c
    assert label_entropy(labels, np.arange(128), 64) == pytest.approx(5.0)  # 32 classes, 2 each
    assert label_entropy(labels, np.arange(0, 128, 2), 64) == pytest.approx(6.0)  # 64 classes once
    assert label_entropy(np.zeros(128, dtype=np.int64), np.arange(128), 64) == 0.0
    assert label_entropy(np.r_[np.zeros(32), np.ones(32)].astype(np.int64), np.arange(64), 64) == pytest.approx(1.0)
    assert label_entropy(labels, np.arange(10), 64) == 0.0  # no whole batch


def test_default_window_mixes_labels_like_a_global_shuffle(class_sorted: Path) -> None:
    ds = ShardDataset(class_sorted, crop_size=16)
    assert len(ds) == 768 and (np.diff(ds.labels) >= 0).all()  # stored class by class
    shuffled = label_entropy(ds.labels, np.random.default_rng(5).permutation(len(ds)), MIX_BATCH)
    for block in (4, 8, 32):  # a cache unit's records, say
        s = ShardSampler(ds, order="block", block_size=block)
        assert s.window & (s.window - 1) == 0 or s.window == len(ds) // block  # a power of two, or every block
        mixing = [label_entropy(ds.labels, s.sequence(e), MIX_BATCH) / shuffled for e in range(4)]
        assert min(mixing) >= MIX_TARGET - 0.03, (block, s.window, mixing)
        # the smallest such window: half of it mixes less than the target asks
        half = ShardSampler(ds, order="block", block_size=block, window=max(1, s.window // 2))
        if s.window > 1:
            assert label_entropy(ds.labels, half.sequence(0), MIX_BATCH) < MIX_TARGET * shuffled
    # a window of one block is one class a batch: what the default avoids
    assert label_entropy(ds.labels, ShardSampler(ds, order="block", block_size=48, window=1).sequence(0), 48) == 0.0
    # an explicit window, and the window in the resume state's configuration
    assert ShardSampler(ds, order="block", block_size=8, window=3).window == 3
    assert (
        f"window={ShardSampler(ds, order='block', block_size=8).window}"
        in ShardSampler(ds, order="block", block_size=8).config()
    )
