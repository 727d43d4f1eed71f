"""One base error type: every failure packer expects is a packer.PackerError, which the CLI prints as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import packer
from packer import errors


def test_every_error_type_lives_in_errors_and_is_exported() -> None:
    """One errors.py holds every PackerError subclass, and ``packer`` exports each one by name."""
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.PackerError) and value.__module__ == errors.__name__
    }
    assert defined == {
        "PackerError",
        "BuildError",
        "DatasetError",
        "DatasetReplaced",
        "LabelError",
        "ScanError",
        "ShardError",
    }
    for name in defined:
        assert name in packer.__all__ and getattr(packer, name) is getattr(errors, name), name
    found = [c for m in _modules() for c in vars(m).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert all(c.__module__ == errors.__name__ for c in found if issubclass(c, errors.PackerError)), found


def _modules() -> list:
    """Every packer module that can be imported without its optional dependencies."""
    import importlib
    import pkgutil

    out = []
    for info in pkgutil.walk_packages(packer.__path__, "packer."):
        try:
            out.append(importlib.import_module(info.name))
        except ImportError:  # an optional dependency (dask, matplotlib)
            continue
    return out


def test_package_ships_its_type_hints() -> None:
    assert (Path(packer.__file__).parent / "py.typed").is_file()


def test_cli_reports_a_packer_error_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "packer.cli", "info", str(tmp_path / "absent.lmdb")], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("packer: error: ") and "absent.lmdb" in run.stderr
