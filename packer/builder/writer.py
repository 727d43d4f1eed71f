"""``packer.Writer`` and ``packer.pack``: a dataset from code (an iterator, a torch Dataset, a list of
arrays) rather than a folder, with fields beside each image (packer.format.fields).

It is the build's machinery fed one sample at a time: the same OUT checks and build lock, the same
staging folder renamed into place at the end (:func:`packer.builder.staging.complete`: OUT is complete
or absent), the same record sink and journal, the same preprocessing of the image (EXIF orientation,
RGB, short edge, JPEG or raw: packer.builder.preprocess), with boxes and masks scaled as the image is.
A sample that cannot be packed is a reported skip naming it (``report.jsonl``), and counts add up.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import mmap
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

import numpy as np
from PIL import Image

from ..backends import BACKENDS
from ..errors import BuildError, local_path
from ..format import IDENTITY_DTYPE
from ..format.fields import Field, declare, encode_fields, join_record, nearest, record_fields
from ..format.records import FORMATS
from .options import CHECKPOINT_RECORDS, SHARD_SIZE, BuildOptions
from .paths import check_target, dataset_path, lock_outputs
from .preprocess import PreprocessSpec, Record, Skip, describe, load_bytes, load_image
from .scan import Paths, PathsBuilder, Scan, Source, Sources, open_source
from .shared import Blocks, attach, detach
from .staging import BuildReport, RecordSink, complete, open_staging, staging_path
from .workers import ordered

#: BuildOptions that walk a folder or an earlier build, which a Writer has neither of (yet).
FOLDER_ONLY = ("labels", "split", "update", "resume", "checksum", "coco")
#: What a sample dict holds besides its fields: ``skip``, a reason found before it came (a converter's
#: own check), reports it skipped instead of packing it (no image needed).
SAMPLE_KEYS = ("image", "source", "skip")


class Writer:
    """Writes a dataset at ``out`` one sample at a time: ``with packer.Writer(out, fields=...) as w:
    w.write({"image": ..., "boxes": ..., ...})``; ``w.report`` once it closes.

    ``fields``: what each sample holds beside its image, by name (``{"label": "label", "boxes":
    "boxes", "box_labels": "box_labels", "mask": "mask", "caption": "text", "emb": ("array",
    "float32")}``; docs/FIELDS.md). A sample's ``image`` is a path, encoded bytes, a Pillow image or
    an H x W x 3 uint8 array; ``source`` (optional) names it in ``ds.source(i)`` and the report
    (default: the path, else ``sample-N``). Boxes (x0, y0, x1, y1) and masks are given in the
    pixels of the upright source image and scaled with it. ``classes``: the names of the label ids
    (default "0", "1", ... up to the largest). ``options`` and keywords: :class:`BuildOptions`
    (``backend``, ``format``, ``short_edge``, ``quality``, ``force``, ``on_error``, ...).
    Leaving the ``with`` block by an exception writes nothing (OUT stays as it was)."""

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        fields: Any,
        options: Optional[BuildOptions] = None,
        classes: Optional[Sequence[str]] = None,
        quiet: bool = True,
        **changes: Any,
    ) -> None:
        self.options = (options or BuildOptions()).but(**changes)
        given = [name for name in FOLDER_ONLY if getattr(self.options, name) not in (None, False)]
        if given or self.options.labelling != type(self.options.labelling)():
            raise BuildError(
                f"packer.Writer does not take {', '.join(given) or 'labelling'} (options of a folder build)"
            )
        try:
            self.fields = declare(fields)
        except ValueError as e:
            raise BuildError(f"packer.Writer: {e}") from None
        self._labelled = any(f.kind == "label" for f in self.fields)
        self._in_record = record_fields(self.fields)
        #: per record field: records with a value, items, and (boxes) records per number of boxes
        self._counts: dict[str, dict[str, Any]] = {
            f.name: {"records": 0, "items": 0, **({"per_record": {}} if f.kind == "boxes" else {})}
            for f in self._in_record
        }
        self.classes = list(classes) if classes is not None else None
        if self.classes is not None and not self._labelled:
            raise BuildError("packer.Writer: classes= needs a label field")
        local_path(out)
        self._given, self.out = Path(out), dataset_path(out)
        self._resolved = self.options.resolved(out, SHARD_SIZE)
        self._spec = self._resolved.preprocess
        self._paths, self._labels = PathsBuilder(), list[int]()
        self._named = 0  # samples named so far (handed to workers, perhaps not yet accepted)
        self.report: Optional[BuildReport] = None
        self._started = time.monotonic()
        self._locks = contextlib.ExitStack()
        self._staging = staging_path(self.out)
        try:
            lock_outputs(self._locks, self.out, self._resolved, quiet)
            check_target(self.out, replaces=self.options.force, keeps=False)
            settings = {"writer": [f.to_json() for f in self.fields], "options": self._resolved.manifest_options()}
            open_staging(self._staging, settings, resume=False)
            backend, shard_size = BACKENDS[self._resolved.backend], self._resolved.shard_size
            self._sink = RecordSink(
                self._staging, _scan([], []), None, lambda s: backend.open_writer(self._staging, s, shard_size, 0)
            )
        except BaseException:
            self._locks.close()
            raise
        self._identity = np.zeros(1, IDENTITY_DTYPE)[0]
        classes_count = len(self.classes) if self.classes is not None else None
        self._job = SampleJob(self._spec, self.fields, self._labelled, classes_count)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: Optional[type], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if e is None:
            self.close()
        else:
            self.abort()

    @property
    def written(self) -> int:
        """Samples given so far (packed or skipped)."""
        return len(self._labels)

    def write(self, sample: dict[str, Any]) -> None:
        """Pack one sample, in this process, or report it skipped (``on_error="fail"``: BuildError)
        naming its source."""
        source = self._checked(sample)
        self._accept(source, encode_chunk([sample], job=self._job)[0])

    def write_all(self, samples: Iterable[dict[str, Any]]) -> None:
        """Pack every sample of ``samples``, in order, decoded by the build's worker processes
        (``workers``; 0 or 1: in this process, as :meth:`write`). A script calling it must do so
        under ``if __name__ == "__main__":``, as for ``packer.build``."""
        processes = self.options.processes
        if processes <= 1:
            for sample in samples:
                self.write(sample)
            return
        sources: deque[str] = deque()  # the names of the samples handed over, in order
        blocks = Blocks()  # their arrays, in shared memory until their results are in

        def chunks() -> Iterator[list[dict[str, Any]]]:
            it = iter(samples)
            while batch := list(itertools.islice(it, CHUNK)):
                sources.extend(self._checked(s) for s in batch)  # in this process: a BuildError stops all
                yield blocks.share(batch)

        job = functools.partial(encode_chunk, job=self._job)

        def name(sample: dict[str, Any]) -> str:
            return str(sample.get("source") or "a sample")

        try:
            # depth 1: a sample may still carry big bytes or a Pillow image through the pipe
            for result in ordered(chunks(), job, processes, name=name, depth=1):
                self._accept(sources.popleft(), result)
                blocks.taken()
        finally:
            blocks.close()

    def _checked(self, sample: Any) -> str:
        """The name of a sample this Writer can take (BuildError for one it cannot: a dict with an
        image and declared fields only)."""
        if self.report is not None:
            raise BuildError(f"packer.Writer for {self.out} is closed")
        if not isinstance(sample, dict) or not ("image" in sample or isinstance(sample.get("skip"), str)):
            raise BuildError(f"packer.Writer: a sample is a dict with an 'image', not {type(sample).__name__}")
        unknown = set(sample) - set(SAMPLE_KEYS) - {f.name for f in self.fields}
        if unknown:  # a misspelt field would otherwise be dropped from every record
            raise BuildError(f"packer.Writer: sample keys {sorted(unknown)} are not declared fields")
        image, n = sample.get("image"), self._named
        self._named += 1
        named = sample.get("source") or (os.fspath(image) if isinstance(image, (str, os.PathLike)) else None)
        return str(named) if named else f"sample-{n}"

    def _accept(self, source: str, result: Encoded | Skip) -> None:
        """A sample's result, in order: its record into the sink (with its field counts), or a skip."""
        if isinstance(result, Skip):
            self.skip(source, result.reason)
        else:
            label, record, payloads = result
            self._paths.add(source)
            self._labels.append(label)
            self._sink.add(Source(source, label), self._identity, record)
            for f, payload in zip(self._in_record, payloads):
                items = f.of.count(memoryview(payload))
                tally = self._counts[f.name]
                tally["records"] += items > 0
                tally["items"] += items
                if f.kind == "boxes":
                    tally["per_record"][items] = tally["per_record"].get(items, 0) + 1
        if self.written % CHECKPOINT_RECORDS == 0:
            self._sink.checkpoint(self.written)

    def skip(self, source: str, why: str) -> None:
        """Report a sample that cannot be packed (``why``) as skipped, counted with the others
        (``on_error="fail"``: BuildError)."""
        if self.options.on_error == "fail":
            raise BuildError(f"sample {self.written} ({source}): {why} (on_error='fail')")
        self._paths.add(source)
        self._labels.append(-1)
        self._sink.skip(source, why)

    def close(self) -> BuildReport:
        """Finish the dataset: manifest written, staging folder renamed to OUT. Idempotent."""
        if self.report is not None:
            return self.report
        try:
            self._sink.checkpoint(self.written)
            labels = np.array(self._labels, dtype=np.int32)
            classes = self.classes
            if classes is None:
                classes = [str(c) for c in range(int(labels.max(initial=-1)) + 1)] if self._labelled else []
            found = _scan(self._paths.paths(), labels, classes, "class" if self._labelled else "none")
            found.identity = np.zeros(len(labels), IDENTITY_DTYPE)
            counts = {
                name: c
                | ({"per_record": {str(k): n for k, n in sorted(c["per_record"].items())}} if "per_record" in c else {})
                for name, c in self._counts.items()
            }
            report = complete(self._staging, self.out, found, self._resolved, self._sink, 0, self.fields, counts)
        except BaseException:
            self.abort()
            raise
        self._locks.close()
        report.processed, report.out = self.written, str(self._given)
        report.seconds = time.monotonic() - self._started
        self.report = report
        return report

    def abort(self) -> None:
        """Drop everything written: OUT stays as it was."""
        with contextlib.suppress(Exception):
            self._sink.close()
        shutil.rmtree(self._staging, ignore_errors=True)
        self._locks.close()


