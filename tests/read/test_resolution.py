"""Resolution schedules (ShardDataset's ``crop_size`` as a function of the epoch) through real
DataLoader workers on datasets built from the real photos: the side changes at the scheduled epochs
in persistent fork and spawn workers, every batch of an epoch has one shape, batches do not depend
on the worker count, a mid-epoch resume and two DDP ranks get the same sides and pixels; and eval at
another resolution is the center crop at that size. Boxes and masks at each side of a schedule:
tests/read/test_fields.py, test_boxes_and_masks_follow_every_crop."""

from __future__ import annotations

import pickle
import re
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from packer import MixDataset, ShardSampler
from packer.read.dataset import ShardDataset
from packer.read.draw import Draw
from packer.read.resolution import Ramp, Steps

#: 32 in epoch 0, 48 in epoch 1, 64 from epoch 2 on
RAMP = Ramp(sides=(32, 64), epochs=(0, 2), step=16)
SIDES = [32, 48, 64]
BATCH = 4


def side_of(epoch: int) -> int:
    """A user schedule (module level: picklable, as spawn workers need): RAMP's sides."""
    return SIDES[min(epoch, 2)]


def load(
    ds: ShardDataset, sampler: Optional[ShardSampler] = None, workers: int = 0, ctx: Optional[str] = None, **kw: Any
) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context=ctx if workers else None,
        **kw,
    )


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_ramp_and_steps_give_ffcvs_sides() -> None:
    ffcv = Ramp(sides=(160, 192), epochs=(65, 76))  # FFCV's rn50 88-epoch configuration, rounded to 32
    assert [ffcv(e) for e in (0, 65, 70, 71, 75, 76, 87)] == [160, 160, 160, 192, 192, 192, 192]
    ramp = Ramp(sides=(128, 192), epochs=(2, 6), step=16)
    assert [ramp(e) for e in range(8)] == [128, 128, 128, 144, 160, 176, 192, 192]
    assert [Ramp(sides=(224, 160), epochs=(0, 4), step=16)(e) for e in range(5)] == [224, 208, 192, 176, 160]
    steps = Steps({20: 192, 0: 128, 10: 160})
    assert [steps(e) for e in (0, 9, 10, 19, 20, 500)] == [128, 128, 160, 160, 192, 192]
    assert steps == Steps({0: 128, 10: 160, 20: 192}) and repr(steps) == "Steps({0: 128, 10: 160, 20: 192})"
    assert pickle.loads(pickle.dumps(steps)) == steps and pickle.loads(pickle.dumps(ffcv)) == ffcv


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Ramp(sides=(160, 200), epochs=(0, 5)), "Ramp sides must be two multiples of step=32, not (160, 200)"),
        (lambda: Ramp(sides=(160, 192), epochs=(5, 5)), "Ramp epochs must be (start, end) with 0 <= start < end"),
        (lambda: Ramp(sides=(0, 192), epochs=(0, 3)), "a Ramp side must be a positive integer, not 0"),
        (lambda: Ramp(sides=(160, 192), epochs=(0, 3), step=0), "Ramp step must be a positive integer, not 0"),
        (lambda: Steps({1: 128}), "Steps needs the side of epoch 0"),
        (
            lambda: Steps({0: 128.5}),  # type: ignore[dict-item]
            "a Steps side must be a positive integer, not 128.5",
        ),
    ],
)
def test_a_bad_schedule_is_one_line(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()


def test_a_user_schedule_is_checked_at_epoch_0_and_at_each_epoch_it_gives(built) -> None:
    path = built("memmap", "raw")
    with pytest.raises(ValueError, match=r"crop_size schedule .* gave 0 for epoch 0: a side is a positive integer"):
        ShardDataset(path, crop_size=lambda e: 0)
    bad: Any = lambda e: 32 if e < 3 else 3.5  # noqa: E731  # a float from epoch 3
    ds = ShardDataset(path, crop_size=bad, dtype=torch.uint8)
    assert ds[0][0].shape == (3, 32, 32) and ds.crop_size_at(2) == 32
    ds.set_epoch(3)
    with pytest.raises(ValueError, match=r"gave 3.5 for epoch 3: a side is a positive integer"):
        ds[0]


def test_a_batch_spanning_epochs_of_two_sides_is_refused(built) -> None:
    ds = ShardDataset(built("memmap", "raw"), crop_size=RAMP, dtype=torch.uint8)
    assert [s.image.shape[1] for s in ds.__getitems__([Draw(0, 2, 0), Draw(1, 3, 1)])] == [64, 64]  # one side
    with pytest.raises(ValueError, match=r"epochs whose crop_size schedule gives different sides \(epoch 0: 32, "):
        ds.__getitems__([Draw(0, 0, 0), Draw(1, 1, 1)])


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
@pytest.mark.parametrize("sampled", [True, False], ids=["ShardSampler", "set_epoch"])
def test_persistent_workers_change_side_at_the_scheduled_epochs(built, ctx: str, sampled: bool) -> None:
    """Epochs 0, 1, 2 at 32, 48, 64 px in the same persistent workers, each batch bit for bit the
    one num_workers=0 gives: through ShardSampler's draws (their epoch) and through plain indices
    (the dataset's shared-memory epoch, which set_epoch sets). Under fork even a lambda serves."""
    path = built("lmdb", "jpeg")
    schedule = side_of if ctx == "spawn" else lambda e: SIDES[min(e, 2)]

    def make(workers: int) -> tuple[ShardDataset, Any, DataLoader]:
        ds = ShardDataset(path, crop_size=schedule, seed=5, dtype=torch.uint8)
        sampler = ShardSampler(ds) if sampled else None
        extra = {"persistent_workers": True} if workers else {}
        return ds, sampler if sampler is not None else ds, load(ds, sampler, workers, ctx, **extra)

    ds, epochs, loader = make(2)
    _, reference_epochs, reference = make(0)
    for epoch in range(3):
        epochs.set_epoch(epoch)
        reference_epochs.set_epoch(epoch)
        got = [(images.clone(), labels) for images, labels in loader]
        assert [b[0].shape[1:] for b in got] == [(3, SIDES[epoch], SIDES[epoch])] * 5  # 18 records: 4+4+4+4+2
        assert same(got, list(reference)) and ds.crop_size_at() == SIDES[epoch]
        assert got[0][0].float().std() > 10  # picture content


def test_a_mid_epoch_resume_continues_at_its_epochs_side_bit_for_bit(built) -> None:
    path = built("memmap", "jpeg")

    def make() -> tuple[ShardSampler, DataLoader]:
        ds = ShardDataset(path, crop_size=RAMP, seed=9, dtype=torch.uint8)
        sampler = ShardSampler(ds, seed=9)
        return sampler, load(ds, sampler, 2, "fork")

    sampler, loader = make()
    sampler.set_epoch(1)
    whole = [(images.clone(), labels) for images, labels in loader]
    interrupted, loader = make()
    interrupted.set_epoch(1)
    taken = []
    for images, labels in loader:
        taken.append((images.clone(), labels))
        if len(taken) == 2:
            break
    state = interrupted.state_dict(consumed=2 * BATCH)
    resumed, loader = make()  # a new job: its dataset in epoch 0, where the side is 32
    resumed.load_state_dict(state)
    rest = [(images.clone(), labels) for images, labels in loader]
    assert [b[0].shape[-1] for b in rest] == [48] * 3
    assert same(taken + rest, whole)


def test_two_ranks_agree_on_the_side_and_crop_as_one_rank(built) -> None:
    """Rank r of 2 takes global draws r, r + 2, ...: at every step both ranks' batches have the
    epoch's side, and each sample is the one a single rank gets for that draw."""
    path = built("lmdb", "raw")

    def make(world: int, rank: int, workers: int) -> tuple[ShardSampler, DataLoader]:
        ds = ShardDataset(path, crop_size=RAMP, seed=2, dtype=torch.uint8)
        sampler = ShardSampler(ds, num_replicas=world, rank=rank)
        return sampler, DataLoader(ds, batch_size=3, sampler=sampler, num_workers=workers)

    ranks = [make(2, 0, 2), make(2, 1, 0)]  # one with workers, one without
    single = make(1, 0, 0)
    for epoch in range(3):
        images = []
        for sampler, loader in [*ranks, single]:
            sampler.set_epoch(epoch)
            images.append([b[0].clone() for b in loader])
        for step in zip(images[0], images[1]):
            assert step[0].shape == step[1].shape == (3, 3, SIDES[epoch], SIDES[epoch])
        one = torch.cat(images[2])
        for r in range(2):
            assert torch.equal(torch.cat(images[r]), one[r::2])


def resized(full: torch.Tensor, top: int, left: int, side: int) -> torch.Tensor:
    """The ``side`` square of ``full`` (1 x 3 x H x W float) at (top, left), resized to 256 by torch."""
    square = full[:, :, top : top + side, left : left + side]
    return F.interpolate(square, size=(256, 256), mode="bilinear", antialias=True, align_corners=False)[0]


def test_eval_at_another_resolution_is_the_center_crop_at_that_size(built) -> None:
    """FFCV's eval: 256 px, from the center 224/256 of the short edge (``eval_ratio``'s default
    0.875): torchvision's Resize(int(256 / 0.875)) + CenterCrop(256), in stored pixels the centred
    square of the short edge x 256 / 292 (rounded to whole pixels), resized to 256. Against torch's
    resize of that square, up to the kernels' rounding; the square one pixel lower is far further."""
    path = built("memmap", "raw")
    whole = ShardDataset(path, crop_size=None, dtype=torch.uint8)
    val = ShardDataset(path, crop_size=256, train=False, dtype=torch.uint8)
    for i in range(len(val)):
        image = val[i].image.float()
        assert image.shape == (3, 256, 256)
        full = whole[i].image.float()[None]
        h, w = full.shape[2:]
        side = round(min(h, w) * 256 / int(256 / 0.875))
        top, left = (h - side) // 2, (w - side) // 2
        error, off = ((image - resized(full, top + dy, left, side)).abs().mean() for dy in (0, 1))
        assert error < 1.0 and off > 2.0, (
            f"record {i}: mean difference {error:.2f} from the center crop, {off:.2f} 1 px off"
        )
    assert ShardDataset(path, crop_size=RAMP, train=False)[0][0].shape == (3, 32, 32)  # eval at a schedule's side


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch's, beside the error
def test_a_user_schedule_that_cannot_be_pickled_is_one_clear_error_under_spawn(built) -> None:
    ds = ShardDataset(built("memmap", "raw"), crop_size=lambda e: 32, dtype=torch.uint8)
    expected = r"crop_size schedule <function .*<lambda>.* cannot be pickled .* define it as a module-level function"
    with pytest.raises(TypeError, match=expected):
        pickle.dumps(ds)
    with pytest.raises(TypeError, match=expected):
        iter(load(ds, workers=2, ctx="spawn"))
    assert pickle.loads(pickle.dumps(ShardDataset(ds.root, crop_size=side_of))).crop_size_at(1) == 48


def test_a_mix_reads_its_members_schedule_and_refuses_two(built) -> None:
    """A MixDataset's members must share the schedule (as they share a side): the mix's batches
    then take the epoch's side; members with two schedules are refused, naming both."""
    members = [ShardDataset(built("memmap", fmt), crop_size=RAMP, dtype=torch.uint8) for fmt in ("raw", "jpeg")]
    mix = MixDataset(members)
    sampler = ShardSampler(mix)
    sampler.set_epoch(1)
    assert {b[0].shape for b in DataLoader(mix, batch_size=6, sampler=sampler)} == {(6, 3, 48, 48)}
    other = ShardDataset(built("memmap", "jpeg"), crop_size=Steps({0: 32, 1: 64}))
    with pytest.raises(ValueError, match=r"differ in crop size .*: Steps\(\{0: 32, 1: 64\}\) vs Ramp\("):
        MixDataset([members[0], other])


def test_a_transform_receives_the_crop_at_the_epochs_side(built) -> None:
    seen = []

    def look(image: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(image.shape))
        return image

    ds = ShardDataset(built("memmap", "jpeg"), crop_size=RAMP, dtype=torch.uint8, transform=look)
    for epoch in range(3):
        ds.set_epoch(epoch)
        assert ds.__getitems__([0, 1])[0].image.shape == (3, SIDES[epoch], SIDES[epoch])
    assert seen == [(3, side, side) for side in SIDES for _ in range(2)]
    assert repr(ds).endswith(
        "train crop Ramp(sides=(32, 64), epochs=(0, 2), step=16) (epoch 2: 64), torch.uint8, seed=0, epoch=2)"
    )
