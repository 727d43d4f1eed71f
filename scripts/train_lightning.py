"""Train a small CNN from a packer dataset with PyTorch Lightning, ShardSampler and a user transform.

    pip install lightning torchdata            # torchdata: mid-epoch resume from Lightning checkpoints
    python scripts/train_lightning.py out.lmdb --epochs 3 --batch-size 64
    python scripts/train_lightning.py out.lmdb --epochs 3 --ckpt last.ckpt   # continue a checkpoint

What it shows:
- ``ShardSampler`` as the DataLoader's sampler and ``Trainer(use_distributed_sampler=False)``: Lightning
  calls ``sampler.set_epoch`` each epoch (new order and crops, reaching the dataset), and under DDP
  the sampler takes rank and world size from torch.distributed itself;
- a per-sample ``transform`` (here a brightness jitter drawing from torch's global generator, as
  torchvision's transforms do) that stays reproducible: it is seeded per draw;
- uint8 batches converted on the device in ``on_after_batch_transfer`` (packer.transform.to_device);
- with torchdata installed, a ``StatefulDataLoader``: Lightning stores its state (the sampler's
  epoch and position) in every checkpoint, so resuming from a mid-epoch checkpoint continues the
  epoch where it stopped instead of starting it again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import lightning as L

from packer import ShardDataset, ShardSampler
from packer.transform import to_device

try:
    from torchdata.stateful_dataloader import StatefulDataLoader as Loader
except ImportError:  # without torchdata a resumed epoch starts from its beginning
    Loader = DataLoader


def brightness(x: torch.Tensor) -> torch.Tensor:
    """A user transform on the uint8 C x H x W crop, drawing from torch's global generator."""
    factor = 0.6 + 0.8 * torch.rand(())
    return x.mul(factor).clamp_(0, 255).to(torch.uint8)


class Classifier(L.LightningModule):
    def __init__(self, num_classes: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, num_classes),
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return to_device(images, self.device), labels  # float + normalize where the model runs

    def on_train_epoch_start(self) -> None:
        loader = self.trainer.train_dataloader
        assert loader is not None, "called during fit"
        sampler = loader.sampler
        print(
            f"epoch {self.current_epoch}: sampler epoch {sampler.epoch}, dataset epoch {sampler.dataset.epoch}",
            flush=True,
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt", help="a Lightning checkpoint to continue from")
    p.add_argument("--out", default="lightning_logs", help="checkpoints and logs")
    args = p.parse_args(argv)

    ds = ShardDataset(args.dataset, crop_size=args.crop_size, dtype=torch.uint8, transform=brightness)
    loader = Loader(
        ds,
        batch_size=args.batch_size,
        sampler=ShardSampler(ds, drop_last=True),
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=torch.cuda.is_available(),
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        use_distributed_sampler=False,
        default_root_dir=args.out,
        enable_progress_bar=False,
        log_every_n_steps=1,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(len(ds.classes), args.lr), loader, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main()
