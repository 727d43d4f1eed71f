"""`packer doctor` and `packer --version`: what a user is told about their install when reads are slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import packer
from packer import codec
from packer._version import DISTRIBUTION, __version__


def doctor(*code: str, env: dict[str, str] | None = None) -> list[dict]:
    """`packer doctor --json`'s rows, run in a fresh interpreter after ``code`` (to change what it sees)."""
    script = "\n".join(
        [*code, "import sys; from packer.cli import main; sys.argv = ['packer', 'doctor', '--json']; main()"]
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_version_names_the_distribution() -> None:
    run = subprocess.run([sys.executable, "-m", "packer.cli", "--version"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    shown = run.stdout.strip()
    assert shown == f"packer {__version__} ({DISTRIBUTION})" == f"packer {packer.__version__} (packer-datasets)"


def test_doctor_reports_this_install(tmp_path: Path) -> None:
    rows = by_name(doctor(env={"PACKER_CACHE_DIR": str(tmp_path / "cache")}))
    assert rows["packer"]["value"].startswith(f"{__version__} ({DISTRIBUTION}, {Path(packer.__file__).parent}")
    assert rows["C extension"]["ok"] is (codec._native is not None)
    assert rows["libjpeg-turbo"]["ok"] is (codec.turbojpeg() is not None)
    cache = rows["cache dir"]["value"]
    assert cache.startswith(f"{tmp_path / 'cache'} (") and "not created yet" in cache
    assert rows["cores"]["value"].startswith(f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()}")
    assert "/dev/shm" in rows and rows["torch"]["value"].startswith(__import__("torch").__version__)
    # every row that is not fine says what to do about it, and only those
    assert all(bool(r["fix"]) == (r["ok"] is False) for r in rows.values()), rows


def test_doctor_says_how_to_get_the_c_extension() -> None:
    # the interpreter cannot import packer._native, as on an install without a C compiler
    rows = by_name(doctor("import sys; sys.modules['packer._native'] = None"))
    missing = rows["C extension"]
    assert missing["ok"] is False and missing["value"] == "not built"
    assert "libjpeg62-turbo-dev" in missing["fix"] and DISTRIBUTION in missing["fix"]
    assert rows["resize kernel"]["value"] != "packer"


def test_doctor_text_flags_findings(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['packer._native'] = None\nfrom packer.cli import main; main()",
            "doctor",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PACKER_CACHE_DIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    flagged = [line for line in run.stdout.splitlines() if line.startswith("!!")]
    assert any("C extension" in line for line in flagged), run.stdout
    assert run.stdout.splitlines()[-1].endswith("finding(s) to act on")
