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
            "--repeats",
            "2",
            "--dtype",
            dtype,
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # each step's progress goes to stderr as it ends
    assert "packer bench: num_workers=0: " in result.stderr and "packer bench: num_workers=1: " in result.stderr
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
    for p in report["throughput"]:  # 2 runs of 2 passes over 18 records
        assert p["samples"] == 72 and len(p["runs"]) == 2 and min(p["runs"]) <= p["samples_per_s"] <= max(p["runs"])
    assert report["knee"]["workers"] in (0, 1) and report["knee"]["samples_per_s"] > 0
    stages = {s["stage"]: s for s in report["profile"]["stages"]}
    assert {"read", "decode", "resize", "write to batch", "collate"} <= set(stages)
    assert ("to float" in stages) == (dtype == "float32")
    assert all(s["us_per_sample"] > 0 for s in stages.values())
    assert sum(s["percent"] for s in stages.values()) == pytest.approx(100, abs=0.5)
    assert report["fits_in_page_cache"] is True
    rec = report["recommendation"]
    assert rec["dataloader"]["num_workers"] == report["knee"]["workers"] == 1  # never 0 once 1 was measured
    assert rec["dtype"] == "uint8" and rec["sampler"] == "ShardSampler(ds)" and rec["dataloader"]["drop_last"]


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
        return " ".join(
            bench.advice(points, stages, "raw", "uint8", resize, count=10, batch_size=4, train=True)["notes"]
        )

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
        advice = bench.advice(points, stages, fmt, "uint8", "packer", fits, backend, count=10, batch_size=4, train=True)
        notes = " ".join(advice["notes"])
        assert ("from disk" in notes) == (told is not None) and (told is None or told in notes), (fmt, backend, fits)


def _points(runs: dict[int, list[float]]) -> list:
    from packer.tools import bench

    return [bench.combine([bench.Point(w, 100, 100 / r, r, 10.0) for r in rs]) for w, rs in runs.items()]


def test_more_workers_are_advised_only_for_a_difference_larger_than_the_runs_spread() -> None:
    """On a busy machine one run of each count recommended num_workers=0 half the time: the advice
    now needs a difference beyond the spread of repeated runs, and is never 0 once workers were measured."""
    from packer.tools.bench import knee

    assert knee(_points({0: [100, 105, 110], 1: [90, 120, 150], 2: [140, 145, 150]})).workers == 1  # 1 within noise
    assert knee(_points({0: [100, 105, 110], 1: [90, 95, 100], 2: [140, 145, 150]})).workers == 2  # 2 clearly faster
    assert knee(_points({1: [100, 101, 102], 2: [108, 109, 110]})).workers == 1  # less than 10% more
    assert knee(_points({0: [300, 310, 320], 1: [100, 110, 120], 2: [100, 105, 110]})).workers == 1
    assert knee(_points({0: [300, 310, 320]})).workers == 0  # nothing else measured
    point = _points({2: [150, 90, 120]})[0]
    assert (point.samples_per_s, point.low, point.high, point.runs) == (120, 90, 150, [150, 90, 120])


def test_advice_is_the_readmes_setup_and_never_yields_no_batch() -> None:
    """177 records with batch_size=256 and drop_last=True give 0 batches an epoch: never advised."""
    from packer.tools import bench

    points = _points({0: [300, 310, 320], 1: [100, 110, 120]})
    stages = [{"stage": "read", "percent": 10.0}, {"stage": "to float", "percent": 30.0}]
    small = bench.advice(points, stages, "jpeg", "float32", "packer", count=177, batch_size=256, train=True)
    assert small["dataloader"]["drop_last"] is False and small["dataloader"]["num_workers"] == 1
    assert small["dtype"] == "uint8" and small["sampler"] == "ShardSampler(ds)"
    notes = " ".join(small["notes"])
    assert "fewer than a batch of 256" in notes and "num_workers=0 was faster" in notes and "--dtype uint8" in notes
    assert bench.advice(points, stages, "jpeg", "uint8", "packer", count=256, batch_size=256, train=True)["dataloader"][
        "drop_last"
    ]
    val = bench.advice(points, stages, "jpeg", "uint8", "packer", count=5000, batch_size=256, train=False)
    assert val["dataloader"]["drop_last"] is False and val["sampler"] == "ShardSampler(ds, shuffle=False)"


def test_bench_text_advises_shard_sampler_and_uint8(built) -> None:
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(built("lmdb", "raw")),
            "--workers",
            "1",
            "--batch-size",
            "32",
            "--crop-size",
            "32",
            "--repeats",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "median and range of 2 runs each" in result.output
    assert "sampler = ShardSampler(ds)" in result.output and "dtype=torch.uint8" in result.output
    assert "to_device(images" in result.output and "shuffle=True" not in result.output
    assert "drop_last=False" in result.output and "18 records are fewer than a batch of 32" in result.output
