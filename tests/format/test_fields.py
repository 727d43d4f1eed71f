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
        FIELDS[2].of.encode(np.arange(6).reshape(2, 3), dtype=np.dtype("|u1"), height=2, width=3),
        "h\u00e9".encode(),
        FIELD_KINDS["array"].encode(np.ones((2, 0, 3)), dtype=np.dtype("<f8"), height=2, width=3),
    ]
    image, parts = split_record(memoryview(join_record(b"IMG", payloads)), 5)
    assert bytes(image) == b"IMG"
    values = decode_fields(FIELDS, parts, height=2, width=3)
    assert values["boxes"].tolist() == boxes.tolist() and values["box_labels"].tolist() == [5]
    assert (
        values["mask"].tolist() == [[0, 1, 2], [3, 4, 5]]
        and values["t"] == "h\u00e9"
        and values["a"].shape == (2, 0, 3)
    )


def _segmentation(h: int, w: int) -> np.ndarray:
    mask = np.zeros((h, w), np.uint8)
    mask[10:40, 5:60], mask[30:70, 50:90] = 3, 7
    return mask


def test_masks_are_run_length_encoded() -> None:
    """A new mask field stores runs (4 + 5 bytes each, far fewer than the pixels), declared as such
    in the manifest; a noisy mask, whose runs would outweigh its pixels, its pixels after a 0."""
    mask = FIELDS[2]
    assert (mask.encoding, mask.to_json()["encoding"]) == ("rle", "rle")
    seg = _segmentation(80, 100)
    payload = mask.of.encode(seg, dtype=np.dtype("|u1"), height=80, width=100)
    runs = int(np.frombuffer(payload[:4], "<u4")[0])
    assert len(payload) == 4 + 5 * runs < 1000 < seg.size
    decoded = mask.of.decode(memoryview(payload), dtype=np.dtype("|u1"), height=80, width=100)
    assert np.array_equal(decoded, seg) and mask.of.count(memoryview(payload)) == seg.size
    noise = np.random.default_rng(0).integers(0, 4, (80, 100), dtype=np.uint8)
    payload = mask.of.encode(noise, dtype=np.dtype("|u1"), height=80, width=100)
    assert payload[:4] == b"\0\0\0\0" and len(payload) == 4 + noise.size
    assert np.array_equal(mask.of.decode(memoryview(payload), dtype=np.dtype("|u1"), height=80, width=100), noise)
    assert mask.of.count(memoryview(payload)) == noise.size


def test_masks_of_the_first_layout_keep_reading() -> None:
    """A manifest entry naming no encoding is a mask of the first datasets with fields: raw pixels."""
    old = declare([{"name": "mask", "kind": "mask", "dtype": "|u1"}])[0]
    assert old.encoding == "raw" and "encoding" not in old.to_json()
    seg = _segmentation(80, 100)
    decoded = old.of.decode(memoryview(seg.tobytes()), dtype=np.dtype("|u1"), height=80, width=100)
    assert np.array_equal(decoded, seg) and old.of.count(memoryview(seg.tobytes())) == seg.size
    assert old.of.encode(seg, dtype=np.dtype("|u1"), height=80, width=100) == seg.tobytes()
    assert declare({"m": {"kind": "mask", "encoding": "raw"}})[0].encoding == "raw"
    with pytest.raises(ValueError, match="mask payload of 7999 bytes"):
        old.of.decode(memoryview(seg.tobytes()[1:]), dtype=np.dtype("|u1"), height=80, width=100)


