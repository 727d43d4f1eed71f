"""Batches pinned bit for bit: the crops, resizes and conversions of every resize backend, hashed and
compared with digests recorded on this project's install, so that a refactoring of packer.transform
(or of codec's decoders) that changes a single pixel fails here.

The digests depend on the decoders, resize kernels and float arithmetic of the install (libjpeg-turbo,
Pillow, torch, numpy, CPU), so they are keyed by those; elsewhere the test is skipped, saying how to
record this install's (``PACKER_RECORD_DIGESTS=1``, run on the code before the change).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from packer import codec, transform
from packer.dataset import ShardDataset

DIGESTS = Path(__file__).resolve().parent / "data" / "batch-digests.json"
BACKENDS = ("torch", "pillow") + (("packer",) if codec._native is not None else ())


def install_key() -> str:
    """What the pixels depend on besides packer's code."""
    import PIL

    return (
        f"{platform.machine()} torch-{torch.__version__} numpy-{np.__version__} pillow-{PIL.__version__} "
        f"{codec.codec_name()} native={codec._native is not None}"
    )


def digest(images: list[torch.Tensor]) -> str:
    """The images' shapes, dtypes, strides and bytes."""
    h = hashlib.sha256()
    for image in images:
        h.update(f"{tuple(image.shape)} {image.dtype} {image.stride()}".encode())
        h.update(image.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def batches(path: Path) -> dict[str, str]:
    """Every sample of ``path`` through each read path that the backend in use takes."""
    n = 18
    out: dict[str, str] = {}

    def batch(name: str, epoch: int = 0, **kw) -> None:
        ds = ShardDataset(path, **kw)
        out[name] = digest([s.image for s in ds._batch(list(range(n)), epoch)])

    batch("train-u8", crop_size=64, seed=3, dtype=torch.uint8)
    batch("train-u8-epoch5", epoch=5, crop_size=64, seed=3, dtype=torch.uint8)
    batch("train-f32-contiguous", crop_size=64, seed=3, memory_format=torch.contiguous_format)
    batch("train-f32-noflip", crop_size=100, seed=4, flip=False, scale=(0.5, 1.0))
    batch("eval-f32", crop_size=96, train=False)
    batch("eval-u8-224", crop_size=224, train=False, dtype=torch.uint8)
    batch("transform-f32", crop_size=64, seed=3, transform=lambda x: x)
    batch("whole-f32", crop_size=None)
    batch("whole-transform-u8", crop_size=None, dtype=torch.uint8, transform=lambda x: x[:, :200, :200])
    ds = ShardDataset(path, crop_size=64, seed=3, dtype=torch.uint8)
    u8 = torch.stack([s.image for s in ds._batch(list(range(n)), 0)])
    out["to_device-cpu"] = digest([transform.to_device(u8, "cpu")])
    out["to_device-cpu-f16"] = digest([transform.to_device(u8, "cpu", dtype=torch.float16)])
    with pytest.MonkeyPatch.context() as m:  # without packer's libjpeg binding: whole-record decodes
        m.setattr(codec, "_native", None)
        batch("train-u8-whole-decode", crop_size=64, seed=3, dtype=torch.uint8)
        batch("whole-u8-turbojpeg", crop_size=None, dtype=torch.uint8)
    return out


def test_batches_are_bit_identical_to_the_recorded_ones(built, monkeypatch) -> None:
    found: dict[str, str] = {}
    for backend in BACKENDS:
        monkeypatch.setenv("PACKER_RESIZE", backend)
        transform.resize_backend.cache_clear()
        try:
            for fmt in ("jpeg", "raw"):
                for name, value in batches(built("memmap", fmt)).items():
                    found[f"{backend} {fmt} {name}"] = value
        finally:
            monkeypatch.delenv("PACKER_RESIZE")
            transform.resize_backend.cache_clear()
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    key = install_key()
    if os.environ.get("PACKER_RECORD_DIGESTS") == "1":
        recorded[key] = found
        DIGESTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    if key not in recorded:
        pytest.skip(f"no digests recorded for this install ({key}): PACKER_RECORD_DIGESTS=1 records them")
    changed = sorted(name for name in found if recorded[key].get(name) != found[name])
    assert not changed, f"batches differ from the recorded ones: {changed}"
    assert set(found) == set(recorded[key])
