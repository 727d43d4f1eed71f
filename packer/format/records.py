"""The record formats, chosen by name from one table (:data:`FORMATS`): how each one's records are
encoded from pixels, decoded back, and checked, side by side (as FFCV's Field keeps a field's encode
beside its decode). A manifest's ``format`` and ``--format`` name one; other modules look the format
up here, none compares its name.
"""

from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from .. import codec

#: JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic); they carry the size.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class RecordFormat:
    """One record format. ``compressed``: records are decoded to pixels (at a DCT scale, a crop's
    band where the codec can) rather than being the H x W x 3 pixels themselves, viewed in place.
    ``lossy``: ``quality`` shapes the records. ``max_edge``: the longest edge a record can hold (raw:
    none, its length bounds it). ``length_rule``: what a record's length must be, where it follows
    from the size.
    ``crc_on_read``: ShardDataset's ``verify`` default, on where a CRC-32 costs little beside the
    decode. ``decode_advice``/``cold_advice``: what ``packer bench`` suggests when decoding dominates
    a read, or when the dataset is bigger than the page cache."""

    name = ""
    compressed = False
    lossy = False
    max_edge = int(np.iinfo(np.uint32).max)
    crc_on_read = False
    length_rule = ""
    decode_advice: tuple[str, ...] = ()
    cold_advice: tuple[str, ...] = ()

    def encode(self, rgb: np.ndarray, *, quality: int) -> bytes:
        """The record of the H x W x 3 uint8 image ``rgb``."""
        raise NotImplementedError

    def decode(
        self, data: bytes | memoryview, *, height: int, width: int, out: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """The whole stored image of a record of ``height`` x ``width`` as H x W x 3 uint8 (``out``,
        when it has that shape, or a view of ``data`` where no decode is needed); ValueError when
        the record is not one of that size."""
        raise NotImplementedError

    def wrong_lengths(self, index: np.ndarray, table: int = 0) -> np.ndarray:
        """Which index rows have a length no record of their height and width can have (:attr:`length_rule`).
        ``table``: the bytes of a record's field table (docs/FORMAT.md, "Fields"); then the image is
        followed by the fields' payloads, and a record must be at least the table and its image."""
        return index["length"] < table

    def problem(self, data: bytes | memoryview, *, height: int, width: int) -> Optional[str]:
        """Why the bytes of a record with the right length and CRC-32 are still not one of ``height``
        x ``width`` (``packer verify``'s check without a decode), or None."""
        return None


class Jpeg(RecordFormat):
    """Re-encoded JPEG (4:2:0, ``quality``)."""

    name, compressed, lossy, crc_on_read = "jpeg", True, True, True
    max_edge = 65_535  # the largest edge a JPEG can have
    decode_advice = (
        (
            "JPEG decoding dominates: it scales with workers; `packer build --format raw` skips it "
            '(~14x the bytes on disk: docs/PERFORMANCE.md, "Cold reads")'
        ),
    )

    def encode(self, rgb: np.ndarray, *, quality: int) -> bytes:
        return codec.encode_jpeg(rgb, quality)

    def decode(
        self, data: bytes | memoryview, *, height: int, width: int, out: Optional[np.ndarray] = None
    ) -> np.ndarray:
        return codec.decode_jpeg(data, width=width, height=height, out=out)

    def problem(self, data: bytes | memoryview, *, height: int, width: int) -> Optional[str]:
        size = jpeg_size(data)
        if size != (height, width):
            return f"JPEG frame size {size} differs from the index's {(height, width)}"
        return None


class Raw(RecordFormat):
    """Decoded uint8 H x W x 3 pixels: bigger, nothing to decode at read."""

    name, length_rule = "raw", "height x width x 3"
    cold_advice = ("JPEG records are ~14x smaller than raw ones (`--format jpeg`)",)

    def encode(self, rgb: np.ndarray, *, quality: int) -> bytes:
        return rgb.tobytes()

    def decode(
        self, data: bytes | memoryview, *, height: int, width: int, out: Optional[np.ndarray] = None
    ) -> np.ndarray:
        return np.frombuffer(data, np.uint8).reshape(height, width, 3)

    def wrong_lengths(self, index: np.ndarray, table: int = 0) -> np.ndarray:
        image = index["height"].astype(np.uint64) * index["width"] * 3
        return image != index["length"] if not table else image + np.uint64(table) > index["length"]


def jpeg_size(data: bytes | memoryview) -> Optional[tuple[int, int]]:
    """(height, width) from the JPEG frame header, or None when ``data`` is not a JPEG we can parse."""
    if bytes(data[:2]) != b"\xff\xd8":
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        (seg,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF and pos + 9 <= end:
            return struct.unpack(">HH", data[pos + 5 : pos + 9])
        if marker == 0xDA or seg < 2:  # start of scan: no frame header came first
            return None
        pos += 2 + seg
    return None


#: Every record format by the name manifests and ``--format`` use.
FORMATS: dict[str, RecordFormat] = {f.name: f for f in (Jpeg(), Raw())}
