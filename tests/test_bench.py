"""`packer bench` end to end on a dataset built from the real photos, and the batched fetch it measures."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

from packer.cli import main
from packer.read.dataset import ShardDataset


@pytest.mark.parametrize("fmt,dtype", [("jpeg", "float32"), ("raw", "uint8")])
def test_bench_json(built, fmt: str, dtype: str) -> None:
    path = built("lmdb", fmt)
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(path),
            "--workers",
            "0,1",
            "--json",
            "--batch-size",
            "4",
            "--crop-size",
            "64",
            "--epochs",
            "2",
            "--dtype",
            dtype,
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    for key in (
        "throughput",
        "knee",
        "profile",
        "recommendation",
        "fits_in_page_cache",
        "dataset_bytes",
        "mem_available",
        "cold_read",
        "cores",
    ):
        assert key in report
    assert [p["workers"] for p in report["throughput"]] == [0, 1]
    assert all(p["samples_per_s"] > 0 and p["samples"] == 36 for p in report["throughput"])
    assert report["knee"]["workers"] in (0, 1) and report["knee"]["samples_per_s"] > 0
    stages = {s["stage"]: s for s in report["profile"]["stages"]}
    assert {"read", "decode", "resize", "write to batch", "collate"} <= set(stages)
    assert ("to float" in stages) == (dtype == "float32")
    assert all(s["us_per_sample"] > 0 for s in stages.values())
    assert sum(s["percent"] for s in stages.values()) == pytest.approx(100, abs=0.5)
    assert report["fits_in_page_cache"] is True
    assert report["recommendation"]["dataloader"]["num_workers"] == report["knee"]["workers"]


def test_bench_text_and_plot_without_matplotlib(built, monkeypatch) -> None:
    path = built("memmap", "jpeg")
    result = CliRunner().invoke(
        main, ["bench", str(path), "--workers", "0", "--batch-size", "6", "--crop-size", "48", "--eval"]
    )
    assert result.exit_code == 0, result.output
    assert "throughput stops growing at 0 workers" in result.output
    assert "drop_caches" in result.output and "page cache" in result.output
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(main, ["bench", str(path), "--plot", "curve.png"])
    assert result.exit_code == 1 and "needs matplotlib" in result.output
    bad = CliRunner().invoke(main, ["bench", str(path), "--workers", "a,b"])
    assert bad.exit_code == 2


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_batched_fetch_matches_single_samples(built, dtype: torch.dtype) -> None:
    """__getitems__ fills one preallocated batch (shared memory in workers) that collate hands on as is."""
    ds = ShardDataset(built("memmap", "raw"), crop_size=32, seed=5, dtype=dtype)
    single = torch.stack([ds[i][0] for i in range(len(ds))])
    for workers in (0, 2):
        images = torch.cat([b[0] for b in DataLoader(ds, batch_size=5, num_workers=workers)])
        assert images.dtype == dtype and torch.equal(images, single)
    samples = ds.__getitems__([3, 1, 3])
    assert [s.label for s in samples] == [int(ds.labels[i]) for i in (3, 1, 3)]
    assert samples[0].image._base is samples[2].image._base  # slots of one batch tensor
    # A custom collate_fn still receives (image, label) pairs.
    pairs = next(iter(DataLoader(ds, batch_size=3, collate_fn=lambda b: b)))
    image, label = pairs[0]
    assert image.shape == (3, 32, 32) and isinstance(label, int)


def test_advice_names_the_faster_resize(monkeypatch) -> None:
    """When the resize dominates, the advice depends on what this install resizes with and could use."""
    from packer.tools import bench
    from packer.transform import resize

    points = [bench.Point(0, 100, 1.0, 100.0, 10.0)]
    stages = [{"stage": "decode", "percent": 30.0}, {"stage": "resize", "percent": 60.0}]

    def notes(resize: str) -> str:
        return " ".join(bench.advice(points, stages, "raw", "uint8", resize)["notes"])

    assert "resized by" not in notes("packer")
    if resize._native is not None:
        assert "Pillow-SIMD" in notes("torch") or "C extension" in notes("torch")
        assert "unset PACKER_RESIZE" in notes("pillow")
    monkeypatch.setattr(resize, "_native", None)
    assert "C extension was not built" in notes("torch") and "C extension was not built" in notes("pillow")


def test_advice_for_a_dataset_bigger_than_ram() -> None:
    from packer.tools import bench

    points = [bench.Point(0, 100, 1.0, 100.0, 10.0)]
    stages = [{"stage": "read", "percent": 10.0}]
    cases = [
        ("raw", "memmap", False, "--format jpeg"),
        ("jpeg", "lmdb", False, "--backend memmap"),
        ("raw", "lmdb", False, "--format jpeg"),
        ("raw", "lmdb", False, "--backend memmap"),
        ("raw", "lmdb", True, None),
        ("jpeg", "memmap", False, None),
        ("raw", "lmdb", None, None),
    ]
    for fmt, backend, fits, told in cases:
        notes = " ".join(bench.advice(points, stages, fmt, "uint8", "packer", fits, backend)["notes"])
        assert ("from disk" in notes) == (told is not None) and (told is None or told in notes), (fmt, backend, fits)