@pytest.mark.parametrize(
    "payload, why",
    [
        (b"\x01\x00", "shorter than its run count"),
        (np.array([2, 3], "<u4").tobytes() + b"\x01\x02", "does not hold its 2 runs"),
        (np.array([2**31], "<u4").tobytes(), "does not hold its 2147483648 runs"),
        (np.array([2, 2**32 - 1, 2**32 - 1], "<u4").tobytes() + b"\x01\x02", "runs cover 8589934590 pixels"),
        (np.array([1, 5], "<u4").tobytes() + b"\x01", "runs cover 5 pixels"),
        (np.array([0], "<u4").tobytes() + b"\x01" * 5, "mask payload of 9 bytes"),
    ],
)
def test_hostile_mask_runs_allocate_nothing(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        FIELDS[2].of.decode(memoryview(payload), dtype=np.dtype("|u1"), height=2, width=3)


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
        ({"name": "image", "kind": "text", "dtype": "utf-8"}, "field name 'image' is reserved"),
        ({"name": "id", "kind": "text", "dtype": "utf-8"}, "field name 'id' is reserved"),
        ({"name": "skip", "kind": "text", "dtype": "utf-8"}, "field name 'skip' is reserved"),  # a sample's skip
        ({"name": "source", "kind": "text", "dtype": "utf-8"}, "field name 'source' is reserved"),
        ({"name": "label", "kind": "text", "dtype": "utf-8"}, "the label field is named 'label', and only it"),
        ({"name": "x y", "kind": "text", "dtype": "utf-8"}, "letters, digits and _"),
        ({"name": "b", "kind": "boxes", "dtype": "<f8"}, "a boxes field's dtype is <f4"),
        ({"name": "b", "kind": "boxes", "dtype": "<f4", "classes": ["a"]}, "classes .* are for"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "classes": [1]}, "classes .* are for"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "extra": 1}, "expected {name, kind, dtype}"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "encoding": "png"}, "encodings: one of raw, rle"),
        ({"name": "m", "kind": "mask", "dtype": "|u1", "encoding": "raw"}, "encoding 'raw'"),  # named by none
        ({"name": "t", "kind": "text", "dtype": "utf-8", "encoding": "rle"}, "none .it has one layout"),
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


