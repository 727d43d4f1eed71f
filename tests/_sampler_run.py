"""Shared by tests/read/test_sampler.py and run by it as a NEW process (``python -m tests._sampler_run``)
that resumes a training loop mid-epoch from a saved sampler or StatefulDataLoader state, as a
preempted job does; with WORLD_SIZE > 1 each rank is a real torch.distributed (gloo) process."""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from packer.read import rng
from packer.read.dataset import ShardDataset
from packer.read.sampler import ShardSampler

CROP, BATCH, SEED, EPOCHS = 32, 2, 5, 3


def jitter(x: torch.Tensor) -> torch.Tensor:
    """A third-party-style transform: draws from torch's, numpy's and Python's global generators and
    from the per-sample generator packer exposes."""
    shift = int(torch.randint(0, 30, (1,))) + int(np.random.randint(0, 30)) + random.randint(0, 30)
    noise = torch.randint(0, 8, x.shape, generator=rng.generator(), dtype=torch.int16)
    return (x.to(torch.int16) + shift + noise).clamp_(0, 255).to(torch.uint8)


def make(path: str, workers: int, stateful: bool = False, **sampler_args: Any) -> tuple[Any, ShardSampler]:
    ds = ShardDataset(path, crop_size=CROP, seed=SEED, dtype=torch.uint8, transform=jitter)
    sampler = ShardSampler(ds, **sampler_args)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = DataLoader
    return Loader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers), sampler


def batches(loader: Any, sampler: ShardSampler, first_epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every batch from ``first_epoch`` (where a loaded state may resume mid-way) to EPOCHS."""
    out = []
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        out += [(images.clone(), labels.clone()) for images, labels in loader]
    return out


def main(path: str, states_file: str, out_file: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # rank and world size from the environment
    rank = int(os.environ.get("RANK", "0"))
    states = torch.load(states_file, weights_only=False)[rank]
    results = {}
    for mode, state in states.items():
        workers, stateful = (2, True) if mode == "stateful" else (int(mode), False)
        loader, sampler = make(path, workers, stateful)  # rank and world size from torch.distributed
        if stateful:  # the loop saved {"epoch", "loader": StatefulDataLoader.state_dict()}
            loader.load_state_dict(state["loader"])
            first = state["epoch"]
        else:  # the loop saved ShardSampler.state_dict(consumed=...)
            sampler.load_state_dict(state)
            first = sampler.epoch
        results[mode] = batches(loader, sampler, first)
    torch.save(results, f"{out_file}.{rank}")


if __name__ == "__main__":
    main(*sys.argv[1:])


def ddp_steps(rank: int, world: int, port: int, scenarios: dict[str, Any], out: str) -> None:
    """One gloo rank (torch.multiprocessing.spawn) of a DDP-style loop per scenario ``name: (paths,
    sampler_args)``: a DataLoader with 2 persistent workers over ShardSampler (a MixDataset of several
    paths), 2 epochs, and an all_reduce of the step number every step, as DDP's gradient sync makes:
    a rank with fewer steps than another fails there. Saves each scenario's (record, epoch, draw) per
    step."""
    import datetime

    import torch.distributed as dist

    from packer.read.mix import MixDataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    results: dict[str, list[list[tuple[int, int, int]]]] = {}
    for name, (paths, sampler_args) in scenarios.items():
        members = [ShardDataset(p, crop_size=CROP, seed=SEED, dtype=torch.uint8) for p in paths]
        ds: Any = members[0] if len(members) == 1 else MixDataset(members)
        sampler = ShardSampler(ds, **sampler_args)  # rank and world size from torch.distributed
        loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=2, persistent_workers=True)
        steps = results[name] = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            listing = ShardSampler(ds, **sampler_args)
            listing.set_epoch(epoch)
            listed = list(listing)  # this rank's draws, in the loader's order
            at = 0
            for step, (images, _labels) in enumerate(loader):
                where = torch.tensor([epoch, step])
                dist.all_reduce(where)
                assert where.tolist() == [world * epoch, world * step], f"{name}: rank {rank} is out of step"
                steps.append([(int(d), d.epoch, d.draw) for d in listed[at : at + len(images)]])
                at += len(images)
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def kornia_jiggle(x: torch.Tensor) -> torch.Tensor:
    """kornia's ColorJiggle (random parameters from torch's global generator) on the uint8 crop."""
    import kornia.augmentation as K

    out = K.ColorJiggle(0.3, 0.3, 0.3, 0.1, p=1.0)(x.float().div(255))  # 1 x C x H x W in [0, 1]
    return out[0].mul(255).round_().to(torch.uint8)
