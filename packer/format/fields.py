"""Fields: what a record holds beside its image (boxes, masks, text, arrays), chosen by kind from one
table (:data:`FIELD_KINDS`), each kind's encode beside its decode and check (as FFCV's fields do).

A dataset declares its fields once, in the manifest (``fields``: name, kind, dtype); a record of a
dataset with fields is its image followed by the fields' payloads in that order, behind a table of
their lengths (docs/FORMAT.md, "Fields"). Nothing is pickled: every payload is little-endian numbers
or UTF-8 (but an array field a manifest declares big-endian, as packer once wrote a user's ``>f4``:
read all the same), and every length is checked against the record's before anything is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

#: The manifest's ``format_version`` of a dataset with fields (one without keeps version 3's).
FIELDS_VERSION = 4
#: Names a sample dict uses for what is not a field: a read sample's image and record index, a written
#: sample's source name and skip reason (packer.builder.writer.SAMPLE_KEYS). A field of one of these
#: names would collide with it (a ``skip`` text field turned its samples into skips).
RESERVED = ("image", "id", "source", "skip")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
MAX_NDIM = 32  # an array field's dimensions at most (numpy's own limit is 64)


class FieldKind:
    """One kind of field. ``in_record``: its values live in the record (else in index.npy: the
    label). ``dtype``: the numpy dtype its values have (None: the field declares one, ``array``).
    ``geometric``: the crop, flip and resize of the image apply to it (boxes, masks). ``single``:
    a dataset has at most one field of this kind (boxes pair with box labels)."""

    name = ""
    in_record = True
    dtype: Optional[str] = None
    geometric = False
    single = False
    item = 1  #: bytes per item of the payload (a box: 16)
    #: The payload layouts a kind has (a mask: raw pixels or run lengths), named by the manifest's
    #: ``encoding``: the first is what an entry naming none means (what packer wrote before there
    #: were encodings), the last what a new declaration gets. Empty: one layout, never named.
    encodings: tuple[str, ...] = ()

    def __init__(self, encoding: str = "") -> None:
        self.encoding = encoding or (self.encodings[-1] if self.encodings else "")

    def using(self, encoding: str) -> FieldKind:
        """This kind with its payloads in ``encoding`` (one of :attr:`encodings`; "" for a kind that
        has none); Field.of makes it once per field."""
        return self if encoding == self.encoding else type(self)(encoding)

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        """The payload of ``value`` in a record whose stored image is ``height`` x ``width``;
        ValueError naming what is wrong with ``value``."""
        raise NotImplementedError

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> Any:
        """The value of a payload (an array may be a view of the record's bytes: copy it to keep it);
        ValueError when the payload cannot be one of this kind (a damaged or hostile record)."""
        raise NotImplementedError

    def count(self, payload: memoryview) -> int:
        """How many items the payload holds (boxes, labels, mask pixels, text bytes, array elements),
        for ``info``; a payload this packer wrote (it is not checked)."""
        return len(payload) // self.item

    def items(self, payload: memoryview, dtype: str) -> np.ndarray:
        """The payload as a flat array of ``dtype``, ValueError unless it holds whole items."""
        if len(payload) % self.item:
            raise ValueError(f"{self.name} payload of {len(payload)} bytes is not whole items of {self.item} bytes")
        return np.frombuffer(payload, dtype)


def _numbers(value: Any, dtype: np.dtype, what: str) -> np.ndarray:
    try:
        a = np.asarray(value)
    except Exception as e:
        raise ValueError(f"{what}: not an array ({type(e).__name__}: {e})") from None
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise ValueError(f"{what}: dtype {a.dtype} is not a plain numeric array")
    return a


def box_array(value: Any, what: str) -> np.ndarray:
    """``value`` as N x 4 boxes of real numbers (float64), ValueError (naming ``what``) for any other
    shape or dtype: complex numbers or strings are refused, not cut to their real part or parsed."""
    a = _numbers(value, np.dtype(np.float64), what)
    if a.size and a.dtype.kind not in "biuf":
        raise ValueError(f"{what}: dtype {a.dtype}, expected real numbers")
    if a.size and (a.ndim != 2 or a.shape[1] != 4):
        raise ValueError(f"{what}: shape {a.shape}, expected N x 4 (x0, y0, x1, y1)")
    return a.reshape(-1, 4).astype(np.float64, copy=False)


def mask_pixels(value: Any, what: str) -> np.ndarray:
    """``value`` as the uint8 ids a mask stores, ValueError (naming ``what``) unless every value is
    one exactly: bool or integer within 0..255, or a float that is one (no NaN, no fraction), so
    that no id is silently wrapped, rounded or lost; checked before a resize drops any pixel."""
    a = _numbers(value, np.dtype(np.uint8), what)
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind not in "biuf":
        raise ValueError(f"{what}: dtype {a.dtype}, expected integer ids 0..255 (uint8)")
    if a.dtype.kind == "f" and a.size and not (np.isfinite(a).all() and (a == np.floor(a)).all()):
        raise ValueError(f"{what}: {a.dtype} values that are not whole numbers (NaN, inf or fractions)")
    if a.min(initial=0) < 0 or a.max(initial=0) > 255:
        raise ValueError(f"{what}: values outside 0..255")
    return a.astype(np.uint8)


#: What every stored box is (docs/FORMAT.md): what a writer refuses otherwise, and a reader reports
#: of a damaged or hostile record.
BOX_RULE = "finite with x0 <= x1 and y0 <= y1"


def bad_box(boxes: np.ndarray) -> Optional[int]:
    """The first of the N x 4 ``boxes`` that is not :data:`BOX_RULE`, or None: two reductions when
    none is (NaN fails every comparison), for a whole batch's boxes at once on the read path."""
    if np.isfinite(boxes).all() and (boxes[:, 2:] >= boxes[:, :2]).all():
        return None
    ok = np.isfinite(boxes).all(axis=1) & (boxes[:, 2:] >= boxes[:, :2]).all(axis=1)
    return int(np.flatnonzero(~ok)[0])


def box_problem(boxes: np.ndarray) -> Optional[str]:
    """Why the N x 4 ``boxes`` are not all :data:`BOX_RULE` (naming the first), or None."""
    k = bad_box(boxes)
    return None if k is None else f"box {k} {boxes[k].tolist()} is not {BOX_RULE}"


class Label(FieldKind):
    """The class id, kept in index.npy's ``label`` column as it always was (not in the record)."""

    name, in_record, dtype, single = "label", False, "<i4", True


class Boxes(FieldKind):
    """N x 4 float32 boxes, (x0, y0, x1, y1) in the stored image's pixels, N >= 0."""

    name, dtype, geometric, single, item = "boxes", "<f4", True, True, 16

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        a = box_array(value, "boxes")
        if a.size == 0:
            return b""
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below
            a = a.astype("<f4")
        why = box_problem(a)
        if why:
            raise ValueError(f"boxes: {why}")
        return a.tobytes()

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> np.ndarray:
        return self.items(payload, "<f4").reshape(-1, 4)


class BoxLabels(FieldKind):
    """One int32 label per box (as many as the boxes field has)."""

    name, dtype, single, item = "box_labels", "<i4", True, 4

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        a = _numbers(value, dtype, "box_labels")
        if a.ndim > 1 or (a.size and a.dtype.kind not in "iub"):
            raise ValueError(f"box_labels: {a.dtype} of shape {a.shape}, expected N integers")
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise ValueError("box_labels: a label outside int32")
        return a.astype("<i4").tobytes()

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> np.ndarray:
        return self.items(payload, "<i4").astype(np.int64)


class Mask(FieldKind):
    """A uint8 H x W map of the stored image's size (a segmentation map: class or instance ids).
    Encoding ``rle`` (what new fields get): ``<u4`` n, n ``<u4`` run lengths, n uint8 run values,
    row-major; n = 0: the ``height * width`` pixels follow as they are (a noisy map, whose runs
    would take more bytes than its pixels). ``raw`` (the first masks' layout): the pixels alone.
    Run lengths, not zlib or PNG: several times their decode speed, for 2-4x their bytes
    (docs/PERFORMANCE.md, "Fields")."""

    #: The encodings' names (the pixels alone, run lengths): named once here, "raw" being a record
    #: format's name too (tests/test_layout.py allows no other comparison with it).
    PIXELS, RUNS = "raw", "rle"
    name, dtype, geometric, encodings = "mask", "|u1", True, (PIXELS, RUNS)

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        a = mask_pixels(value, "mask")
        if a.shape != (height, width):
            raise ValueError(f"mask: shape {a.shape}, the stored image is {height} x {width}")
        flat = np.ascontiguousarray(a).ravel()
        if self.encoding == self.PIXELS:
            return flat.tobytes()
        starts = np.flatnonzero(np.concatenate(([True], flat[1:] != flat[:-1])))
        if 5 * len(starts) >= flat.size:
            return struct.pack("<I", 0) + flat.tobytes()
        lengths = np.diff(np.append(starts, flat.size)).astype("<u4")
        return b"".join((struct.pack("<I", len(starts)), lengths.tobytes(), flat[starts].tobytes()))

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> np.ndarray:
        pixels = height * width
        n = 0 if self.encoding == self.PIXELS else struct.unpack_from("<I", payload)[0] if len(payload) >= 4 else -1
        if n == 0:  # the pixels as they are, after the run count 0 (rle) or alone (raw)
            at = 0 if self.encoding == self.PIXELS else 4
            if len(payload) != at + pixels:
                raise ValueError(f"mask payload of {len(payload)} bytes, the stored image is {height} x {width}")
            return np.frombuffer(payload, np.uint8, pixels, at).reshape(height, width)
        if n < 0:
            raise ValueError(f"mask payload of {len(payload)} bytes is shorter than its run count")
        if len(payload) != 4 + 5 * n:
            raise ValueError(f"mask payload of {len(payload)} bytes does not hold its {n} runs (4 + 5 bytes each)")
        lengths = np.frombuffer(payload, "<u4", n, 4)
        covered = int(lengths.sum(dtype=np.int64))
        if covered != pixels:  # checked before np.repeat allocates what they say
            raise ValueError(f"mask runs cover {covered} pixels, the stored image is {height} x {width}")
        return np.repeat(np.frombuffer(payload, np.uint8, n, 4 + 4 * n), lengths).reshape(height, width)

    def count(self, payload: memoryview) -> int:
        """The mask's pixels."""
        if self.encoding == self.PIXELS:
            return len(payload)
        n = struct.unpack_from("<I", payload)[0]
        return len(payload) - 4 if n == 0 else int(np.frombuffer(payload, "<u4", n, 4).sum(dtype=np.int64))


class Text(FieldKind):
    """UTF-8 text (a caption, a transcript)."""

    name, dtype = "text", "utf-8"

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        if not isinstance(value, str):
            raise ValueError(f"text: a str, not {type(value).__name__}")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text: not encodable as UTF-8 ({e})") from None

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> str:
        try:
            return bytes(payload).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text payload is not UTF-8 ({e})") from None


class Array(FieldKind):
    """Any shape per record of the dtype the field declares: ``u4 ndim``, ``ndim`` x ``u8`` sizes,
    then the elements in C order. A value is stored exactly or refused: no value is wrapped,
    rounded or cut to fit (docs/FIELDS.md)."""

    name = "array"

    def encode(self, value: Any, *, dtype: np.dtype, height: int, width: int) -> bytes:
        a = _numbers(value, dtype, "array")
        if a.ndim > MAX_NDIM:
            raise ValueError(f"array: {a.ndim} dimensions, at most {MAX_NDIM}")
        if a.dtype != dtype and not np.can_cast(a.dtype, dtype, "same_kind"):
            raise ValueError(f"array: dtype {a.dtype} does not convert to the field's {dtype}")
        with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype: inf, refused below
            stored = np.ascontiguousarray(a, dtype)
        if a.size and a.dtype.kind != "b" and not np.can_cast(a.dtype, dtype, "equiv"):
            _exactly(a, stored, dtype)
        head = np.array([a.ndim], "<u4").tobytes() + np.array(a.shape, "<u8").tobytes()
        return head + stored.tobytes()

    def _shape(self, payload: memoryview, dtype: np.dtype) -> tuple[tuple[int, ...], int]:
        if len(payload) < 4:
            raise ValueError("array payload shorter than its header")
        ndim = int(np.frombuffer(payload[:4], "<u4")[0])
        start = 4 + 8 * ndim
        if ndim > MAX_NDIM or len(payload) < start:
            raise ValueError(f"array payload: {ndim} dimensions do not fit in {len(payload)} bytes")
        shape = tuple(int(n) for n in np.frombuffer(payload[4:start], "<u8"))
        items = 1
        for n in shape:  # Python ints: a hostile shape cannot overflow
            items *= n
        if items * dtype.itemsize != len(payload) - start:
            raise ValueError(
                f"array payload: shape {shape} of {dtype} needs {items * dtype.itemsize} bytes, "
                f"has {len(payload) - start}"
            )
        return shape, start

    def decode(self, payload: memoryview, *, dtype: np.dtype, height: int, width: int) -> np.ndarray:
        """The array in native byte order (torch takes no other): a field declared ``>f4`` (as
        packers before 0.x wrote a user's ``>f4``) is converted in the copy every decode makes."""
        shape, start = self._shape(payload, dtype)
        return np.frombuffer(payload[start:], dtype).reshape(shape).astype(dtype.newbyteorder("="))

    def count(self, payload: memoryview) -> int:
        """The elements (the product of the shape the payload's header gives)."""
        ndim = int(np.frombuffer(payload[:4], "<u4")[0])
        return int(np.prod(np.frombuffer(payload[4 : 4 + 8 * ndim], "<u8"), dtype=object))


def _exactly(a: np.ndarray, stored: np.ndarray, dtype: np.dtype) -> None:
    """ValueError unless ``stored`` (``a`` converted to the field's ``dtype``) holds ``a``'s values:
    an integer within the field's range and, in a float, exactly (float32 has 24 bits of mantissa:
    16777217 would be 16777216.0); a float rounded to the field's precision as a cast does
    (float64's 0.1 in float32), never beyond it (1e-50 would be 0.0 in float32, 1e-40 a subnormal
    of a few bits) nor to inf. NaN stays NaN."""
    if dtype.kind in "iu" and a.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:  # would wrap
            raise ValueError(f"array: values outside the field's {dtype} ({info.min}..{info.max})")
        return
    if a.dtype.kind in "fc":  # float to a narrower float: within the field's precision
        with np.errstate(invalid="ignore", over="ignore"):
            same = (stored == a) | (np.isnan(stored) & np.isnan(a))
            same |= np.abs(stored - a) <= np.finfo(dtype).eps * np.abs(a)
        if not same.all():
            k = int(np.flatnonzero(~same.ravel())[0])
            was, now = a.ravel()[k], stored.ravel()[k]
            why = "beyond" if np.isfinite(was) and not np.isfinite(now) else "rounded beyond the precision of"
            raise ValueError(f"array: values {why} the field's {dtype} ({was.item()!r} would become {now.item()!r})")
        return
    # an integer to a float: compared as integers (numpy would compare int64 and float32 in float64,
    # itself inexact), where the float is within the integer type's range (2**63 is not an int64)
    info = np.iinfo(a.dtype)
    real = stored.real if dtype.kind == "c" else stored
    inside = (real >= info.min) & (real < float(info.max) + 1)
    same = inside.copy()
    same[inside] = real[inside].astype(a.dtype) == a[inside]
    if not same.all():
        k = int(np.flatnonzero(~same.ravel())[0])
        was, now = a.ravel()[k].item(), stored.ravel()[k].item()
        raise ValueError(f"array: integers not exactly held by the field's {dtype} ({was!r} would become {now!r})")


#: Every field kind by the name manifests use.
FIELD_KINDS: dict[str, FieldKind] = {k.name: k for k in (Label(), Boxes(), BoxLabels(), Mask(), Text(), Array())}


#: Kinds whose values are class ids that a field may name (``classes``: the name of id i at i).
NAMED_IDS = ("box_labels", "mask")
#: Kinds with a number of items per record that differs from record to record (a batch's are lists,
#: or padded with ``<name>_lengths`` beside them: packer.read.dataset.collate_fields).
RAGGED = ("boxes", "box_labels")


@dataclass(frozen=True)
class Field:
    """One declared field: its ``name`` (the sample dict's key), ``kind`` (in FIELD_KINDS) and dtype;
    ``classes``: for box labels and masks, the name of each id (id i at position i, "" for an id
    without one), empty where the ids are unnamed. ``encoding``: its payloads' layout, for a kind
    that has several (FieldKind.encodings), else ""."""

    name: str
    kind: str
    dtype: str
    classes: tuple[str, ...] = ()
    encoding: str = ""

    @functools.cached_property  # per sample on the read path: made once
    def of(self) -> FieldKind:
        return FIELD_KINDS[self.kind].using(self.encoding)

    @functools.cached_property  # per sample on the read path: made once
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype) if self.kind != "text" else np.dtype(np.uint8)

    def to_json(self) -> dict[str, Any]:
        named: dict[str, Any] = {"classes": list(self.classes)} if self.classes else {}
        if self.encoding and self.encoding != self.of.encodings[0]:  # the first layout: named by no key
            named["encoding"] = self.encoding
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, **named}


