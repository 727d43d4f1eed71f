"""Run by tests/behaviour/test_train_example.py as a new process: scripts/train_lightning.py's model and loader
under a Lightning Trainer that checkpoints every 3 steps, recording every training batch, so that a
run stopped mid-epoch and resumed from its checkpoint can be compared with an uninterrupted one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_lightning as example

from packer import ShardDataset, ShardSampler

seen: list[tuple[torch.Tensor, torch.Tensor]] = []


class Recording(example.Classifier):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        seen.append((batch[0].clone(), batch[1].clone()))  # the uint8 batch the loader gave
        return super().on_after_batch_transfer(batch, dataloader_idx)


def main(dataset: str, out: str, max_steps: str, ckpt: str = "") -> None:
    ds = ShardDataset(dataset, crop_size=32, dtype=torch.uint8, transform=example.brightness)
    loader = example.Loader(ds, batch_size=2, sampler=ShardSampler(ds, drop_last=True), num_workers=2)
    every = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=int(max_steps),
        use_distributed_sampler=False,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        callbacks=[every],
    )
    trainer.fit(Recording(len(ds.classes), 0.01), loader, ckpt_path=ckpt or None)
    torch.save(seen, Path(out) / f"batches-{max_steps}{'-resumed' if ckpt else ''}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
