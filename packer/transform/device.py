"""Batches to the accelerator: workers ship uint8 (a quarter of float32's bytes) and the conversion to
float runs on the device, with the CPU path's arithmetic."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .normalize import IMAGENET_MEAN, IMAGENET_STD, norm_constants, normalize_into


@functools.lru_cache(maxsize=16)
def _device_constants(
    device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached so that each batch does not pay two tiny synchronous host-to-device copies."""
    m, inv = norm_constants(mean, std, (1, 3, 1, 1))
    return m.to(device), inv.to(device)


def to_device(
    batch: torch.Tensor,
    device: torch.device | str,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Move a uint8 NCHW batch to ``device`` and normalize there.

    The copy is asynchronous when the batch is in pinned memory (DataLoader(pin_memory=True)); an
    unpinned batch is pinned here first. The arithmetic matches the CPU path (sub, then multiply by
    1/std in float32), so results are identical for float32.
    """
    device = torch.device(device)
    if device.type == "cuda" and not batch.is_pinned():
        batch = batch.pin_memory()
    mean255, inv_std255 = _device_constants(device, tuple(mean), tuple(std))
    x = batch.to(device, non_blocking=True)
    out = torch.empty_like(x, dtype=torch.float32)  # keeps the batch's memory format (channels-last)
    normalize_into(x, out, mean255, inv_std255)
    return out if dtype == torch.float32 else out.to(dtype)