def _array_dtype(text: Any) -> bool:
    """Whether ``text`` names a plain numpy dtype in its canonical form (no objects, no records)."""
    if not isinstance(text, str) or len(text) > 8:
        return False
    try:
        dt = np.dtype(text)
    except (TypeError, ValueError, SyntaxError):
        return False
    return dt.str == text and not dt.hasobject and dt.fields is None and dt.kind in "biufcmM" and dt.itemsize > 0


def declare(spec: Any) -> tuple[Field, ...]:
    """The fields ``spec`` declares, checked (ValueError naming the problem): a mapping of name to
    kind (``{"boxes": "boxes", "caption": "text", "emb": ("array", "float32")}``, or to a dict
    ``{"kind", "dtype", "classes", "encoding"}``), or a list of manifest entries (``{"name", "kind",
    "dtype"}`` and for box labels and masks optionally ``classes``, for a mask ``encoding``). Kinds
    with a fixed dtype take theirs. A kind with several encodings gets, when none is named, its
    newest in a mapping (a new dataset's) and its first in a list (a manifest's from before them)."""
    items: list[tuple[Any, Any, Any, Any, Any]] = []
    if isinstance(spec, dict):
        for name, kind in spec.items():
            if isinstance(kind, dict):
                items.append((name, kind.get("kind"), kind.get("dtype"), kind.get("classes", ()), kind.get("encoding")))
                continue
            kind, dtype = kind if isinstance(kind, (tuple, list)) and len(kind) == 2 else (kind, None)
            items.append((name, kind, dtype, (), None))
    elif isinstance(spec, (list, tuple)):
        for entry in spec:
            if isinstance(entry, Field):
                entry = entry.to_json()
            if not isinstance(entry, dict) or not {"name", "kind", "dtype"} <= set(entry) <= {
                "name",
                "kind",
                "dtype",
                "classes",
                "encoding",
            }:
                raise ValueError(f"field entry {entry!r}: expected {{name, kind, dtype}} (and classes, encoding)")
            items.append(
                (entry["name"], entry["kind"], entry["dtype"], entry.get("classes", ()), entry.get("encoding"))
            )
    else:
        raise ValueError(f"fields: a dict of name -> kind or a list of fields, not {type(spec).__name__}")
    given = isinstance(spec, dict)  # a user's declaration, not a manifest's (which must be canonical)
    out: list[Field] = []
    for name, kind, dtype, classes, encoding in items:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"field name {name!r}: letters, digits and _ (at most 64, not a digit first)")
        if name in RESERVED:
            raise ValueError(f"field name {name!r} is reserved (a sample's {', '.join(RESERVED)} are not fields)")
        if not isinstance(kind, str) or kind not in FIELD_KINDS:
            raise ValueError(f"field {name!r}: kind {kind!r} is not one of {', '.join(FIELD_KINDS)}")
        fixed = FIELD_KINDS[kind].dtype
        if fixed is not None:
            if dtype is not None and dtype != fixed:
                raise ValueError(f"field {name!r}: a {kind} field's dtype is {fixed}, not {dtype!r}")
            dtype = fixed
        else:
            if given and dtype is not None:  # a user's "float32", np.float32 or ">f4": its canonical '<f4'
                with contextlib.suppress(TypeError, ValueError, SyntaxError):
                    dtype = np.dtype(dtype).newbyteorder("<").str  # stored little-endian, as every payload
            if not _array_dtype(dtype):
                raise ValueError(f"field {name!r}: dtype {dtype!r} is not a plain numpy dtype (like '<f4')")
        if classes and (
            kind not in NAMED_IDS
            or not isinstance(classes, (list, tuple))
            or not all(isinstance(c, str) for c in classes)
        ):
            raise ValueError(f"field {name!r}: classes (a list of names) are for {' and '.join(NAMED_IDS)} fields")
        encodings = FIELD_KINDS[kind].encodings
        if encoding is None:
            encoding = (encodings[-1] if given else encodings[0]) if encodings else ""
        elif encoding not in encodings or (not given and encoding == encodings[0]):
            named = f"one of {', '.join(encodings)}" if encodings else "none (it has one layout)"
            raise ValueError(f"field {name!r}: encoding {encoding!r}; a {kind} field's encodings: {named}")
        out.append(Field(name, kind, dtype, tuple(classes), encoding))
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"fields: a name twice ({names})")
    for kind in (k for k in FIELD_KINDS.values() if k.single):
        if sum(f.kind == kind.name for f in out) > 1:
            raise ValueError(f"fields: at most one {kind.name} field")
    if any((f.kind == "label") != (f.name == "label") for f in out):
        raise ValueError("fields: the label field is named 'label', and only it")
    lengths = {f"{f.name}_lengths" for f in out if f.kind in RAGGED} & set(names)
    if lengths:  # collate_fields(padded=True) gives each ragged field's counts that name
        raise ValueError(f"field name {lengths.pop()!r} is reserved (the counts of a padded batch's boxes)")
    if any(f.kind == "box_labels" for f in out) and not any(f.kind == "boxes" for f in out):
        raise ValueError("fields: box_labels need a boxes field")
    return tuple(out)


