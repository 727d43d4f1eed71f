"""Train torchvision's Faster R-CNN for a few steps on a dataset packed with ``packer build --coco``:
the recipe docs/FIELDS.md shows ("Training a detector"), run as it is by tests/behaviour/test_detector.py
(`make recipe-check`). One JSON line per step: the losses, and each sample's id and box labels.

    python scripts/train_detector.py coco.lmdb [--steps 20] [--batch-size 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import DataLoader
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

from packer import ShardDataset, ShardSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dataset")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    torch.manual_seed(0)
    # Float pixels in 0..1 (mean 0, std 1): the model normalises its inputs itself. The crop moves
    # the boxes; a box with less than a quarter of its area left in the crop is dropped with its label.
    ds = ShardDataset(
        args.dataset,
        crop_size=320,
        train=True,
        dtype=torch.float32,
        mean=(0, 0, 0),
        std=(1, 1, 1),
        box_min_visible=0.25,
    )
    classes = ds.fields["box_labels"].classes  # COCO's category names by id, "" for id 0 (the background)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=len(classes))
    sampler = ShardSampler(ds)
    loader = DataLoader(
        ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, persistent_workers=args.workers > 0
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:  # images: B x 3 x 320 x 320; boxes, box_labels: lists of per-sample tensors
            images = list(batch["image"])
            targets = [{"boxes": b, "labels": labels} for b, labels in zip(batch["boxes"], batch["box_labels"])]
            losses = model(images, targets)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log = {"step": step, "loss": loss.item(), **{k: v.item() for k, v in losses.items()}}
            print(json.dumps({**log, "ids": batch["id"].tolist(), "labels": [t.tolist() for t in batch["box_labels"]]}))
            step += 1
            if step == args.steps:
                break
        epoch += 1


if __name__ == "__main__":
    main()
