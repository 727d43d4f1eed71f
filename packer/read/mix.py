"""MixDataset: several packer datasets drawn from as one, each sample keyed by its own draw.

torch's ConcatDataset maps an index to its member by arithmetic that turns a ShardSampler
:class:`~packer.read.draw.Draw` into a plain int, and has no ``set_epoch``: every member then crops by
record in epoch 0, the same crops every epoch. A MixDataset hands each draw to its member with its
epoch and draw number intact (a draw number is unique in the epoch across the whole mix, so no two
samples share a key), reads each member's share of a batch in one ``__getitems__`` call, and passes
``set_epoch`` to every member. A batch drawing from several members is copied once into one batch
tensor (the members' parts cannot be written there directly). Each member's share of an epoch's draws:
``ShardSampler(mix, proportions=...)``; without it, draws are spread as over one dataset of all the
records. The sampler's plan of the epoch and its next blocks reach each member as its own records
(a member in object storage fetches them in the process that iterates the sampler, as alone).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from ..format import label_arrays as labelling
from .dataset import Sample, ShardDataset, TargetSample, position
from .draw import Draw, Order, Ranges


class MixDataset(Dataset):
    """``MixDataset([a, b, ...])``: index ``i`` is record ``i - offsets[m]`` of member ``m``.

    The members must agree on what a sample is: label kind, classes (in order: one class id means
    one class), target names, crop size, dtype and memory format; and none may have a
    ``batch_transform`` (it would see only its member's part of each batch). The mix's ``seed`` (the
    sampler's default) is the first member's; each member crops with its own seed.
    """

    def __init__(self, datasets: Sequence[ShardDataset]) -> None:
        members = list(datasets)
        if not members:
            raise ValueError("MixDataset needs at least one dataset")
        for d in members:
            if not isinstance(d, ShardDataset):
                raise ValueError(f"MixDataset mixes ShardDatasets, not {type(d).__name__}")
            if d.batch_transform is not None:
                raise ValueError(
                    f"{d.root}: a MixDataset member cannot have a batch_transform (it would see only its "
                    "part of each batch); apply it to the loader's batches instead"
                )
        first = members[0]
        for d in members[1:]:
            for what, mine, theirs in (
                ("label kind", d.label_kind, first.label_kind),
                ("classes", d.classes, first.classes),
                ("target names", d.target_names, first.target_names),
                ("fields", list(d.fields.values()), list(first.fields.values())),
                ("crop size", _crop(d), _crop(first)),
                ("dtype", d.dtype, first.dtype),
                ("memory format", d.memory_format, first.memory_format),
            ):
                if mine != theirs:
                    detail = "" if what in ("classes", "target names") else f": {mine} vs {theirs}"
                    raise ValueError(f"MixDataset members differ in {what} ({d.root} vs {first.root}){detail}")
        self.datasets = members
        self._measure()
        self.seed = first.seed
        # the sampler's epoch and each draw's member (ShardSampler._iter's will_read), and how many
        # of the draws read by the last announcement were each member's (fetch_ahead)
        self._plan: Optional[tuple[int, np.ndarray]] = None
        self._read = (0, np.zeros(len(members), np.int64))

    def _measure(self) -> None:
        """The members' sizes and offsets as they are now (again after ShardSampler reopened a member
        at another rank's version)."""
        self.sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.sizes.sum())

    # --- metadata (the members agree on it) ---------------------------------------------------------

    @property
    def classes(self) -> list[str]:
        return self.datasets[0].classes

    @property
    def label_kind(self) -> str:
        return self.datasets[0].label_kind

    @property
    def target_names(self) -> list[str]:
        return self.datasets[0].target_names

    @property
    def labels(self) -> np.ndarray:
        """int64 class id per index of the mix (see ShardDataset.labels)."""
        return np.concatenate([d.labels for d in self.datasets])

    def class_counts(self) -> np.ndarray:
        return np.sum([d.class_counts() for d in self.datasets], axis=0)

    def sample_weights(self) -> np.ndarray:
        """Weights balancing the classes over the whole mix, for ``ShardSampler(mix, balanced=True)``."""
        multi = None if self.label_kind != "multi" else np.concatenate([d._multi_rows() for d in self.datasets])
        return labelling.sample_weights(self.label_kind, self.labels, multi, len(self.classes))

    def locate(self, i: int) -> tuple[int, int]:
        """(member, record) of mix index ``i``."""
        i = position(i, len(self), "item", "a mix")
        m = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return m, i - int(self.offsets[m])

    def source(self, i: int) -> str:
        """Index ``i``'s original file: its member's root and the file's path in that raw folder."""
        m, r = self.locate(i)
        return f"{self.datasets[m].root}: {self.datasets[m].source(r)}"

    @property
    def epoch(self) -> int:
        return self.datasets[0].epoch

    def set_epoch(self, epoch: int) -> None:
        """Every member's epoch (what plain, non-Draw indices are cropped in)."""
        for d in self.datasets:
            d.set_epoch(epoch)

    # --- samples ------------------------------------------------------------------------------------

    def __getitem__(self, i: int) -> Sample | TargetSample:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample | TargetSample]:
        """Each member's share of the batch through its own ``__getitems__`` (a Draw keeps its epoch
        and draw number; its ``ahead`` ranges go to the members they cover), in the batch's order."""
        routed: list[list[int]] = [[] for _ in self.datasets]
        slots: list[list[int]] = [[] for _ in self.datasets]
        ahead = tuple(r for i in indices if type(i) is Draw for r in i.ahead)
        for k, i in enumerate(indices):
            m, r = self.locate(i)
            routed[m].append(Draw(r, i.epoch, i.draw) if type(i) is Draw else r)
            slots[m].append(k)
        out: list[Any] = [None] * len(indices)
        for m, (d, local) in enumerate(zip(self.datasets, routed)):
            if not local:
                continue
            mine = self._member_ranges(m, ahead)
            head = local[0]
            if mine and isinstance(head, Draw):
                local[0] = Draw(int(head), head.epoch, head.draw, mine)
            for k, sample in zip(slots[m], d.__getitems__(local)):
                if isinstance(sample, dict):  # a dataset with fields: its id becomes the mix's index
                    sample["id"] += int(self.offsets[m])
                out[k] = sample
        return self._one_batch(out) if sum(map(bool, routed)) > 1 else out

    def _one_batch(self, samples: list[Any]) -> list[Any]:
        """Several members' samples written into one batch tensor (pooled, channels-last as a
        member's own), so that collate hands it on as it does one dataset's batch; images of
        different shapes (whole images, a transform's) are left for the collate to refuse."""
        images = [s["image"] if isinstance(s, dict) else s.image for s in samples]
        first = images[0]
        if any(im.shape != first.shape or im.dtype != first.dtype for im in images):
            return samples
        batch = self.datasets[0]._output(len(samples), tuple(first.shape), first.dtype, get_worker_info() is not None)
        for k, im in enumerate(images):
            batch[k].copy_(im)
        if isinstance(samples[0], dict):  # FieldSamples (a dict type of their own): the image replaced in place
            for k, s in enumerate(samples):
                s["image"] = batch[k]
            return samples
        return [s._replace(image=batch[k]) for k, s in enumerate(samples)]

    def will_read(self, epoch: int, records: np.ndarray) -> None:
        """ShardSampler's draws of ``epoch``, in order: each member told its own, in their order
        (a member in object storage evicts its cache by them: ShardDataset.will_read)."""
        records = np.asarray(records, np.int64)
        member = np.searchsorted(self.offsets, records, side="right") - 1
        self._plan = (epoch, member.astype(np.min_scalar_type(len(self.datasets))))
        self._read = (0, np.zeros(len(self.datasets), np.int64))
        for m, d in enumerate(self.datasets):
            d.will_read(epoch, records[member == m] - self.offsets[m])

    def ordered_by(self, order: Order) -> None:
        """ShardSampler's order of each epoch: each member its own draws of it (ShardDataset.ordered_by)."""
        for m, d in enumerate(self.datasets):
            d.ordered_by(functools.partial(_member_order, order, self.offsets, m))

    def fetch_ahead(self, epoch: int, read: int, ranges: Ranges) -> bool:
        """ShardSampler's next blocks, each member told its part and how many of its own draws the
        ``read`` draws before it were (ShardDataset.fetch_ahead); True where every member with a
        part fetches it in this process (else the workers are handed all of them, and a member's
        fetched here is found fetched or in flight there)."""
        if self._plan is not None and self._plan[0] == epoch:
            at, counts = self._read
            if read >= at:  # the draws read since the last announcement, by member
                counts = counts + np.bincount(self._plan[1][at:read], minlength=len(self.datasets))
                self._read = (read, counts)
        else:
            counts = np.zeros(len(self.datasets), np.int64)
        told = [
            d.fetch_ahead(epoch, int(counts[m]), mine)
            for m, d in enumerate(self.datasets)
            if (mine := self._member_ranges(m, ranges))
        ]
        return bool(told) and all(told)

    def _member_ranges(self, m: int, ranges: Ranges) -> Ranges:
        """The parts of mix index ranges ``(first, end)`` that lie in member ``m``, as its records."""
        lo, hi = int(self.offsets[m]), int(self.offsets[m] + self.sizes[m])
        return tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if a < hi and b > lo)

    def __repr__(self) -> str:
        return f"MixDataset({len(self)} records: " + ", ".join(f"{d.root} ({len(d)})" for d in self.datasets) + ")"


def _crop(d: ShardDataset) -> Any:
    return d.options.crop_size  # a side, None (whole images) or a schedule: the members' must be equal


def _member_order(order: Order, offsets: np.ndarray, m: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Member ``m``'s draws of the mix's ``order`` of ``epoch``: positions, and records of the member."""
    positions, records = order(epoch)
    mine = np.searchsorted(offsets, records, side="right") - 1 == m
    return positions[mine], records[mine] - offsets[m]