@dataclass(frozen=True)
class SampleJob:
    """What encoding a sample needs, sent to each worker: the preprocessing, the fields, and the
    number of classes where labels are checked against it (None: any id >= 0; no label field: -1)."""

    spec: PreprocessSpec
    fields: tuple[Field, ...]
    labelled: bool
    classes: Optional[int]


#: A packed sample: its label (-1 without a label field), its record and its fields' payloads.
Encoded = tuple[int, Record, list[bytes]]
CHUNK = 4  # samples per task handed to a worker (their arrays in one shared-memory block)


def encode_chunk(samples: list[dict[str, Any]], *, job: SampleJob) -> list[Encoded | Skip]:
    """Each sample's record, or a Skip saying what is wrong with it (never raising for a sample's fault)."""
    blocks: dict[str, mmap.mmap] = {}  # the shared-memory blocks its arrays lie in (packer.builder.shared)
    try:
        return [_encode(attach(sample, blocks), job) for sample in samples]
    finally:
        detach(blocks)


def _encode(sample: dict[str, Any], job: SampleJob) -> Encoded | Skip:
    if sample.get("skip") is not None:
        return Skip(str(sample["skip"]))
    try:
        label = _label(sample.get("label"), job.classes) if job.labelled else -1
        return (label, *_record(sample, job))
    except MemoryError:
        return Skip("out of memory while decoding")
    except Exception as e:  # the sample's problem: reported with its name, as a bad file is
        return Skip(describe(e))