def record_fields(fields: Sequence[Field]) -> tuple[Field, ...]:
    """The fields whose payloads a record holds, in record order (the manifest's)."""
    return tuple(f for f in fields if f.of.in_record)


def join_record(image: bytes, payloads: Sequence[bytes]) -> bytes:
    """A record: the lengths of the image and each payload (``<u8`` each), then the image, then the
    payloads; the image alone where there are no payloads (no record fields: a label only, or none)."""
    if not payloads:
        return image
    head = np.array([len(image), *map(len, payloads)], "<u8").tobytes()
    return b"".join((head, image, *payloads))


def split_record(data: memoryview, fields: int) -> tuple[memoryview, list[memoryview]]:
    """A record's image bytes and its ``fields`` payloads (views of ``data``); ValueError when the
    length table does not add up to the record (checked before anything is sliced or allocated)."""
    head = 8 * (fields + 1)
    if len(data) < head:
        raise ValueError(f"record of {len(data)} bytes is shorter than its {head}-byte field table")
    lengths = struct.unpack_from(f"<{fields + 1}Q", data)  # a tenth of numpy's cost for a few numbers
    if sum(lengths) != len(data) - head:  # Python ints: no overflow
        raise ValueError(f"field table says {sum(lengths)} bytes after it, the record has {len(data) - head}")
    parts, at = [], head
    for n in lengths:
        parts.append(data[at : at + n])
        at += n
    return parts[0], parts[1:]


