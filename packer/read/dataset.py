"""ShardDataset: a map-style torch Dataset over a packer dataset (either backend, either format).

Design points, each answering a known DataLoader failure:
- ``__init__`` pins one version of the dataset (packer.backends.pin): manifest, index and data files are
  opened together and kept, so a refresh of the path (``build --update``/``--force``) never mixes
  versions. Forked workers inherit the pinned files and read the version the parent opened to the
  end; a pickled copy (spawn) reopens by path and is refused with DatasetReplaced if the files there
  are no longer that version. Several datasets over one path, or one path's old and new versions,
  each read their own.
- Per-record metadata stays in numpy arrays, so forked workers do not copy pages by touching
  Python objects' reference counts.
- Augmentation is a pure function of (seed, epoch, index) (packer.transform), so batches do not
  depend on the worker count and no two workers share a random stream. The epoch lives in shared
  memory, so ``set_epoch`` reaches persistent workers too. A :class:`~packer.read.draw.Draw` index
  (from ShardSampler) carries its own epoch and draw number, which key it instead; a user
  ``transform`` runs with the global generators seeded from the same key (packer.read.rng).
"""

from __future__ import annotations

import gc
import operator
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from .. import transform
from ..backends import locality
from ..backends.pin import FileKey, Pinned, pin
from ..errors import is_url
from ..format import DatasetError, source_path
from ..format import label_arrays as labelling
from ..format.fields import RAGGED, Field, decode_fields, split_record
from ..format.records import FORMATS
from ..transform import Augment
from ..transform.fields import cropped as move_fields
from ..transform.fields import tensors as field_tensors
from ..transform.fields import whole as whole_fields
from . import batchpool, rng
from .draw import Draw, Order, Ranges
from .options import DEFAULTS, BatchTransform, ReadOptions, Transform
from .reader import open_reader
from .remote import Remote
from .resolution import CropSize, check_picklable


class Sample(NamedTuple):
    """``(image, label)``; a named type so that default_collate can recognise packer's batches.

    ``label``: the class id (an int; -1 in an unlabeled dataset), a multi-hot float32 vector
    (multi-label), or the float32 targets (an unlabeled dataset with targets)."""

    image: torch.Tensor
    label: Any


class TargetSample(NamedTuple):
    """``(image, label, targets)``: a labelled dataset with numeric targets (float32 vector)."""

    image: torch.Tensor
    label: Any
    targets: torch.Tensor


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised output batch, from this process's pool of reused segments (see
    packer.read.batchpool) when one is free; else fresh memory, in shared memory when ``shared``
    (where a DataLoader worker's batch must end up; default_collate allocates it the same way)."""
    lent = batchpool.lend(shape, dtype)
    if lent is not None:
        return lent
    if not shared:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for n in shape:
        numel *= n
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    # torch's stub wants a stride too; set_(storage, offset, size) (contiguous strides) is valid torch
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]


def collate_samples(
    batch: Sequence[Sample | TargetSample], *, collate_fn_map: Optional[dict] = None
) -> list[torch.Tensor]:
    """default_collate for Samples: ``[images, labels(, targets)]`` as for plain tuples (labels and
    targets each stacked into one tensor), but when the images are the consecutive slots of one batch
    tensor (as ``__getitems__`` makes them) that tensor is returned as it is (memory format
    included), saving a copy of every image (:func:`stack_images`). Registered in torch's
    default_collate_fn_map (the extension point torch documents for default_collate) when this module
    is imported.
    """
    from torch.utils.data import default_collate

    columns = [[s[k] for s in batch] for k in range(1, len(batch[0]))]
    # class ids: one torch.tensor call (half the time of default_collate's); tensors: stacked
    rest = [
        batchpool.inline(torch.tensor(c, dtype=torch.int64)) if isinstance(c[0], int) else default_collate(c)
        for c in columns
    ]
    return [stack_images([s.image for s in batch]), *rest]


