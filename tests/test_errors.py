"""One base error type: every failure packer expects is a packer.PackerError, which the CLI prints as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import packer
from packer.builder.dask import ShardError
from packer.builder.labels import LabelError
from packer.builder.pipeline import BuildError
from packer.builder.scan import ScanError
from packer.format import DatasetError


def test_every_expected_error_is_a_packer_error() -> None:
    for error in (BuildError, DatasetError, LabelError, ScanError, ShardError):
        assert issubclass(error, packer.PackerError), error
    assert packer.PackerError is packer.errors.PackerError and packer.DatasetError is DatasetError


def test_cli_reports_a_packer_error_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "packer.cli", "info", str(tmp_path / "absent.lmdb")], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("packer: error: ") and "absent.lmdb" in run.stderr