@pytest.mark.parametrize(
    ("kind", "value", "dtype", "why"),
    [
        ("mask", np.array([[0, 1.5, 2]]), "|u1", "not whole numbers"),
        ("mask", np.array([[0, np.nan, 2]]), "|u1", "not whole numbers"),
        ("mask", np.array([[0, np.inf, 2]]), "|u1", "not whole numbers"),
        ("mask", np.array([[0, 256.0, 2]]), "|u1", "outside 0..255"),
        ("mask", np.array([[0, -1, 2]], np.int16), "|u1", "outside 0..255"),
        ("mask", np.array([[0, 1j, 2]]), "|u1", "expected integer ids"),
        ("mask", np.array([["0", "1", "2"]]), "|u1", "expected integer ids"),
        ("boxes", np.array([[0, 0, 1j, 1]]), "<f4", "expected real numbers"),
        ("boxes", [["0", "0", "1", "1"]], "<f4", "expected real numbers"),
        ("boxes", [[0, 0, 1e39, 1]], "<f4", "finite"),  # inf once float32
        ("boxes", [[0, 0, -np.inf, 1]], "<f4", "finite"),
        ("boxes", [[0, 0, 1, 1, 1]], "<f4", "expected N x 4"),
        ("array", np.array([300]), "|i1", "outside the field's int8"),
        ("array", np.array([2**40]), "<i4", "outside the field's int32"),
        ("array", np.array([1e300]), "<f4", "would become inf"),
        ("array", np.array([-1]), "|u1", "does not convert"),
        # issue 40 item 6: rounded without a word before
        ("array", np.array([16777217]), "<f4", r"not exactly held by the field's float32 \(16777217 would become 1677"),
        ("array", np.array([2**53 + 1]), "<f8", "not exactly held by the field's float64"),  # numpy calls it safe
        ("array", np.array([2**63 - 1]), "<f8", "not exactly held"),  # 2**63 as a float: no int64
        ("array", np.array([2**64 - 1], np.uint64), "<f8", "not exactly held"),
        ("array", np.array([16777217]), "<c8", "not exactly held by the field's complex64"),
        (
            "array",
            np.array([1.0, 1e-50]),
            "<f4",
            r"beyond the precision of the field's float32 \(1e-50 would become 0.0",
        ),
        ("array", np.array([1e-40]), "<f4", "beyond the precision"),  # a subnormal of a few bits
        ("array", np.array([1e-300]), "<f2", "beyond the precision"),
    ],
)
def test_values_that_would_change_when_stored_are_refused(kind: str, value, dtype: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        FIELD_KINDS[kind].encode(value, dtype=np.dtype(dtype), height=1, width=3)


def test_values_stored_exactly_are_taken() -> None:
    """A float or bool mask of whole ids, an in-range int64 array, NaN in a float array: kept as they are."""
    mask = FIELD_KINDS["mask"].using("raw")
    assert mask.encode(np.array([[0.0, 7.0, 255.0]]), dtype=np.dtype("|u1"), height=1, width=3) == bytes([0, 7, 255])
    assert mask.encode(np.array([[True, False, True]]), dtype=np.dtype("|u1"), height=1, width=3) == bytes([1, 0, 1])
    small = FIELD_KINDS["array"].encode(np.array([-128, 127]), dtype=np.dtype("|i1"), height=1, width=3)
    assert small[-2:] == np.array([-128, 127], "|i1").tobytes()
    nan = FIELD_KINDS["array"].encode(np.array([np.nan, 1e30]), dtype=np.dtype("<f4"), height=1, width=3)
    assert np.isnan(np.frombuffer(nan[-8:], "<f4")[0]) and np.frombuffer(nan[-8:], "<f4")[1] == np.float32(1e30)
    # a float to the field's precision, as a cast does; integers a float holds exactly; inf stays inf
    values = np.array([0.1, -np.inf, 16777216, 2**-126, 0.0, -0.0])
    stored = FIELD_KINDS["array"].encode(values, dtype=np.dtype("<f4"), height=1, width=3)
    np.testing.assert_array_equal(np.frombuffer(stored[-24:], "<f4"), values.astype(np.float32))
    ints = np.array([-(2**24), 2**24, 2**40], np.int64)  # 2**40: a power of two, one bit of mantissa
    stored = FIELD_KINDS["array"].encode(ints, dtype=np.dtype("<f4"), height=1, width=3)
    assert np.frombuffer(stored[-12:], "<f4").astype(np.int64).tolist() == ints.tolist()


def test_reserved_and_colliding_names_are_refused_where_fields_are_declared() -> None:
    """Issue 40 item 16: a sample's own keys are not field names (a ``skip`` text field turned its
    samples into skips), nor is the name padded batches give a ragged field's counts."""
    for name in ("skip", "source", "image", "id"):
        with pytest.raises(ValueError, match=f"field name '{name}' is reserved"):
            declare({name: "text"})
    with pytest.raises(ValueError, match="'boxes_lengths' is reserved"):
        declare({"boxes": "boxes", "boxes_lengths": ("array", "<i8")})
    assert [f.name for f in declare({"lengths": "text", "skipped": "text"})] == ["lengths", "skipped"]


def test_a_big_endian_dtype_is_declared_little_endian_and_read_natively() -> None:
    """Issue 40 item 14: a user's ``>f4`` is stored ``<f4`` (docs/FORMAT.md: payloads are little-endian);
    a field a manifest declares ``>f4`` (as packer wrote a user's before) decodes to native order."""
    (emb,) = declare({"emb": ("array", ">f4")})
    assert emb.dtype == "<f4"
    payload = emb.of.encode(np.array([1.5, -2.0], ">f4"), dtype=emb.numpy_dtype, height=1, width=1)
    assert np.frombuffer(payload[-8:], "<f4").tolist() == [1.5, -2.0]
    (old,) = declare([{"name": "emb", "kind": "array", "dtype": ">f4"}])
    value = old.of.decode(
        memoryview(FIELD_KINDS["array"].encode(np.array([1.5, 3.0]), dtype=np.dtype(">f4"), height=1, width=1)),
        dtype=old.numpy_dtype,
        height=1,
        width=1,
    )
    assert value.dtype.isnative and value.tolist() == [1.5, 3.0]
