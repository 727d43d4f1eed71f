"""Check the GPU input path: pinned memory, non_blocking copies, float conversion on the device.

    python scripts/gpu_check.py [DATASET]

Compares packer.transform.to_device against the CPU conversion (bit-identical for float32) on a
synthetic batch and, given a dataset, on real batches from a pin_memory DataLoader. Exits 0 with a
"skipped" message where torch sees no CUDA device, so it can run anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from packer.read.dataset import ShardDataset
from packer.transform import IMAGENET_MEAN, IMAGENET_STD, norm_constants, normalize_into, to_device


def cpu_reference(batch: torch.Tensor) -> torch.Tensor:
    mean255, inv_std255 = norm_constants(IMAGENET_MEAN, IMAGENET_STD, (1, 3, 1, 1))
    return normalize_into(batch, torch.empty(batch.shape), mean255, inv_std255)


def check(batch: torch.Tensor, device: torch.device, what: str) -> None:
    expected = cpu_reference(batch)
    got = to_device(batch, device)
    assert got.device.type == "cuda" and got.dtype == torch.float32 and got.shape == batch.shape
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    half = to_device(batch, device, dtype=torch.float16)
    torch.testing.assert_close(half.float().cpu(), expected, rtol=2e-3, atol=2e-3)
    print(f"ok: {what}: {tuple(batch.shape)} uint8 -> float32 on {device} equals the CPU conversion")


def copy_time(batch: torch.Tensor, device: torch.device, repeats: int = 20) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        batch.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", nargs="?", help="optional: also check real batches from this packer dataset")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device (torch.cuda.is_available() is False); nothing was checked")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    batch = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pinned = batch.pin_memory()
    assert pinned.is_pinned() and not batch.is_pinned()
    check(pinned, device, "synthetic pinned batch")
    check(batch, device, "synthetic pageable batch (pinned by to_device)")
    pageable_s, pinned_s = copy_time(batch, device), copy_time(pinned, device)
    mb = batch.numel() / 1e6
    print(f"host->device {mb:.1f} MB: pageable {mb / pageable_s:.0f} MB/s, pinned {mb / pinned_s:.0f} MB/s")

    if args.dataset:
        ds = ShardDataset(args.dataset, crop_size=224, dtype=torch.uint8)
        loader = DataLoader(ds, batch_size=8, num_workers=2, pin_memory=True)
        for images, _ in loader:
            assert images.is_pinned(), "DataLoader(pin_memory=True) should hand out pinned batches"
            check(images, device, f"batch from {ds.root}")
    print("gpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