def stack_tensors(column: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors of one shape stacked, by numpy where they have its dtype (torch.stack starts its
    intra-op threads, several times slower for a batch of masks on a busy host), into a batch of
    the process's pool (:func:`batch_tensor`: in a worker, reused shared memory, as the images'
    batch is; docs/PERFORMANCE.md, "Fields")."""
    from torch.utils.data import default_collate

    try:
        arrays = [t.numpy() for t in column]
    except (TypeError, RuntimeError):  # a dtype numpy lacks, a tensor that needs grad or is not on the CPU
        return default_collate(list(column))
    out = batch_tensor((len(arrays), *arrays[0].shape), column[0].dtype, get_worker_info() is not None)
    np.stack(arrays, out=out.numpy())
    return batchpool.pooled(out)


def stack_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """The batch of ``images``: when they are the consecutive slots of one batch tensor (as
    ``__getitems__`` makes them) that tensor as it is, memory format included; else stacked."""
    from torch.utils.data import default_collate

    first, root = images[0], images[0]._base
    step = first.numel()
    if (
        root is not None
        and root.is_contiguous()
        and root.numel() == len(images) * step
        and all(
            im._base is root
            and im.stride() == first.stride()
            and im.data_ptr() == first.data_ptr() + k * step * im.element_size()
            for k, im in enumerate(images)
        )
    ):
        stacked = root.as_strided((len(images), *first.shape), (step, *first.stride()), first.storage_offset())
        return batchpool.pooled(stacked)
    return default_collate(list(images))


class FieldSample(dict):
    """A sample of a dataset with fields: ``{"image", "label", <each field by name>, "id"}`` (the
    label where the dataset has one; ``id`` the record's index, ``ds.source(id)`` its source). A
    type of its own so that default_collate batches it with :func:`collate_fields`. ``ragged``: the
    keys batched as lists whatever their shapes (boxes and their labels, torchvision's detection
    convention)."""

    ragged: frozenset[str] = frozenset()


def collate_fields(
    batch: Sequence[FieldSample], *, collate_fn_map: Optional[dict] = None, padded: bool = False
) -> dict[str, Any]:
    """A batch of FieldSamples as one dict: images stacked (no copy, as :func:`collate_samples`),
    labels and ids as int64 tensors, other tensors stacked when they share one shape (masks, arrays
    of one shape) and lists otherwise, boxes and box labels lists of per-sample tensors, text a list
    of str. Registered in torch's default_collate_fn_map, as collate_samples is. ``padded``
    (``DataLoader(collate_fn=functools.partial(collate_fields, padded=True))``): boxes and box
    labels instead as one B x N x ... tensor each, N the batch's most, padded with zeros (boxes)
    and -1 (labels), with ``<name>_lengths``, each sample's count (int64 B)."""
    # labels, ids, boxes: by value across a worker's pipe, not a shared-memory segment each (batchpool.inline)
    columns = {key: batchpool.inline(v) for key, v in collate_columns(batch, padded=padded).items()}
    return {"image": stack_images([s["image"] for s in batch]), **columns}


def collate_columns(batch: Sequence[FieldSample], *, padded: bool = False) -> dict[str, Any]:
    """What :func:`collate_fields` makes of everything in a batch but its images (what a
    ``batch_transform`` on a dataset with fields receives beside them)."""

    first = batch[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        if key == "image":
            continue
        column = [s[key] for s in batch]
        if padded and key in first.ragged:
            lengths = [len(v) for v in column]
            out[key] = torch.full(
                (len(batch), max(lengths), *value.shape[1:]), -1 if value.ndim == 1 else 0, dtype=value.dtype
            )
            for k, v in enumerate(column):
                out[key][k, : len(v)] = v
            out[f"{key}_lengths"] = torch.tensor(lengths, dtype=torch.int64)
        elif isinstance(value, int):
            out[key] = torch.tensor(column, dtype=torch.int64)
        elif (
            isinstance(value, torch.Tensor)
            and key not in first.ragged
            and all(isinstance(v, torch.Tensor) and v.shape == value.shape for v in column)
        ):
            out[key] = stack_tensors(column)
        else:
            out[key] = column
    return out


default_collate_fn_map[Sample] = default_collate_fn_map[TargetSample] = collate_samples
default_collate_fn_map[FieldSample] = collate_fields
AnySample = Union[Sample, TargetSample, FieldSample]


def _shown(indices: Sequence[int]) -> str:
    """A batch's first records, for an error naming them."""
    return ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")


def _count(value: Any) -> Optional[int]:
    """How many items a field value holds (its first axis), or None for one without a length."""
    try:
        return len(value)
    except TypeError:
        return None


def _described(out: Any) -> str:
    """What a transform returned, for an error: its type, or a tuple's items' types."""
    if isinstance(out, tuple):
        return f"({', '.join(type(v).__name__ for v in out)})"
    return type(out).__name__


def position(i: Any, n: int, noun: str, of: str) -> int:
    """``i`` (an integer, negative from the end) as a position in ``n`` items; TypeError or IndexError
    naming the ``noun`` and what ``of`` holds them, as a list's indexing would."""
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(f"{noun} indices are integers, not {type(i).__name__} ({i!r})") from None
    if not -n <= i < n:
        raise IndexError(f"{noun} {i} out of range for {of} of {n}")
    return i % n


class ShardDataset(Dataset):
    """Images and labels from a packed dataset, cropped in uint8 and converted to ``dtype`` last.

    ``ds[i]`` is ``(image, label)``: ``image`` is a CHW tensor of ``dtype``, normalized with
    ``mean``/``std`` unless ``dtype`` is ``torch.uint8``; ``crop_size=None`` returns the whole stored
    image (sizes then differ, so batch with batch_size=1 or a custom collate_fn); a ``crop_size``
    schedule (packer.read.resolution) crops each batch at its epoch's side. ``label`` depends
    on the dataset's ``label_kind``: the class id (an int), a multi-hot float32 vector of
    ``len(classes)`` ("multi"), -1 ("none"). With targets, ``ds[i]`` is ``(image, label, targets)``
    (float32 vector), or ``(image, targets)`` when unlabeled. A dataset with fields (boxes, masks,
    text, arrays: docs/FIELDS.md) gives a :class:`FieldSample` dict instead, its boxes and masks moved
    by the image's crop (boxes below ``box_min_visible`` of their area in it dropped with their labels).

    Batches are channels-last by default (``memory_format=torch.channels_last``: shape B x C x H x W,
    pixels H x W x C in memory), the layout decoders and resize kernels produce and the one
    NVIDIA recommends for convolutions on tensor cores; ``torch.contiguous_format`` costs a
    transposing copy per sample (its cost: docs/PERFORMANCE.md, "Read speed").

    ``path`` may be a URL (``s3://bucket/prefix/train.lmdb``, ``https://host/train``): the dataset is
    read through a node-local cache (``cache_dir``, default ``$PACKER_CACHE_DIR`` or the user's cache
    directory; ``cache_limit`` bytes or a size like "200GB" for the whole cache), each data file
    fetched once per node when first read and checked against the index before use (packer.read.remote).

    ``verify`` checks each record's CRC-32 before decoding. It defaults to on for JPEG records
    (a small share of a decode) and off for raw ones (it would cost more than the crop); the record
    length and, for JPEG, a clean decode to the indexed size are always checked. Any failure raises
    :class:`~packer.format.DatasetError` naming the dataset, the record index and its source file.

    ``transform`` (any callable) receives each sample's uint8 crop - a C x H x W tensor, channels-last
    in memory; the whole stored image when ``crop_size=None`` - and returns a tensor. It runs with
    torch's, numpy's and Python's global random generators seeded from the sample's (seed, epoch,
    draw) (see packer.read.rng), so its random choices are as reproducible as the crop. Outputs must
    share one dtype and shape (the first sample's set the batch's; another is a ValueError naming the
    record); a uint8 output is converted to ``dtype`` last (so it must be C x H x W, C the number of
    ``mean`` values), a floating one is written as it is. ``batch_transform(images, labels)`` then
    receives the whole batch (``dtype``, labels int64) in the worker and returns ``(images,
    labels)``, as many of each as it was given. With fields both get them: ``transform(image,
    fields) -> (image, fields)``, ``batch_transform(images, fields) -> (images, fields)`` (the
    batch's dict less its images).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        crop_size: CropSize = DEFAULTS.crop_size,
        train: bool = DEFAULTS.train,
        seed: int = DEFAULTS.seed,
        dtype: torch.dtype = DEFAULTS.dtype,
        mean: Sequence[float] = DEFAULTS.mean,
        std: Sequence[float] = DEFAULTS.std,
        scale: tuple[float, float] = DEFAULTS.scale,
        ratio: tuple[float, float] = DEFAULTS.ratio,
        eval_ratio: float = DEFAULTS.eval_ratio,
        flip: bool = DEFAULTS.flip,
        verify: Optional[bool] = DEFAULTS.verify,
        memory_format: torch.memory_format = DEFAULTS.memory_format,
        transform: Transform = DEFAULTS.transform,
        batch_transform: BatchTransform = DEFAULTS.batch_transform,
        *,
        cache_dir: Optional[str | os.PathLike] = DEFAULTS.cache_dir,
        cache_limit: int | str | None = DEFAULTS.cache_limit,
        box_min_visible: float = DEFAULTS.box_min_visible,
    ) -> None:
        # every argument's default, doc and check: packer.read.options (checked before anything opens)
        self.options = o = ReadOptions(
            crop_size=crop_size,
            train=train,
            seed=seed,
            dtype=dtype,
            mean=mean,
            std=std,
            scale=scale,
            ratio=ratio,
            eval_ratio=eval_ratio,
            flip=flip,
            verify=verify,
            memory_format=memory_format,
            transform=transform,
            batch_transform=batch_transform,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            box_min_visible=box_min_visible,
        )
        # a URL (s3://, https://) is read through the node's cache (packer.read.remote); a path as it is
        self._remote = Remote(str(path), cache_dir=cache_dir, cache_limit=cache_limit) if is_url(path) else None
        self.root = self._remote.url if self._remote is not None else str(Path(path).resolve())
        # plain attributes for the per-sample code
        self.seed, self.dtype, self.memory_format = o.seed, o.dtype, o.memory_format
        self.mean, self.std = tuple(o.mean), tuple(o.std)
        self.augment = o.augment()  # with a crop_size schedule, epoch 0's (a batch takes its epoch's: _policy)
        self._policies: dict[int, Optional[Augment]] = {}  # a schedule's, by epoch, in this process
        self.transform, self.batch_transform = o.transform, o.batch_transform
        self.box_min_visible = o.box_min_visible
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._load()

    def _load(self, expect: Optional[dict[str, FileKey]] = None) -> None:
        """Everything derived from disk, from one pinned version (with ``expect``: that version only)."""
        self._use(self._remote.pin(expect) if self._remote is not None else pin(self.root, expect))

    def _reopen(self) -> None:
        """Everything derived from disk again, from the dataset's newest version (ShardSampler's
        agreement of DDP ranks that opened different ones): a local dataset's at its path, one in
        object storage the store's current one (Remote.reopen: the old version let go of)."""
        self._use(self._remote.reopen() if self._remote is not None else pin(self.root))

    def _use(self, pinned: Pinned) -> None:
        """Read ``pinned``: its files, metadata and a reader of them."""
        self._files = pinned.files
        self.manifest, self.index, self._sources = pinned.manifest, pinned.index, pinned.sources
        self._labels = np.asarray(self.index["label"], dtype=np.int64)
        self._multi, self._targets = pinned.multi, pinned.targets
        self._reader = open_reader(self.root, pinned=pinned)
        self._fields = self.manifest.declared  # empty: samples are (image, label) tuples
        self._table = len(self.manifest.record_fields)
        self._ragged = frozenset(f.name for f in self._fields if f.kind in RAGGED)
        #: the boxes and box_labels fields, where a dataset has both: a transform must keep them one per box
        paired = [next((f.name for f in self._fields if f.kind == kind), None) for kind in ("boxes", "box_labels")]
        self._paired = (paired[0], paired[1]) if paired[0] is not None and paired[1] is not None else None
        # the record format's default where none was asked: a reopen onto a version of another format takes its own
        asked = self.options.verify
        self.verify = FORMATS[self.manifest.format].crc_on_read if asked is None else asked

    def __getstate__(self) -> dict[str, Any]:
        keep = (
            "root",
            "seed",
            "dtype",
            "memory_format",
            "mean",
            "std",
            "augment",
            "_epoch",
            "transform",
            "batch_transform",
            "_files",
            "_remote",
            "options",
            "box_min_visible",
        )
        if callable(self.options.crop_size):  # say why a spawn worker cannot have a lambda, not pickle's words
            check_picklable(self.options.crop_size)
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Reopen the version that was pickled. A DataLoader worker unpickles before its loop starts,
        where an exception would only say the worker died: a replaced dataset is refused at the first
        read instead, with its own message."""
        self.__dict__.update(state)
        self._policies = {}
        try:
            self._load(expect=self._files)
        except DatasetError as e:
            self._gone = e

    _gone: Optional[DatasetError] = None  # why this unpickled copy cannot read (see __setstate__)

    # --- metadata -------------------------------------------------------------------------------

    def __len__(self) -> int:
        if self._gone is not None:
            raise self._gone
        return self.manifest.count

    @property
    def classes(self) -> list[str]:
        return list(self.manifest.classes)

    @property
    def fields(self) -> dict[str, Field]:
        """The dataset's fields by name (name, kind, dtype, and the names of box label or mask
        ids where it has them); empty for a dataset without fields (samples are tuples)."""
        return {f.name: f for f in self._fields}

    @property
    def label_kind(self) -> str:
        """ "class" (one class id per record), "multi" (several) or "none" (unlabeled): packer.builder.labels."""
        return self.manifest.label_kind

    @property
    def labels(self) -> np.ndarray:
        """int64 class id per record, -1 for kinds "multi" and "none" (a numpy array: cheap to share
        with forked workers)."""
        return self._labels

    def multi_hot(self) -> Optional[np.ndarray]:
        """Kind "multi": a records x classes uint8 0/1 array (unpacked from labels.npy); else None."""
        return None if self._multi is None else labelling.unpack(self._multi, len(self.manifest.classes))

    @property
    def targets(self) -> Optional[np.ndarray]:
        """float32 records x ``target_names`` array (memory-mapped), or None without targets."""
        return self._targets

    @property
    def target_names(self) -> list[str]:
        return list(self.manifest.targets)

    def class_counts(self) -> np.ndarray:
        """Records per class; "multi": per label (an image counts for each of its labels); "none": empty."""
        return labelling.class_counts(self.label_kind, self._labels, self._multi, len(self.manifest.classes))

    def sample_weights(self) -> np.ndarray:
        """Per-record weights balancing the classes, for ``ShardSampler(ds, balanced=True)``:
        inverse class frequency; "multi": inverse of the mean frequency of the image's labels (images
        without labels as one more class); "none": uniform. See :func:`packer.format.label_arrays.sample_weights`."""
        return labelling.sample_weights(self.label_kind, self._labels, self._multi, len(self.manifest.classes))

    def label_name(self, i: int) -> str:
        """Record ``i``'s label as text: its class, its classes joined by ';', or "unlabeled"."""
        i = self._check(i)
        if self.label_kind == "multi":
            hot = labelling.unpack(self._multi_rows()[i : i + 1], len(self.manifest.classes))[0]
            return labelling.SEPARATOR.join(self.manifest.classes[c] for c in np.flatnonzero(hot)) or "(none)"
        return self.manifest.classes[self._labels[i]] if self.label_kind == "class" else "unlabeled"

    def fetch_unit(self) -> Optional[tuple[int, Optional[int]]]:
        """A dataset in object storage: (records fetched together into the node cache, 0 where whole
        data files are: LMDB; the cache limit in bytes or None); a local one: None. ShardSampler's
        default order reads it unit by unit (docs/DATASET.md, "Order")."""
        if self._remote is None:
            return None
        return self._remote.per_unit, self._remote.limit

    def source(self, i: int) -> str:
        """The original file's path relative to the raw folder."""
        return source_path(self._sources, self.index[self._check(i)])

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's augmentation. Shared memory: reaches already-running persistent workers."""
        epoch = operator.index(epoch)
        if not 0 <= epoch < 2**63:
            raise ValueError(f"epoch must be in 0..2**63-1, not {epoch}")
        self._epoch[0] = epoch

    def crop_size_at(self, epoch: Optional[int] = None) -> Optional[int]:
        """The output side in ``epoch`` (default: the dataset's current one): ``crop_size``, or its
        schedule's value; None for whole images."""
        a = self._policy(self.epoch if epoch is None else operator.index(epoch))
        return None if a is None else a.crop_size

    def _policy(self, epoch: Any) -> Optional[Augment]:
        """The crop policy of a batch in ``epoch`` (one value, or one per sample): with a
        ``crop_size`` schedule, its side for that epoch (computed once per epoch in each process;
        a batch whose draws span epochs of two sides is a ValueError: one batch, one shape)."""
        if not callable(self.options.crop_size):
            return self.augment
        epochs = np.unique(epoch).tolist()
        for e in epochs:
            if e not in self._policies:
                self._policies[e] = self.options.augment(e)
        policies = [self._policies[e] for e in epochs]
        if any(p != policies[0] for p in policies):
            sides = ", ".join(f"epoch {e}: {p.crop_size if p else None}" for e, p in zip(epochs, policies))
            raise ValueError(
                f"a batch's draws come from epochs whose crop_size schedule gives different sides ({sides}): "
                "one batch, one shape"
            )
        return policies[0]

    # --- samples --------------------------------------------------------------------------------

    def __getitem__(self, i: int) -> Any:
        try:
            return self._batch(*self._keyed([i]))[0]
        finally:
            if self._remote is not None:  # with a cache limit, its data file may be evicted now
                self._remote.release()

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch for DataLoader's fetcher, which passes the result to ``collate_fn``.

        All samples are read under one epoch value, through the process's one long-lived read
        transaction, their crops drawn in one vectorized pass. The images are written into one
        preallocated ``B x C x H x W`` batch - in a worker, in shared memory - and default_collate
        (see :func:`collate_samples`) hands that tensor on without stacking it again. A custom
        ``collate_fn`` still gets ``(image, label)`` pairs (views into the batch).
        """
        shared = get_worker_info() is not None
        try:
            return self._batch(*self._keyed(indices), shared) if len(indices) else []
        finally:
            if self._remote is not None:  # with a cache limit, its data files may be evicted now
                self._remote.release()

    def will_read(self, epoch: int, records: np.ndarray) -> None:
        """ShardSampler's draws of ``epoch``, in order: read in this process (no DataLoader
        workers), a cache_limit evicts by them (packer.read.remote)."""
        if self._remote is not None:
            self._remote.plan(epoch, records)

    def ordered_by(self, order: Order) -> None:
        """ShardSampler's ``order`` of this rank's draws of each epoch, told when it is made: with a
        cache_limit, this dataset's copies in DataLoader workers (which do not iterate the sampler)
        evict by it too (packer.read.remote.nextuse.NextUses.follow)."""
        if self._remote is not None and self._remote.limit is not None:
            self._remote.order = order

    def fetch_ahead(self, epoch: int, read: int, ranges: Ranges) -> bool:
        """ShardSampler's next blocks (``ranges`` of records), told in the process that iterates it.
        A dataset in object storage fetches their data files here, in this process's background
        threads, so that downloads take no CPU from the DataLoader workers that decode (they find
        the units fetched, or wait for the fetch in flight: docs/PERFORMANCE.md, "A cold first epoch
        from S3"); eviction takes this rank's draws of ``epoch`` before ``read`` as read. False
        where the reader of the draws asks for the blocks itself, after its batch's own: a local
        dataset (its disk), a process that reads the batches (its cache)."""
        if self._remote is None or self._remote.reads_here:
            return False
        self._remote.prefetch(locality.records(ranges, len(self.index)), epoch=epoch, read=read)
        return True

    def _keyed(self, indices: Sequence[int]) -> tuple[list[int], Any, Optional[list[int]]]:
        """(records, epoch, keys): plain indices are keyed by record in the dataset's epoch (keys
        None); :class:`~packer.read.draw.Draw` indices by their own epoch and draw number. The blocks
        a Draw says come next (``ahead``) are asked of the disk here, before this batch is read."""
        records = [self._check(i) for i in indices]
        if self._remote is not None:  # the batch's data files fetched together, before the reader needs them
            first = indices[0] if len(indices) else None
            epoch, draw = (first.epoch, first.draw) if type(first) is Draw else (None, None)
            self._remote.prefetch(np.asarray(records, dtype=np.int64), wait=True, epoch=epoch, draw=draw)
        if not any(type(i) is Draw for i in indices):
            return records, self.epoch, None
        ahead = [r for i in indices if type(i) is Draw for r in i.ahead]
        if ahead and self._remote is not None:  # the next blocks' data files, in the background
            self._remote.prefetch(locality.records(ahead, len(self.index)))
        elif ahead:
            self._reader.prefetch(ahead)
        epochs = np.array([i.epoch if type(i) is Draw else self.epoch for i in indices], dtype=np.int64)
        return records, epochs, [i.draw if type(i) is Draw else r for i, r in zip(indices, records)]

    def _batch(
        self,
        indices: Sequence[int],
        epoch: Any,
        keys: Optional[Sequence[int]] = None,
        shared: bool = False,
        clock: transform.Clock = None,
    ) -> list[AnySample]:
        """Samples for in-range ``indices``, written into one output tensor when crops have one size.
        Augmentation is keyed by ``keys`` (default: the indices) in ``epoch`` (one, or one per sample)."""
        at = np.asarray(indices, dtype=np.int64)
        extras = self._label_parts(at)
        keys = indices if keys is None else keys
        if self.transform is not None or self.batch_transform is not None:
            return self._transformed(indices, epoch, keys, extras, shared)
        augment = self._policy(epoch)
        if augment is None:  # whole images differ in size: nothing to preallocate
            wholes = [self._whole(i) for i in indices]
            return [self._sample(image, parts, values, i) for (image, values), parts, i in zip(wholes, extras, indices)]
        rows = self.index[at]
        crops = augment.crops(self.seed, epoch, keys, rows["height"], rows["width"])
        if clock:
            clock("draw crop")
        size = augment.crop_size
        images = self._output(len(indices), (3, size, size), self.dtype, shared)
        slots = images.permute(0, 2, 3, 1)  # each sample's H x W x C view
        # uint8: crops go straight into the batch; float: through one uint8 crop buffer per batch
        outs = slots.numpy() if self.dtype == torch.uint8 else [np.empty((size, size, 3), np.uint8)] * len(indices)
        if clock:
            clock("collate")
        datas = self._fetch(indices)
        heights, widths, crcs = rows["height"].tolist(), rows["width"].tolist(), rows["crc32"].tolist()
        fmt = self.manifest.format
        values: list[Optional[dict[str, Any]]] = [None] * len(indices)
        collecting = gc.isenabled()
        gc.disable()  # the loop frees what it allocates; collections during it only cost time
        try:
            for k, i in enumerate(indices):  # per sample: as few Python steps as possible
                try:
                    self._verify(datas[k], crcs[k])
                    if clock:
                        clock("read")
                    data, payloads = self._split(datas[k]) if self._fields else (datas[k], None)
                    transform.crop_into(data, fmt, heights[k], widths[k], crops[k], outs[k], clock)
                    if payloads is not None:  # after the image, whose decode checked the size a mask fills
                        values[k] = decode_fields(self._fields, payloads, height=heights[k], width=widths[k])
                except (DatasetError, ValueError) as e:
                    raise self._damaged(i, e) from None
                if self.dtype != torch.uint8:
                    transform.normalize_hwc(torch.from_numpy(outs[k]), slots[k], self.mean, self.std)
                    if clock:
                        clock("to float")
        finally:
            if collecting:
                gc.enable()
        try:
            values = self._moved(values, crops, size)
        except DatasetError as e:  # a record's boxes: e.record is its place in the batch
            raise self._damaged(indices[e.record], e) if e.record is not None else e from None
        return [self._sample(images[k], parts, values[k], indices[k]) for k, parts in enumerate(extras)]

    def _multi_rows(self) -> np.ndarray:
        """labels.npy's bit-packed rows, which every "multi" dataset has (packer.backends.pin loads them)."""
        assert self._multi is not None, "a multi-label dataset has labels.npy"
        return self._multi

    def _label_parts(self, at: np.ndarray) -> list[tuple[Any, ...]]:
        """What follows the image in each sample of a batch: (label,) or (label, targets), the label an
        int or a row of one multi-hot tensor, the targets rows of one float32 tensor (see the class doc)."""
        kind = self.label_kind
        if kind == "multi":
            hot = labelling.unpack(self._multi_rows()[at], len(self.manifest.classes)).astype(np.float32)
            parts: list[Any] = [torch.from_numpy(hot).unbind(0)]
        elif kind == "class" or self._targets is None:
            parts = [self._labels[at].tolist()]
        else:
            parts = []  # unlabeled with targets: the targets take the label's place
        if self._targets is not None:
            parts.append(torch.from_numpy(np.array(self._targets[at])).unbind(0))
        return list(zip(*parts))

    def _sample(
        self, image: torch.Tensor, parts: tuple[Any, ...], values: Optional[dict[str, Any]] = None, record: int = 0
    ) -> AnySample:
        """The sample: ``(image, label(, targets))``; with fields a :class:`FieldSample` of the image,
        the label (where the dataset has one), the field ``values`` and the record's index."""
        if not self._fields:
            return Sample(image, *parts) if len(parts) == 1 else TargetSample(image, *parts)
        sample = FieldSample(image=image)
        if self.label_kind != "none":
            sample["label"] = parts[0]
        sample.update(field_tensors(values or {}))
        sample["id"] = int(record)
        sample.ragged = self._ragged
        return sample

    def _split(self, data: memoryview) -> tuple[memoryview, Optional[list[memoryview]]]:
        """A record's image bytes and its fields' payloads (None without fields), to decode after
        the image (a mask's runs can say as many pixels as a hostile index row: the image's decode
        checks that size first); ValueError for a damaged field table."""
        if not self._fields:
            return data, None
        return split_record(data, self._table) if self._table else (data, [])

    def _moved(self, values: list[Any], crops: Optional[list[transform.Crop]], size: int = 0) -> list[Any]:
        """A batch's field values moved by its images' ``crops`` into ``size`` x ``size`` outputs
        (None: whole images, copied out of the records), their boxes checked (DatasetError,
        ``record``: the sample's place in ``values``); as it is without fields."""
        if not self._fields:
            return values
        if crops is None:
            return whole_fields(self._fields, values)
        return move_fields(self._fields, values, crops, self.manifest.format, size, self.box_min_visible)

    def _output(self, n: int, shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
        """An n x ``shape`` batch; C x H x W samples are channels-last in memory unless asked otherwise."""
        if len(shape) == 3 and self.memory_format == torch.channels_last:
            c, h, w = shape
            return batch_tensor((n, h, w, c), dtype, shared).permute(0, 3, 1, 2)
        return batch_tensor((n, *shape), dtype, shared)

    def _fetch(self, indices: Sequence[int]) -> list[memoryview]:
        """The records' bytes; a failure as a DatasetError naming the record and its source."""
        try:
            return self._reader.get_many(indices)
        except DatasetError as e:
            raise self._damaged(e.record, e) if e.record is not None else e from None

    def _transformed(
        self, indices: Sequence[int], epoch: Any, keys: Sequence[int], extras: list[tuple[Any, ...]], shared: bool
    ) -> list[AnySample]:
        """The batch with the user's transforms: each sample cropped (uint8) into a scratch buffer,
        transformed under its seeded random state, written into the batch (whose shape and dtype the
        first output sets), converted to ``dtype`` if uint8; then ``batch_transform`` on the batch."""
        rows = self.index[np.asarray(indices, dtype=np.int64)]
        augment = self._policy(epoch)
        crops = augment.crops(self.seed, epoch, keys, rows["height"], rows["width"]) if augment else None
        size = augment.crop_size if augment else 0
        scratch = np.empty((size, size, 3), np.uint8) if augment else None
        datas = self._fetch(indices)
        seeds = rng.sample_seeds(self.seed, epoch, np.asarray(keys))
        fmt, images, first = self.manifest.format, None, torch.uint8  # first: the first output's dtype
        heights, widths, crcs = rows["height"].tolist(), rows["width"].tolist(), rows["crc32"].tolist()
        values: list[Optional[dict[str, Any]]] = [None] * len(indices)
        with rng.seeded_samples() as seed:
            for k, i in enumerate(indices):
                h, w = heights[k], widths[k]
                try:
                    self._verify(datas[k], crcs[k])
                    data, payloads = self._split(datas[k]) if self._fields else (datas[k], None)
                    if crops is None or scratch is None:
                        hwc = transform.whole_record(data, fmt, h, w)
                    else:
                        transform.crop_into(data, fmt, h, w, crops[k], scratch)
                        hwc = torch.from_numpy(scratch)
                    if payloads is not None:  # moved now: the transform receives them
                        stored = decode_fields(self._fields, payloads, height=h, width=w)
                        values[k] = field_tensors(self._moved([stored], [crops[k]] if crops else None, size)[0])
                except (DatasetError, ValueError) as e:
                    raise self._damaged(i, e) from None
                x = hwc.permute(2, 0, 1)
                if self.transform is not None:
                    seed(seeds[k])
                    if self._fields:
                        x, values[k] = self._transform_fields(x, values[k], i)
                    else:
                        x = self.transform(x)
                    if not isinstance(x, torch.Tensor):
                        raise TypeError(f"transform returned {type(x).__name__} for record {i}, not a tensor")
                if images is None:
                    if (
                        x.dtype == torch.uint8
                        and self.dtype != torch.uint8
                        and (x.dim() != 3 or x.shape[0] != len(self.mean))
                    ):
                        raise ValueError(
                            f"transform output for record {i} is torch.uint8 {tuple(x.shape)}: a uint8 output is "
                            f"normalized to {self.dtype} with {len(self.mean)} channel means, so it must be "
                            f"{len(self.mean)} x H x W (or return a float tensor, or use dtype=torch.uint8)"
                        )
                    first = x.dtype
                    images = self._output(
                        len(indices), tuple(x.shape), self.dtype if x.dtype == torch.uint8 else x.dtype, shared
                    )
                elif x.shape != images.shape[1:] or x.dtype != first:
                    raise ValueError(
                        f"transform output for record {i} is {x.dtype} {tuple(x.shape)}, the batch's first "
                        f"(record {indices[0]}) was {first} {tuple(images.shape[1:])}: a batch needs one "
                        "dtype and shape"
                    )
                slot = images[k]
                if x.dtype == torch.uint8 and slot.dtype != torch.uint8 and x.dim() == 3:
                    transform.normalize_hwc(x.permute(1, 2, 0), slot.permute(1, 2, 0), self.mean, self.std)
                elif x.dtype == slot.dtype and x.stride() == slot.stride():  # one memory copy, as numpy does it:
                    np.copyto(slot.numpy(), x.numpy())  # torch's would start its intra-op threads (150 KB)
                else:
                    slot.copy_(x)
            if images is None:  # no indices: nothing to transform
                return []
            if self.batch_transform is not None:  # seeded by the first draw's key complemented: no sample's
                seed(rng.sample_seeds(self.seed, epoch, ~np.asarray(keys[:1], dtype=np.int64))[0])
                if self._fields:
                    samples: list[Any] = [
                        self._sample(images[k], parts, values[k], indices[k]) for k, parts in enumerate(extras)
                    ]
                    return self._batch_transformed_fields(images, samples, indices)
                images, extras = self._batch_transformed(images, extras, indices)
        return [self._sample(images[k], parts, values[k], indices[k]) for k, parts in enumerate(extras)]

    def _transform_fields(self, x: torch.Tensor, values: Any, i: int) -> tuple[Any, Any]:
        """``transform(image, fields) -> (image, fields)`` on a sample of a dataset with fields (its
        field values moved by the crop already, as tensors): the fields are the transform's to
        change (torchvision v2 transforms pass plain tensors through; wrap boxes in its
        ``tv_tensors.BoundingBoxes`` for its geometric ones to move them). It must return the keys it
        was given (a batch collates them all), and as many box labels as boxes: ValueError naming the
        record and the key otherwise (a set comparison and two lengths: cheap beside any transform)."""
        assert self.transform is not None, "called only with a transform"
        out = self.transform(x, dict(values))  # type: ignore[call-arg]  # Transform's two-argument form
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(
                f"transform returned {type(out).__name__} for record {i}: on a dataset with fields it is "
                "called as transform(image, fields) and returns (image, fields)"
            )
        fields = out[1]
        if fields.keys() != values.keys():
            lost, added = values.keys() - fields.keys(), fields.keys() - values.keys()
            what = [f"without {', '.join(map(repr, sorted(lost)))}"] if lost else []
            what += [f"with {', '.join(sorted(map(repr, added)))}, not given"] if added else []
            raise ValueError(
                f"transform returned the fields of record {i} {' and '.join(what)}: it returns the keys it "
                f"was given ({', '.join(values)}), which the batch collates"
            )
        if self._paired is not None:
            n = [_count(fields[name]) for name in self._paired]
            if n[0] is None or n[0] != n[1]:
                shown = [str(c) if c is not None else type(fields[k]).__name__ for c, k in zip(n, self._paired)]
                raise ValueError(
                    f"transform returned {shown[0]} {self._paired[0]!r} and {shown[1]} {self._paired[1]!r} "
                    f"for record {i}: one box label per box"
                )
        return out

    def _batch_transformed(
        self, images: torch.Tensor, extras: list[tuple[Any, ...]], indices: Sequence[int]
    ) -> tuple[torch.Tensor, list[tuple[Any, ...]]]:
        """``batch_transform`` on the batch and its labels as one tensor (int64 class ids, or the
        multi-hot / target rows stacked); the labels it returns are split back per sample (targets
        beside labels pass through). It must return as many images and labels as it was given."""
        column = [parts[0] for parts in extras]
        labels = torch.tensor(column, dtype=torch.int64) if isinstance(column[0], int) else torch.stack(column)
        assert self.batch_transform is not None, "called only with a batch_transform"
        out = self.batch_transform(images, labels)
        n = len(extras)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and all(isinstance(t, torch.Tensor) and t.dim() > 0 and len(t) == n for t in out)
        ):
            got = (
                ", ".join(f"{len(t) if t.dim() else 'a 0-d'} {what}" for t, what in zip(out, ("images", "labels")))
                if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
                else type(out).__name__
            )
            raise ValueError(
                f"batch_transform returned {got} for a batch of {n} (records {_shown(indices)}): it must return "
                f"(images, labels) with {n} of each"
            )
        images, labels = out
        split = labels.tolist() if labels.dtype == torch.int64 and labels.dim() == 1 else labels.unbind(0)
        return images, [(label, *parts[1:]) for label, parts in zip(split, extras)]

    def _batch_transformed_fields(
        self, images: torch.Tensor, samples: list[FieldSample], indices: Sequence[int]
    ) -> list[AnySample]:
        """``batch_transform(images, fields) -> (images, fields)`` on a batch of a dataset with
        fields: ``fields`` is the batch as :func:`collate_fields` gives it, less its images (label
        and id int64 B, boxes and box labels lists of per-sample tensors, masks B x H x W, text a
        list); what it returns, the same keys with a value per sample each, is split back into the
        samples (a label or id tensor back into ints), so the batch still collates as before."""
        assert self.batch_transform is not None, "called only with a batch_transform"
        fields = collate_columns(samples)
        out = self.batch_transform(images, fields)
        n = len(samples)

        def per_sample(v: Any) -> bool:
            return (isinstance(v, list) or (isinstance(v, torch.Tensor) and v.dim() > 0)) and len(v) == n

        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], torch.Tensor)
            and per_sample(out[0])
            and isinstance(out[1], dict)
            and set(out[1]) == set(fields)
            and all(per_sample(v) for v in out[1].values())
        ):
            raise ValueError(
                f"batch_transform returned {_described(out)} for a batch of {n} (records {_shown(indices)}): on a "
                f"dataset with fields it is called as batch_transform(images, fields) and returns (images, fields), "
                f"{n} images and a dict of the keys it was given ({', '.join(fields)}), {n} values each"
            )
        images, fields = out
        first = samples[0]
        columns = {
            key: v.tolist() if isinstance(first[key], int) and isinstance(v, torch.Tensor) else v
            for key, v in fields.items()
        }
        batch: list[AnySample] = []
        for k in range(n):
            sample = FieldSample(image=images[k])
            sample.update({key: column[k] for key, column in columns.items()})
            sample.ragged = self._ragged
            batch.append(sample)
        return batch

    def _whole(self, i: int) -> tuple[torch.Tensor, Optional[dict[str, Any]]]:
        """Record ``i``'s whole stored image as a C x H x W tensor of ``dtype``, and its fields' values."""
        row = self.index[i]
        values = None
        try:
            data = self._reader.get(i)
            self._verify(data, int(row["crc32"]))
            height, width = int(row["height"]), int(row["width"])
            data, payloads = self._split(data)
            hwc = transform.whole_record(data, self.manifest.format, height, width)
            if payloads is not None:
                values = self._moved([decode_fields(self._fields, payloads, height=height, width=width)], None)[0]
        except (DatasetError, ValueError) as e:
            raise self._damaged(i, e) from None
        if self.dtype != torch.uint8:
            hwc = transform.normalize_hwc(hwc, torch.empty(hwc.shape, dtype=self.dtype), self.mean, self.std)
        chw = hwc.permute(2, 0, 1)
        return chw if self.memory_format == torch.channels_last else chw.contiguous(), values

    def _verify(self, data: memoryview, crc32: int) -> None:
        if self.verify and zlib.crc32(data) != crc32:
            raise ValueError("CRC-32 mismatch (record damaged on disk)")

    def _damaged(self, i: int, e: Exception) -> DatasetError:
        """``e`` (found reading record ``i``) as a DatasetError naming the dataset, record and source."""
        why = str(e).removeprefix(f"{self.root}: ").removeprefix(f"record {i}: ")
        return DatasetError(f"{self.root}: record {i} (source {self.source(i)!r}): {why}", record=i)

    def _check(self, i: int) -> int:
        if self._gone is not None:
            raise self._gone
        return position(i, self.manifest.count, "record", "a dataset")

    def __repr__(self) -> str:
        a, schedule = self.augment, self.options.crop_size
        side = f"{schedule!r} (epoch {self.epoch}: {self.crop_size_at()})" if callable(schedule) else str(schedule)
        crop = "whole image" if a is None else f"{'train' if a.train else 'eval'} crop {side}"
        return (
            f"ShardDataset({self.root!r}, {len(self)} records, {self.manifest.backend}/"
            f"{self.manifest.format}, {crop}, {self.dtype}, seed={self.seed}, epoch={self.epoch})"
        )
