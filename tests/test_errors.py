"""One base error type: every failure packer expects is a packer.PackerError, which the CLI prints as one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import packer
from packer import errors
from packer.cli import main
from packer.errors import URLNotSupported, is_url


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
        "URLNotSupported",
        "StoreError",
        "ObjectNotFound",
        "ObjectChanged",
        "PreconditionFailed",
        "VersionsDiffer",
        "CacheWaitTimeout",
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


#: Commands that write (or take raw/): local paths only, for now.
URL_COMMANDS = [
    ["build", "s3://bucket/raw", "out.lmdb"],
]
#: Commands that read a dataset take URLs (tests/store reads real ones), and build, compact and clean
#: write to them (tests/builder/test_publish.py, tests/tools); a scheme no store serves is one line.
READ_COMMANDS = [
    ["build", "{raw}", "file:///tmp/x.lmdb"],
    ["build", "--dask", "local", "{raw}", "gs://bucket/x"],
    ["compact", "az://container/x"],
    ["clean", "gs://bucket/x"],
    ["info", "gs://bucket/x"],
    ["info", "--json", "gs://bucket/x"],
    ["verify", "az://container/x"],
    ["show", "ftp://host/x", "0"],
    ["preview", "gs://bucket/x", "-o", "sheet.jpg"],
    ["bench", "az://container/x"],
]


def test_every_command_refuses_a_url_in_one_line_and_writes_nothing(
    raw_photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path("s3://bucket/x") is the local folder s3:/bucket/x: a build made it in the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path.parent / "cache"))
    for args in URL_COMMANDS + READ_COMMANDS:
        args = [a.format(raw=raw_photos) for a in args]
        result = CliRunner().invoke(main, args)
        url = next(a for a in args if "://" in a)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith(f"packer: error: {url}") or result.output.startswith(
            f"packer: error: {url.split(':')[0]}://"
        ), (args, result.output)
        assert result.output.count("\n") == 1, (args, result.output)
        if args in URL_COMMANDS:
            assert "URLs are not supported here" in result.output, args
        assert list(tmp_path.iterdir()) == [], args


def test_the_api_refuses_urls_too(raw_photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from packer.tools.clean import clean
    from packer.tools.compact import compact

    monkeypatch.chdir(tmp_path)
    calls = [
        lambda: packer.build(raw_photos, "s3://bucket/x", quiet=True),
        lambda: packer.build("s3://bucket/raw", tmp_path / "out.lmdb", quiet=True),
        lambda: compact("s3://bucket/x"),
        lambda: clean("s3://bucket/x"),
    ]
    for call in calls:
        with pytest.raises(URLNotSupported, match="URLs are not supported here"):
            call()
    assert list(tmp_path.iterdir()) == []
    # a local path that merely contains "://" further on, and a Windows-style drive, are paths
    assert not is_url("raw/s3://x") and not is_url("C://data") and is_url("S3+x.y-z://b")


def test_ctrl_c_of_a_reading_command_says_the_dataset_is_unchanged(built) -> None:
    """A real SIGINT to ``packer bench`` mid-measurement (once it has started a process of its own, it
    is past its imports): exit 130 and one line saying the dataset was not changed, not the build's
    "run the same build with --resume"."""
    out = built("memmap", "raw")
    bench = [sys.executable, "-m", "packer.cli", "bench", str(out), "--workers", "1", "--repeats", "50"]
    proc = subprocess.Popen(
        bench,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as under `make test &`
    )
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 120
    while proc.poll() is None and not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "bench ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["packer: interrupted; the dataset was not changed"], err
