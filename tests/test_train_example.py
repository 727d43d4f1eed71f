"""The example training script and the GPU check script, run as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_train_example_loss_falls(built) -> None:
    out = run(
        str(SCRIPTS / "train_example.py"), str(built("memmap", "jpeg")),
        "--steps", "200", "--batch-size", "6", "--crop-size", "64", "--lr", "0.02", "--workers", "2", "--log-every", "20",
    )
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 10, out
    assert losses[-1] < 0.5 * losses[0], out


def test_gpu_check(built) -> None:
    out = run(str(SCRIPTS / "gpu_check.py"), str(built("lmdb", "jpeg")))
    if torch.cuda.is_available():
        assert "all checks passed" in out
    else:
        assert out.startswith("skipped: no CUDA device")


def test_lightning_example_drives_the_sampler_and_resumes(built, tmp_path: Path) -> None:
    """Lightning calls ShardSampler.set_epoch each epoch (reaching the dataset); a checkpoint of the
    finished run continues without error. Needs `lightning` (the dev extra installs it)."""
    import pytest

    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")
    args = [str(SCRIPTS / "train_lightning.py"), str(built("memmap", "jpeg")), "--batch-size", "6",
            "--crop-size", "32", "--workers", "2", "--out", str(tmp_path)]
    out = run(*args, "--epochs", "3")
    assert re.findall(r"epoch (\d+): sampler epoch (\d+), dataset epoch (\d+)", out) == [(e, e, e) for e in "012"], out
    ckpt = next(tmp_path.rglob("*.ckpt"))
    out = run(*args, "--epochs", "4", "--ckpt", str(ckpt))
    assert re.findall(r"epoch (\d+): sampler epoch (\d+)", out) == [("3", "3")], out