def _label(value: Any, classes: Optional[int]) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"label {value!r} is not a class id (an int >= 0)")
    if classes is not None and value >= classes:
        raise ValueError(f"label {value} is beyond the {classes} classes")
    return int(value)


def _record(sample: dict[str, Any], job: SampleJob) -> tuple[Record, list[bytes]]:
    """The sample's record: the image preprocessed as a build's, its fields scaled to it."""
    image, spec = sample["image"], job.spec
    if isinstance(image, (str, os.PathLike)):
        with open_source(os.fspath(image)) as file:
            im, (w0, h0) = load_bytes(file.read(), spec)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        im, (w0, h0) = load_bytes(bytes(image), spec)
    elif isinstance(image, Image.Image) or _is_pixels(image):
        im, (w0, h0) = load_image(image, spec)
    else:
        raise ValueError(f"image: a path, bytes, a PIL image or an H x W x 3 uint8 array, not {_kind(image)}")
    rgb = np.ascontiguousarray(np.asarray(im, dtype=np.uint8))
    h, w = rgb.shape[:2]
    values = {f.name: sample.get(f.name) for f in job.fields}
    for f in job.fields:
        v = values[f.name]
        if f.kind == "boxes" and v is not None:
            boxes = np.asarray(v, dtype=np.float64)
            if boxes.size and (boxes.ndim != 2 or boxes.shape[1] != 4):
                raise ValueError(f"{f.name}: shape {boxes.shape}, expected N x 4 (x0, y0, x1, y1)")
            values[f.name] = boxes.reshape(-1, 4) * np.array([w / w0, h / h0, w / w0, h / h0])
        elif f.kind == "mask" and v is not None:
            mask = np.asarray(v)
            if mask.shape != (h0, w0):
                raise ValueError(f"{f.name}: shape {mask.shape}, the image is {h0} x {w0} (upright)")
            values[f.name] = nearest(mask, (0, 0, h0, w0), (h, w)) if (h, w) != (h0, w0) else mask
    payloads = encode_fields(job.fields, values, height=h, width=w)
    data = join_record(FORMATS[spec.format].encode(rgb, quality=spec.quality), payloads)
    return Record(data, h, w, zlib.crc32(data)), payloads


def _is_pixels(value: Any) -> bool:
    """An H x W x 3 uint8 array."""
    return isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] == 3


def _kind(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return (
        f"{type(value).__name__} {getattr(value, 'dtype', '')} {tuple(shape)}"
        if shape is not None
        else type(value).__name__
    )


def _scan(paths: Paths | Sequence[str], labels: Any, classes: Sequence[str] = (), kind: str = "none") -> Scan:
    """The scan a folder build would have made of the samples given: their sources and labels."""
    held = paths if isinstance(paths, Paths) else Paths.of(paths)
    return Scan(Sources(held, np.asarray(labels, dtype=np.int32)), list(classes), kind=kind)


def pack(samples: Iterable[dict[str, Any]], out: str | os.PathLike, *, fields: Any, **options: Any) -> BuildReport:
    """Every sample of ``samples`` into a dataset at ``out`` (see :class:`Writer` for the rest)."""
    with Writer(out, fields=fields, **options) as w:
        w.write_all(samples)
    assert w.report is not None, "closed on leaving the with block"
    return w.report
