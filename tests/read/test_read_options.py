"""ReadOptions: ShardDataset's settings, each with its default, docs row and check written once."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from packer.read.dataset import ShardDataset
from packer.read.options import ReadOptions
from packer.transform import Augment

DOCS = Path(__file__).resolve().parents[2] / "docs" / "DATASET.md"
FIELDS = dataclasses.fields(ReadOptions)


def test_shard_dataset_takes_the_fields_in_their_order_with_their_defaults() -> None:
    """Positional order as it always was; settings added since (``keyword``) are keyword-only."""
    params = list(inspect.signature(ShardDataset.__init__).parameters.values())[2:]  # after self, path
    kinds = {False: inspect.Parameter.POSITIONAL_OR_KEYWORD, True: inspect.Parameter.KEYWORD_ONLY}
    assert [(p.name, p.kind) for p in params] == [(f.name, kinds[f.metadata.get("keyword", False)]) for f in FIELDS]
    assert [p.name for p in params][:14] == [
        "crop_size", "train", "seed", "dtype", "mean", "std", "scale", "ratio",
        "eval_ratio", "flip", "verify", "memory_format", "transform", "batch_transform",
    ]  # fmt: skip
    for p, f in zip(params, FIELDS):
        assert p.default == f.default, f.name


def test_docs_table_is_the_fields() -> None:
    """docs/DATASET.md's table of ShardDataset's arguments: one row per field, in order, its text the field's."""
    text = DOCS.read_text()
    table = text[text.index("| argument | default | meaning |") :].split("\n\n", 1)[0].splitlines()[2:]
    expected = [
        f"| `{f.name}`{' (keyword)' if f.metadata.get('keyword') else ''} | "
        f"{f.metadata.get('shown', str(f.default))} | {f.metadata['doc']} |"
        for f in FIELDS
    ]
    assert table == expected


@pytest.mark.parametrize(
    "change,message",
    [
        ({"crop_size": 0}, "crop_size must be positive, None or a schedule (a function of the epoch), not 0"),
        ({"dtype": torch.int32}, "dtype must be torch.uint8 or a floating type, not torch.int32"),
        ({"scale": (0, 0)}, "scale must be (low, high) with 0 < low <= high, not (0, 0)"),
        ({"scale": (0.5, 0.2)}, "scale must be (low, high) with 0 < low <= high, not (0.5, 0.2)"),
        ({"ratio": (2, 1)}, "ratio must be (low, high) with 0 < low <= high < inf, not (2, 1)"),
        ({"ratio": (1, float("inf"))}, "ratio must be (low, high) with 0 < low <= high < inf, not (1, inf)"),
        ({"eval_ratio": 0}, "eval_ratio must be in (0, 1] (crop size / resized short edge), not 0"),
        ({"eval_ratio": 1.5}, "eval_ratio must be in (0, 1] (crop size / resized short edge), not 1.5"),
        (
            {"memory_format": torch.preserve_format},
            "memory_format must be torch.channels_last or torch.contiguous_format, not torch.preserve_format",
        ),
        ({"transform": 3}, "transform must be a callable or None, not 3"),
        ({"batch_transform": "flip"}, "batch_transform must be a callable or None, not 'flip'"),
        ({"cache_limit": 0}, "cache_limit must be positive, not 0"),
        ({"cache_limit": "lots"}, "cache_limit must be bytes or a size like '200GB' or '1.5GiB', not 'lots'"),
        (
            {"crop_size": None, "batch_transform": lambda x, y: (x, y)},
            "batch_transform needs images of one size: a crop_size or a transform",
        ),
    ],
)
def test_each_bad_value_is_one_line_before_anything_opens(change: dict[str, Any], message: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ReadOptions(**change)
    # from ShardDataset too, before the path is looked at (it does not exist: that would be a DatasetError)
    with pytest.raises(ValueError, match=re.escape(message)):
        ShardDataset(tmp_path / "absent", **change)


def test_every_argument_reaches_the_options_and_the_plain_attributes(built) -> None:
    def aug(image: torch.Tensor) -> torch.Tensor:
        return image

    asked: dict[str, Any] = {
        "crop_size": 16,
        "train": False,
        "seed": 5,
        "dtype": torch.float16,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "scale": [0.2, 0.9],
        "ratio": (0.5, 2.0),
        "eval_ratio": 0.5,
        "flip": False,
        "verify": True,
        "memory_format": torch.contiguous_format,
        "transform": aug,
        "batch_transform": None,
    }
    assert all(asked[f.name] != f.default for f in FIELDS if f.name in asked and f.name != "batch_transform")
    ds = ShardDataset(built("memmap", "raw"), *asked.values(), cache_limit="1GB")
    assert ds.options == ReadOptions(**asked, cache_limit="1GB")
    assert ds.options.mean == (0.5, 0.5, 0.5) and ds.options.scale == (0.2, 0.9)  # sequences kept as tuples
    assert ds.augment == Augment(16, False, (0.2, 0.9), (0.5, 2.0), 0.5, False) == ds.options.augment()
    assert (ds.seed, ds.dtype, ds.mean, ds.std) == (5, torch.float16, (0.5,) * 3, (0.25,) * 3)
    assert (ds.memory_format, ds.transform, ds.verify) == (torch.contiguous_format, aug, True)
    assert ShardDataset(ds.root, crop_size=None).augment is None
    assert ShardDataset(ds.root).verify is False  # raw records: CRC off unless asked (the format's default)
