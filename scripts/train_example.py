"""Train a small CNN from a packer dataset with the recommended DataLoader settings.

    python scripts/train_example.py out.lmdb --steps 300 --batch-size 64 --crop-size 224

Workers ship uint8 crops (4x fewer bytes than float32); pinned memory lets the host-to-device copy
run asynchronously, and conversion to float + normalization happen on the device (packer.transform
.to_device). See docs/DATASET.md for why each DataLoader setting is what it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from packer.read.dataset import ShardDataset
from packer.transform import to_device


def small_cnn(num_classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        *block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def make_loader(ds: ShardDataset, batch_size: int, workers: int, device: torch.device, seed: int) -> DataLoader:
    """The settings docs/DATASET.md recommends."""
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),  # reproducible order; crops are seeded by ds
        num_workers=workers,
        pin_memory=device.type == "cuda",  # page-locked batches: async copies with non_blocking=True
        persistent_workers=workers > 0,  # no re-fork and handle reopen every epoch
        prefetch_factor=4 if workers > 0 else None,  # batches in flight per worker, absorbs jitter
        drop_last=True,  # equal batch shapes: no recompiles/odd BatchNorm statistics on a tiny last batch
    )


def main(argv: Optional[Sequence[str]] = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", help="a dataset written by `packer build`")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    ds = ShardDataset(args.dataset, crop_size=args.crop_size, train=True, seed=args.seed, dtype=torch.uint8)
    if len(ds) < args.batch_size:
        p.error(f"the dataset has {len(ds)} records, fewer than --batch-size {args.batch_size}")
    loader = make_loader(ds, args.batch_size, args.workers, device, args.seed)
    # torch's stub for Module.to lacks the memory_format keyword that Module.to accepts
    model = small_cnn(len(ds.classes)).to(device).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{ds}, {len(loader)} batches/epoch, device {device}")

    losses: list[torch.Tensor] = []  # kept on the device: .item() every step would stall the GPU
    epoch = 0
    while len(losses) < args.steps:
        ds.set_epoch(epoch)  # new crops each epoch (a DistributedSampler needs its own set_epoch too)
        for images, labels in loader:
            x = to_device(images, device).contiguous(memory_format=torch.channels_last)
            y = labels.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if len(losses) % args.log_every == 0 or len(losses) == args.steps:
                recent = float(torch.stack(losses[-args.log_every :]).mean())
                print(f"step {len(losses):5d}  epoch {epoch:3d}  loss {recent:.4f}", flush=True)
            if len(losses) == args.steps:
                break
        epoch += 1
    return torch.stack(losses).tolist()


if __name__ == "__main__":
    main()