def encode_fields(fields: Sequence[Field], values: dict[str, Any], *, height: int, width: int) -> list[bytes]:
    """The payloads of ``values`` for the record fields, in order. Boxes, box labels and text left
    out are empty; a mask or array left out is an error. ValueError naming the field (a sample's
    reported skip: packer.builder.writer)."""
    out = []
    boxes = None
    for f in record_fields(fields):
        value = values.get(f.name)
        if value is None:
            if f.kind in ("mask", "array"):
                raise ValueError(f"{f.name}: missing (a {f.kind} field needs a value in every sample)")
            value = "" if f.kind == "text" else np.zeros((0, 4) if f.kind == "boxes" else 0)
        try:
            payload = f.of.encode(value, dtype=f.numpy_dtype, height=height, width=width)
        except ValueError as e:  # named by the field (the kind's message names its kind)
            raise ValueError(f"field {f.name!r}: {e}") from None
        if f.kind == "boxes":
            boxes = len(payload) // 16
        out.append(payload)
    labels = next((len(p) // 4 for f, p in zip(record_fields(fields), out) if f.kind == "box_labels"), None)
    if labels is not None and labels != boxes:
        raise ValueError(f"box_labels: {labels} labels for {boxes} boxes")
    return out


def decode_fields(
    fields: Sequence[Field], payloads: Sequence[memoryview], *, height: int, width: int
) -> dict[str, Any]:
    """The values of a record's payloads (one per record field, in order) by field name; ValueError
    for a payload of the wrong shape, boxes and box labels of different counts included."""
    values, counts = {}, {}
    for f, p in zip(record_fields(fields), payloads):
        values[f.name] = v = f.of.decode(p, dtype=f.numpy_dtype, height=height, width=width)
        if f.kind in ("boxes", "box_labels"):
            counts[f.kind] = len(v)
    if counts.get("boxes", 0) != counts.get("box_labels", counts.get("boxes", 0)):
        raise ValueError(f"{counts['box_labels']} box labels for {counts['boxes']} boxes")
    return values


def record_problem(
    fields: Sequence[Field],
    data: memoryview,
    *,
    height: int,
    width: int,
    image_problem: Callable[[memoryview], Optional[str]],
) -> Optional[str]:
    """Why a record is not one of ``height`` x ``width`` with the fields ``fields`` declare, or None:
    its field table, its image (``image_problem``: checked before any payload is decoded, since a
    mask's runs can say as many pixels as a hostile index row), each payload's shape, boxes and box
    labels of one count, every box :data:`BOX_RULE`."""
    try:
        image, payloads = split_record(data, len(record_fields(fields)))
    except ValueError as e:
        return str(e)
    why = image_problem(image)
    if why:
        return why
    try:
        values = decode_fields(fields, payloads, height=height, width=width)
    except ValueError as e:
        return str(e)
    boxes = next((f.name for f in fields if f.kind == "boxes"), None)
    why = box_problem(values[boxes]) if boxes is not None else None
    return f"{boxes}: {why}" if why else None


def nearest(
    mask: np.ndarray, region: tuple[float, float, float, float], size: tuple[int, int], flip: bool = False
) -> np.ndarray:
    """``mask`` (H x W) over ``region`` (top, left, height, width in its pixels, fractions allowed)
    sampled nearest-neighbour at ``size`` (out_h, out_w), mirrored when ``flip``: output pixel
    (y, x) takes the mask pixel under its centre, as the image's resize maps it."""
    top, left, height, width = region
    out_h, out_w = size
    rows = np.floor(top + (np.arange(out_h) + 0.5) * (height / out_h)).astype(np.intp)
    cols = np.floor(left + (np.arange(out_w) + 0.5) * (width / out_w)).astype(np.intp)
    np.minimum(np.maximum(rows, 0, out=rows), mask.shape[0] - 1, out=rows)
    np.minimum(np.maximum(cols, 0, out=cols), mask.shape[1] - 1, out=cols)
    return mask[rows][:, cols[::-1] if flip else cols]  # rows, then columns: ~6x one 2-D fancy index
