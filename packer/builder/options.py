"""Every setting of ``packer build`` in one place: :class:`BuildOptions`.

Each field carries its default, its ``--help`` text and its command-line shape (``packer build``'s
options are generated from these fields, see :func:`packer.cli.build_option_decorators`), so a new
build option is written once. Validation happens when the object is made, one clear line per bad
value. :meth:`BuildOptions.settings` is what a build records in its staging folder (``build.json``,
compared by ``--resume``) and what the manifest's ``inputs`` digest covers.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from ..backends import BACKENDS
from ..codec import codec_name
from ..errors import BuildError
from ..format.records import FORMATS
from .labels import Labelling
from .preprocess import PreprocessSpec
from .split import check_splits

if TYPE_CHECKING:
    from .scan import Scan

SHARD_SIZE = 10_000  # records per memmap shard of a local build
DASK_TASK_SIZE = 1_000  # files per task of a --dask build (each task's records form one memmap shard)
ON_ERROR = ("skip", "fail")
ON_CLASS_CHANGE = ("warn", "fail")
# A checkpoint (fsync of data and journal, then progress.json) happens every CHECKPOINT_RECORDS
# records or every ``checkpoint_seconds``, whichever comes first: the count bounds the work lost in a
# fast build, the clock makes even a small or slow build resumable after a few seconds.
CHECKPOINT_RECORDS = 2000
PREPROCESS_FIELDS = tuple(f.name for f in fields(PreprocessSpec))  # each a BuildOptions field of the same name


def parse_splits(specs: tuple[str, ...]) -> Optional[dict[str, float]]:
    """('val=0.05', 'test=0.1') -> {'val': 0.05, 'test': 0.1}, in the order given (it orders the cuts)."""
    splits: dict[str, float] = {}
    for spec in specs:
        name, _, fraction = spec.partition("=")
        try:
            share: Optional[float] = float(fraction)
        except ValueError:
            share = None
        if share is None or name.strip() in splits:
            raise ValueError(f"expected NAME=FRACTION once per name, like val=0.05, not {spec!r}")
        splits[name.strip()] = share
    return splits or None


def _option(default: Any, help: str, type: Any = None, **cli: Any) -> Any:
    """A field with its command-line form: ``type`` (int, float, str, bool for a flag, or a tuple of
    choices) and extra click keywords (``metavar``, ``multiple``, ``convert``: a parser of the raw value)."""
    return field(default=default, metadata={"help": help, "type": type, **cli})


def _flag(help: str) -> Any:
    """An on/off option, off by default."""
    return _option(False, help, bool)


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How to build a dataset; the defaults are ``packer build``'s. Invalid values: BuildError."""

    backend: Optional[str] = _option(None, "Default: lmdb when OUT ends in .lmdb, else memmap.", tuple(BACKENDS))
    format: str = _option(
        "jpeg",
        "jpeg: re-encoded JPEG; raw: decoded uint8 H x W x 3 pixels (bigger, no decode at read).",
        tuple(FORMATS),
    )
    short_edge: int = _option(320, "Target short edge; never upscales.", int)
    quality: int = _option(90, "JPEG quality (1..100).", int)
    workers: Optional[int] = _option(
        None,
        "Decoding processes [default: all cores]; 0 (or 1) decodes in this process, as num_workers=0 "
        "does for a DataLoader and `packer bench`. With --dask local: the cluster's worker processes.",
        int,
    )
    shard_size: Optional[int] = _option(
        None,
        f"Records per memmap shard [default: {SHARD_SIZE}]. With --dask: files per task, and each "
        f"task's records form one memmap shard [default: {DASK_TASK_SIZE}].",
        int,
    )
    labels: Optional[str] = _option(
        None,
        "CSV whose header names the columns path,label (path relative to RAW_DIR) instead of "
        "folder labels. Integer labels (0, 1, 2, ...) keep their value as the class id; other "
        "labels are numbered in sorted order.",
        "file",
    )
    coco: Optional[str] = _option(
        None,
        "COCO annotations (instances JSON) of the images in RAW_DIR (file_name relative to it): pack "
        "each listed image with its boxes, their category ids and a segmentation map (polygons or "
        "RLE drawn in category ids), category names recorded (docs/FIELDS.md). A flat folder, not class folders.",
        "file",
    )
    #: --classes, --unlabeled, --multi-label, --targets (its own fields: see packer.builder.labels)
    labelling: Labelling = field(default=Labelling())
    on_error: Optional[str] = _option(
        None,
        "skip: report bad files and folders and go on; fail: stop at the first one. Default: "
        "skip bad files, but fail on a folder that cannot be read (its files and perhaps a "
        "whole class would be missing); a class folder skipped with --on-error skip keeps "
        "its class id.",
        ON_ERROR,
    )
    on_class_change: Optional[str] = _option(
        None,
        "When --update would give classes of OUT other ids (a class folder added or deleted before "
        "others): warn: say which ids change, and renumber; fail: stop, OUT untouched (to keep ids, pin "
        "them with --classes FILE). Default: fail with --on-error fail, else warn.",
        ON_CLASS_CHANGE,
    )
    allow_empty: bool = _flag(
        "Write the dataset even when every file was skipped (0 records). By default such a build fails "
        "and leaves OUT as it was: a broken decoder or worker pool must not replace a dataset with nothing.",
    )
    max_pixels: int = _option(256_000_000, "Refuse images with more pixels (decompression bombs).", int)
    min_size: int = _option(16, "Skip images with a shorter edge.", int)
    max_aspect: float = _option(10.0, "Skip images whose long/short edge ratio exceeds this.", float)
    force: bool = _flag(
        "Replace an existing OUT (only once the new one is complete). "
        "When OUT is a symlink, the dataset it points to is replaced and the link kept.",
    )
    update: bool = _flag(
        "Refresh OUT: decode only files added or changed since it was built (same path, size and "
        "mtime = unchanged), drop deleted ones, keep the other records (their data files are linked, "
        "not copied). Unchanged input: says so, "
        "writes nothing. Changed build options: rebuilds everything. Builds OUT if absent.",
    )
    checksum: bool = _flag("With --update: compare file contents (a hash; reads every file) instead of mtimes.")
    split: Optional[dict[str, float]] = _option(  # noqa: RUF009 (a field(), like the others)
        None,
        "Also write split NAME (e.g. val=0.05; repeatable): OUT becomes a folder with one dataset "
        "per split (OUT/train.lmdb, OUT/val.lmdb, or OUT/train/, ... for memmap); train gets the "
        "rest. By hashed path, per class, stable when files are added.",
        str,
        multiple=True,
        metavar="NAME=FRACTION",
        convert=parse_splits,
    )
    split_seed: int = _option(0, "Seed of the --split assignment.", int)
    resume: bool = _flag(
        "Continue an interrupted build of the same inputs and options. OUT already built from "
        "them: says so, exit 0; OUT built from other input or options: an error.",
    )
    wait: bool = _flag(
        "If another build of OUT is running, wait for it to finish instead of failing with "
        "'OUT is being built by pid N'.",
    )
    checkpoint_seconds: float = _option(
        2.0, f"Make the work so far resumable at least this often (also every {CHECKPOINT_RECORDS} images).", float
    )

    def __post_init__(self) -> None:
        problems = [f"{flag(name)} {getattr(self, name)!r}: {why}" for name, why in self._problems()]
        if self.split:
            try:
                check_splits(self.split)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise BuildError("; ".join(problems))

    def _problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for every bad value."""
        at_least: dict[str, float] = {"short_edge": 1, "min_size": 1, "max_aspect": 1, "max_pixels": 1}
        at_least |= {"checkpoint_seconds": 0, "shard_size": 1, "workers": 0}
        found = [
            (name, f"must be >= {low:g}")
            for name, low in at_least.items()
            if getattr(self, name) is not None and not getattr(self, name) >= low
        ]
        if not 1 <= self.quality <= 100:
            found.append(("quality", "must be 1..100"))
        choices: dict[str, Collection[str]] = {
            "backend": BACKENDS,
            "format": FORMATS,
            "on_error": ON_ERROR,
            "on_class_change": ON_CLASS_CHANGE,
        }
        for name, allowed in choices.items():
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                found.append((name, f"must be one of {', '.join(allowed)}"))
        return found

    def but(self, **changes: Any) -> BuildOptions:
        """A copy with ``changes`` (field names), validated again."""
        return replace(self, **changes) if changes else self

    def resolved(self, out: str | os.PathLike, shard_size: int) -> Resolved:
        """The defaults that depend on OUT's name (backend) and on the engine (``shard_size``) filled in."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Resolved(
            **values | {"backend": self.backend or default_backend(out), "shard_size": self.shard_size or shard_size}
        )

    @property
    def preprocess(self) -> PreprocessSpec:
        """What each file's preprocessing needs (sent to every worker)."""
        return PreprocessSpec(**{name: getattr(self, name) for name in PREPROCESS_FIELDS})

    @property
    def processes(self) -> int:
        """Decoding processes: all cores by default; 0 and 1 decode in this process (no pool)."""
        return self.workers if self.workers is not None else os.cpu_count() or 1

    @property
    def class_change_fails(self) -> bool:
        """A refresh that renumbers classes fails (see ``on_class_change``)."""
        return (self.on_class_change or ("fail" if self.on_error == "fail" else "warn")) == "fail"

    @property
    def keep_current(self) -> bool:
        """Leave a dataset alone whose recorded inputs and settings equal this build's."""
        return self.update or (self.resume and not self.force)

    def settings(self, found: Scan) -> dict[str, Any]:
        """What ``build.json`` records (``--resume`` must match it) and the manifest's ``inputs`` digest
        covers, for the sources ``found`` (a --split dataset's own), once :meth:`resolved`. Its keys and
        values are those of every dataset built so far: changing them makes every dataset out of date."""
        return {
            "options": asdict(self.preprocess),
            "backend": self.backend,
            "shard_size": self.shard_size,
            "inputs": found.fingerprint(),
            "codec": codec_name(),
            "checksum": self.checksum,
            "labels": self.labelling.settings(),
        }

    def manifest_options(self) -> dict[str, Any]:
        """The manifest's ``options``: preprocessing, shard size, --checksum."""
        return asdict(self.preprocess) | {"shard_size": self.shard_size, "checksum": self.checksum}


@dataclass(frozen=True, kw_only=True)
class Resolved(BuildOptions):
    """The options of a running build (:meth:`BuildOptions.resolved`): its backend and shard size are
    known, so the code past that point need not check them for None."""

    backend: str
    shard_size: int


def flag(name: str) -> str:
    """The command-line flag of field ``name``."""
    return "--" + name.replace("_", "-")


def default_backend(out: str | os.PathLike) -> str:
    """The backend of the longest suffix OUT ends with (``out.lmdb``: LMDB; every name ends with memmap's "")."""
    name = str(out).rstrip("/")
    return max((b for b in BACKENDS.values() if name.endswith(b.suffix)), key=lambda b: len(b.suffix)).name


def cli_fields() -> list[Any]:
    """The BuildOptions fields that are ``packer build`` options, in --help order."""
    return [f for f in fields(BuildOptions) if "help" in f.metadata]


def labelling_fields() -> list[Any]:
    """The Labelling fields, ``packer build``'s --classes, --unlabeled, --multi-label and --targets
    (options.labelling), in --help order: after :func:`cli_fields`."""
    return list(fields(Labelling))
