"""Labels as users have them: class folders or a labels CSV, a fixed class list, unlabeled images,
several labels per image, numeric targets.

A build's labelling is one :class:`Labelling` (the options ``--classes``, ``--unlabeled``,
``--multi-label`` and ``--targets``). It decides the dataset's label kind (manifest ``label_kind``):

- ``"class"``: one class per image, its id in index.npy's ``label`` field.
- ``"multi"``: any number of classes per image; ``label`` is -1 and ``labels.npy`` holds each record's
  multi-hot row, bit-packed (``np.packbits(..., axis=1, bitorder="little")``: 1 bit per class).
- ``"none"``: no labels; ``label`` is -1, ``classes`` is empty.

Any kind may also carry ``targets.npy``: float32, one row of numeric CSV columns per record.
Class ids: a ``--classes`` file's line order; else integer CSV labels keep their value; else names in
sorted order (folder names: torchvision ImageFolder's order). Nothing here is pickled.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Optional

import numpy as np

from ..errors import LabelError
from ..format.label_arrays import SEPARATOR

#: Integer CSV labels become ids 0..max, one class each: refuse ids that would list millions of classes.
MAX_INTEGER_ID = 1_000_000
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INTEGER = re.compile(r"0|[1-9][0-9]*")  # no sign, no leading zeros: "007" stays a name


def parse_targets(columns: Optional[str]) -> tuple[str, ...]:
    """``--targets a,b`` as the column names ("a", "b"); no --targets: ()."""
    return tuple(t.strip() for t in columns.split(",")) if columns else ()


@dataclass(frozen=True)
class Labelling:
    """How a build labels its images (see the module docstring); the default is one class per image."""

    # Each field is also a ``packer build`` flag (its name, as BuildOptions' fields are): the metadata
    # is its --help text and command-line shape, in packer.builder.options' terms (see ``_option``).
    classes: Optional[str] = field(  # a file of class names, one a line: their order is the ids
        default=None,
        metadata={
            "help": "Fixed class list, one name per line: line order = class ids. Folder names or CSV labels "
            "must be in it (others: skipped and reported; an error with --on-error fail); classes "
            "without images keep their id. Same mapping for every --split and --update.",
            "type": "file",
            "metavar": "FILE",
        },
    )
    unlabeled: bool = field(
        default=False,
        metadata={
            "help": "No labels: every image under RAW_DIR (a flat folder, or folders whose names are ignored). "
            "ShardDataset returns (image, -1), or (image, targets) with --targets.",
            "type": bool,
        },
    )
    multi_label: bool = field(
        default=False,
        metadata={
            "help": "With --labels: the label column lists several labels separated by ';' (or none). "
            "ShardDataset returns a multi-hot float32 vector of len(classes) as the label.",
            "type": bool,
        },
    )
    targets: tuple[str, ...] = field(  # numeric columns of the labels CSV, stored as float32
        default=(),
        metadata={
            "help": "With --labels: store these numeric CSV columns per image (float32). ShardDataset returns "
            "(image, label, targets), or (image, targets) with --unlabeled.",
            "type": str,
            "metavar": "COL[,COL...]",
            "convert": parse_targets,
        },
    )

    @property
    def kind(self) -> str:
        return "none" if self.unlabeled else "multi" if self.multi_label else "class"

    def check(self, labels_csv: str | os.PathLike | None) -> None:
        """Refuse combinations that mean nothing, in one line naming the options."""
        if self.unlabeled and (self.multi_label or self.classes):
            raise LabelError("--unlabeled cannot be combined with --multi-label or --classes")
        if any(not t.strip() for t in self.targets) or len(set(self.targets)) != len(self.targets):
            raise LabelError(f"--targets {','.join(self.targets)!r}: column names must be non-empty and distinct")
        if "path" in self.targets or ("label" in self.targets and not self.unlabeled):
            raise LabelError("--targets cannot name the 'path' column, nor 'label' (unless --unlabeled)")
        if self.multi_label and labels_csv is None:
            raise LabelError("--multi-label needs --labels (a CSV whose label column lists 'a;b;c')")
        if self.targets and labels_csv is None:
            raise LabelError("--targets needs --labels (a CSV holding those columns)")

    def settings(self) -> dict[str, object]:
        """What a build records (build.json, manifest ``inputs``): a change means different labels."""
        return {"kind": self.kind, "targets": list(self.targets)}


def read_classes(path: str | Path) -> list[str]:
    """``--classes`` FILE: one name per line (surrounding spaces and blank lines ignored), no duplicates."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LabelError(f"{path}: cannot read the class list ({e})") from None
    names: list[str] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, start=1):
        name = line.strip()
        if not name:
            continue
        if name in seen:
            raise LabelError(f"{path}:{n}: class {name!r} is listed twice (first on line {seen[name]})")
        seen[name] = n
        names.append(name)
    if not names:
        raise LabelError(f"{path}: the class list is empty (one class name per line)")
    return names


