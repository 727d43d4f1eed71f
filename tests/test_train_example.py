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
