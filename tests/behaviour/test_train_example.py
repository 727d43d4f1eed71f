"""The example training script and the GPU check script, run as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_train_example_loss_falls(built) -> None:
    out = run(
        str(SCRIPTS / "train_example.py"),
        str(built("memmap", "jpeg")),
        "--steps",
        "200",
        "--batch-size",
        "6",
        "--crop-size",
        "64",
        "--lr",
        "0.02",
        "--workers",
        "2",
        "--log-every",
        "20",
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


def test_lightning_example_drives_the_sampler_and_resumes_mid_epoch(built, tmp_path: Path) -> None:
    """Lightning calls ShardSampler.set_epoch each epoch (reaching the dataset); a run stopped after 3
    of an epoch's 9 steps and resumed from its Lightning checkpoint (a StatefulDataLoader's state
    inside) gets the uninterrupted run's remaining batches bit for bit. Needs `lightning` and
    `torchdata` (the dev extra installs both)."""
    import pytest

    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed (pip install torchdata)")
    dataset = str(built("memmap", "jpeg"))
    out = run(
        str(SCRIPTS / "train_lightning.py"),
        dataset,
        "--batch-size",
        "6",
        "--crop-size",
        "32",
        "--workers",
        "2",
        "--out",
        str(tmp_path),
        "--epochs",
        "3",
    )
    assert re.findall(r"epoch (\d+): sampler epoch (\d+), dataset epoch (\d+)", out) == [(e, e, e) for e in "012"], out
    helper = ["-m", "tests._lightning_run", dataset]
    cwd = Path(__file__).resolve().parents[2]
    for args in ([str(tmp_path / "full"), "18"], [str(tmp_path / "stop"), "3"]):
        subprocess.run([sys.executable, *helper, *args], cwd=cwd, check=True, capture_output=True, timeout=300)
    ckpt = next((tmp_path / "stop").glob("*step=3*.ckpt"))
    subprocess.run(
        [sys.executable, *helper, str(tmp_path / "stop"), "18", str(ckpt)],
        cwd=cwd,
        check=True,
        capture_output=True,
        timeout=300,
    )
    full = torch.load(tmp_path / "full" / "batches-18.pt")
    resumed = torch.load(tmp_path / "stop" / "batches-18-resumed.pt")
    assert len(full) == 18 and len(resumed) == 15
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[3:], resumed))