@dataclass(frozen=True)
class Row:
    """One labels-CSV row: where it is (``file:line``), its label names and its target values."""

    where: str
    names: tuple[str, ...]
    targets: tuple[float, ...]


def _relative(path: str, where: str) -> str:
    """The row's path as a key relative to raw/; refuses paths that escape it."""
    p = PurePosixPath(path.replace("\\", "/"))
    if not p.parts:
        raise LabelError(f"{where}: path {path!r} names raw/ itself, not a file in it")
    if p.is_absolute() or ".." in p.parts or path.startswith(("/", "\\")) or ":" in p.parts[0]:
        raise LabelError(f"{where}: path {path!r} escapes raw/ (must be relative, without '..')")
    return str(p)


def _number(text: str, column: str, where: str) -> float:
    """A finite float32 value, or a LabelError naming the row and column."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise LabelError(f"{where}: column {column!r}: {text!r} is not a finite number (float32)")
    return value


def read_csv(path: str | os.PathLike, labelling: Labelling) -> tuple[dict[str, Row], list[str]]:
    """The labels CSV: rows by path relative to raw/, and the names of columns it does not use.

    The first line names the columns (``path``, ``label`` unless --unlabeled, the --targets ones);
    a UTF-8 BOM, CRLF line ends and quoted fields are fine. Every problem names ``file:line``.
    """
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            wanted = ["path"] + ([] if labelling.unlabeled else ["label"]) + list(labelling.targets)
            missing = [c for c in wanted if c not in header]
            if missing:
                raise LabelError(
                    f"{path}:1: no column {missing[0]!r} in the header ({', '.join(map(repr, header))}); "
                    f"the first line must name the columns, e.g. {','.join(wanted)}"
                )
            if len(set(header)) != len(header):
                raise LabelError(f"{path}:1: a column name appears twice in the header")
            col = {name: header.index(name) for name in wanted}
            rows: dict[str, Row] = {}
            for fields in reader:
                where = f"{path}:{reader.line_num}"
                if not any(v.strip() for v in fields):
                    continue  # a blank line
                if len(fields) != len(header):
                    raise LabelError(f"{where}: {len(fields)} fields, the header has {len(header)}")
                value = {name: fields[i].strip() for name, i in col.items()}
                if not value["path"]:
                    raise LabelError(f"{where}: empty path")
                key = _relative(value["path"], where)
                names = _names(value.get("label", ""), labelling, value["path"], where)
                targets = tuple(_number(value[c], c, where) for c in labelling.targets)
                if key in rows:
                    raise LabelError(f"{where}: duplicate path {value['path']!r} (first at {rows[key].where})")
                rows[key] = Row(where, names, targets)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise LabelError(f"{path}: cannot read labels file ({e})") from None
    return rows, [c for c in header if c not in col]


def _names(label: str, labelling: Labelling, path: str, where: str) -> tuple[str, ...]:
    """A row's label names: none (--unlabeled), one, or the ';'-separated set (--multi-label, may be empty)."""
    if labelling.unlabeled:
        return ()
    if not labelling.multi_label:
        if not label:
            raise LabelError(f"{where}: empty label for {path!r}")
        return (label,)
    names = tuple(dict.fromkeys(n.strip() for n in label.split(SEPARATOR))) if label else ()
    if any(not n for n in names):
        raise LabelError(f"{where}: empty label between {SEPARATOR!r} separators in {label!r}")
    return names


def class_list(
    named: Sequence[tuple[str, ...]], where: Sequence[str], pinned: Optional[list[str]], integers: bool
) -> list[str]:
    """The class names in id order: ``pinned`` (--classes) as given; else, when ``integers`` (a CSV)
    and every name is a plain non-negative integer, '0'..'max' (the CSV's ids kept); else sorted."""
    if pinned is not None:
        return pinned
    seen = {n for names in named for n in names}
    if integers and seen and all(_INTEGER.fullmatch(n) for n in seen):
        top = max(seen, key=int)
        if int(top) > MAX_INTEGER_ID:
            at = next(w for names, w in zip(named, where) if top in names)
            raise LabelError(
                f"{at}: integer label {top} is above {MAX_INTEGER_ID}, too large for a class id "
                f"(if labels are names, list them with --classes FILE)"
            )
        return [str(i) for i in range(int(top) + 1)]
    return sorted(seen)
