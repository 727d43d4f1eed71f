"""uint8 -> float, ``(x - mean) / std``, on the output crop only (the last step of a sample), computed
as ``(x - 255 * mean) * (1 / (255 * std))`` in float32 on every path, so the CPU paths, packer's
compiled one and :func:`~packer.transform.device.to_device` give identical float32 results.
Why each path is shaped as it is: docs/PERFORMANCE.md, "Per-sample steps"."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import codec

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: packer's compiled helpers, or None (see packer.transform.resize's own).
_native = codec._native


def norm_constants(
    mean: Sequence[float], std: Sequence[float], shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(255 * mean, 1 / (255 * std)) as float32, reshaped to broadcast over channels."""
    m = torch.tensor(mean, dtype=torch.float32).mul(255)
    inv = torch.tensor(std, dtype=torch.float32).mul(255).reciprocal()
    return m.view(shape), inv.view(shape)


def normalize_into(x: torch.Tensor, out: torch.Tensor, mean255: torch.Tensor, inv_std255: torch.Tensor) -> torch.Tensor:
    """out = (x - mean) / std for uint8 ``x``, written into ``out`` without float temporaries.

    A same-dtype convert-copy then in-place ops: ``torch.sub(x_uint8, mean, out=out)`` would take
    torch's slower dynamic-casting path.
    """
    out.copy_(x)
    return out.sub_(mean255).mul_(inv_std255)


@functools.lru_cache(maxsize=16)
def _row_constants(mean: tuple[float, ...], std: tuple[float, ...], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_constants repeated along one H x W x C row (W x C values)."""
    m, inv = norm_constants(mean, std, (len(mean),))
    return m.repeat(width), inv.repeat(width)


@functools.lru_cache(maxsize=16)
def _native_constants(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """norm_constants as the float tuples _native.normalize takes."""
    m, inv = norm_constants(mean, std, (len(mean),))
    return tuple(m.tolist()), tuple(inv.tolist())


def normalize_hwc(x: torch.Tensor, out: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """:func:`normalize_into` for H x W x C uint8 ``x`` into ``out`` (an H x W x C view).

    For float32 RGB, packer's compiled ``normalize`` does it in one pass with non-temporal stores
    (the batch is bigger than the caches), same arithmetic. Otherwise torch's kernels: broadcasting a
    C-vector over the innermost dimension runs them C elements at a time, so the constants are
    repeated along rows of W x C, where they vectorize; an H x W x C view of C x H x W memory is
    done per plane instead.
    """
    h, w, c = out.shape
    if _native is not None and c == 3 and out.dtype == torch.float32 and out.is_contiguous() and x.is_contiguous():
        _native.normalize(x.numpy(), out.numpy(), *_native_constants(mean, std))
        return out
    if out.is_contiguous():
        m, inv = _row_constants(mean, std, w)
        return normalize_into(x.reshape(h, w * c), out.view(h, w * c), m, inv).view(h, w, c)
    m, inv = norm_constants(mean, std, (c, 1, 1))
    normalize_into(x.permute(2, 0, 1), out.permute(2, 0, 1), m, inv)
    return out
