"""The field kinds on hostile bytes: every damaged table or payload is a ValueError (which readers turn
into a DatasetError naming the record), never another exception or an allocation its lengths ask for."""

from __future__ import annotations

import numpy as np
import pytest

from packer.format.fields import FIELD_KINDS, declare, decode_fields, join_record, split_record

FIELDS = declare({"boxes": "boxes", "box_labels": "box_labels", "mask": "mask", "t": "text", "a": ("array", "<f8")})


def test_a_record_round_trips() -> None:
    boxes = np.array([[1, 2, 3, 4]], np.float32)
    payloads = [
        boxes.tobytes(),
        np.array([5], "<i4").tobytes(),
        bytes(range(6)),
        "h\u00e9".encode(),
        FIELD_KINDS["array"].encode(np.ones((2, 0, 3)), dtype=np.dtype("<f8"), height=2, width=3),
    ]
    image, parts = split_record(memoryview(join_record(b"IMG", payloads)), 5)
    assert bytes(image) == b"IMG"
    values = decode_fields(FIELDS, parts, height=2, width=3)
    assert values["boxes"].tolist() == boxes.tolist() and values["box_labels"].tolist() == [5]
    assert values["mask"].shape == (2, 3) and values["t"] == "h\u00e9" and values["a"].shape == (2, 0, 3)


def test_random_bytes_fail_as_value_errors_only() -> None:
    rng = np.random.default_rng(0)
    decoded = refused = 0
    for _ in range(3000):
        n = int(rng.integers(0, 120))
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if rng.random() < 0.5 and n >= 48:  # a plausible table: small lengths that may add up
            lengths = rng.integers(0, 20, 6).astype("<u8")
            lengths[-1] = max(0, n - 48 - int(lengths[:-1].sum()))
            data = lengths.tobytes() + data[48:]
        try:
            _, parts = split_record(memoryview(data), 5)
            decode_fields(FIELDS, parts, height=2, width=3)
            decoded += 1
        except ValueError:  # any other exception fails the test
            refused += 1
    assert refused > 1000 and decoded + refused == 3000


@pytest.mark.parametrize(
    "payload, why",
    [
        (np.array([32], "<u4").tobytes() + np.full(32, 2**60, "<u8").tobytes(), "needs"),  # 2**1920 elements
        (np.array([10**6], "<u4").tobytes(), "do not fit"),
        (b"\x01\x00", "shorter than its header"),
    ],
)
def test_a_hostile_array_header_allocates_nothing(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        FIELD_KINDS["array"].decode(memoryview(payload), dtype=np.dtype("<f8"), height=1, width=1)


def test_a_table_that_does_not_add_up() -> None:
    data = np.array([2**64 - 1, 1], "<u8").tobytes() + b"x"
    with pytest.raises(ValueError, match="field table says"):
        split_record(memoryview(data), 1)
    with pytest.raises(ValueError, match="shorter than its 24-byte field table"):
        split_record(memoryview(b"\x00" * 10), 2)


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"name": "a", "kind": "array", "dtype": "O"}, "not a plain numpy dtype"),
        ({"name": "a", "kind": "array", "dtype": "|O"}, "not a plain numpy dtype"),
        ({"name": "a", "kind": "array", "dtype": "[('x', '<f4')]"}, "not a plain numpy dtype"),
        ({"name": "a", "kind": "array", "dtype": "float32"}, "not a plain numpy dtype"),  # not canonical '<f4'
        ({"name": "image", "kind": "text", "dtype": "utf-8"}, "not 'image' or 'id'"),
        ({"name": "x y", "kind": "text", "dtype": "utf-8"}, "letters, digits and _"),
        ({"name": "b", "kind": "boxes", "dtype": "<f8"}, "a boxes field's dtype is <f4"),
        ({"name": "b", "kind": "boxes", "dtype": "<f4", "classes": ["a"]}, "classes .* are for"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "classes": [1]}, "classes .* are for"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "extra": 1}, "expected {name, kind, dtype}"),
    ],
)
def test_manifest_entries_are_checked(entry: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        declare([entry])


def test_a_users_dtype_is_made_canonical() -> None:
    """In code a dtype is any numpy spelling; the manifest holds its canonical string (checked as such)."""
    assert [f.dtype for f in declare({"a": ("array", "float32"), "b": ("array", np.int16)})] == ["<f4", "<i2"]
    with pytest.raises(ValueError, match="not a plain numpy dtype"):
        declare({"a": ("array", "O")})
