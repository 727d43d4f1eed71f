"""Check what a release would upload, and what installing it gives a user (``make package-check``).

    python scripts/check_package.py --dist DIR --no-compiler DIR   # the archives' contents
    python scripts/check_package.py --installed                    # run by a fresh venv's python, outside the checkout

A packaging mistake is invisible from an editable install: a subpackage missing from pyproject's list,
a C source left out of the sdist, a wrong distribution name or version all pass the test suite. The
first form reads the sdist and wheels built by ``python -m build``; the second imports the installed
wheel (refusing one imported from the checkout), runs the command, and builds, verifies and reads a
small dataset with it. Exits non-zero with one line per problem.
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Files the sdist must carry beyond the Python modules: the extension's sources and what setuptools reads.
SDIST_EXTRA = (
    "packer/_native.c",
    "packer/_resize.c",
    "packer/_resize.h",
    "packer/py.typed",
    "pyproject.toml",
    "README.md",
)


def _version_and_name() -> tuple[str, str]:
    """packer/_version.py's version and distribution name, read without importing packer."""
    scope: dict[str, str] = {}
    exec((ROOT / "packer" / "_version.py").read_text(), scope)
    return scope["__version__"], scope["DISTRIBUTION"]


def _modules() -> set[str]:
    """Every module of the source tree, as a path inside the package (``packer/read/sampler.py``)."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "packer").rglob("*.py")}


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"check_package: expected one {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


def check_archives(dist: Path, no_compiler: Path) -> list[str]:
    """Problems in the sdist, the wheel built from it, and the wheel built without a compiler."""
    version, name = _version_and_name()
    stem = f"{name.replace('-', '_')}-{version}"
    problems = []
    sdist = _one(dist, f"{stem}.tar.gz")
    with tarfile.open(sdist) as tar:
        inside = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    problems += [f"{sdist.name} lacks {f}" for f in sorted((_modules() | set(SDIST_EXTRA)) - inside)]
    for wheel_path, compiled in ((_one(dist, f"{stem}-*.whl"), True), (_one(no_compiler, f"{stem}-*.whl"), False)):
        with zipfile.ZipFile(wheel_path) as wheel:
            files = set(wheel.namelist())
            meta = email.parser.Parser().parsestr(wheel.read(f"{stem}.dist-info/METADATA").decode())
            entry_points = wheel.read(f"{stem}.dist-info/entry_points.txt").decode()
        problems += [f"{wheel_path.name} lacks {f}" for f in sorted((_modules() | {"packer/py.typed"}) - files)]
        if (meta["Name"], meta["Version"]) != (name, version):
            problems.append(f"{wheel_path.name}: metadata names {meta['Name']} {meta['Version']}, not {name} {version}")
        if "packer = packer.cli:main" not in entry_points:
            problems.append(f"{wheel_path.name}: no `packer` command in its entry points")
        native = [f for f in files if f.startswith("packer/_native") and f.endswith(".so")]
        if compiled and not native:
            problems.append(f"{wheel_path.name}: the C extension was not built into it")
        if not compiled and native:
            problems.append(f"{wheel_path.name}: built with CC=false, yet it holds {native}")
    return problems


def _run(*argv: str, cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"check_package: `{' '.join(argv)}` exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def check_installed(work: Path) -> list[str]:
    """Problems with the installed wheel, exercised from ``work`` (outside the checkout)."""
    import importlib.metadata

    import packer

    version, name = _version_and_name()
    problems = []
    if Path(packer.__file__).resolve().parent == ROOT / "packer":
        return [f"packer was imported from the checkout ({packer.__file__}), not from the installed wheel"]
    if importlib.metadata.version(name) != version or packer.__version__ != version:
        problems.append(
            f"installed {name} {importlib.metadata.version(name)}, packer {packer.__version__}: not {version}"
        )
    command = str(Path(sys.executable).with_name("packer"))
    shown = _run(command, "--version", cwd=work).strip()
    if shown != f"packer {version} ({name})":
        problems.append(f"`packer --version` says {shown!r}")
    doctor = _run(command, "doctor", cwd=work)
    if "ok  C extension" not in doctor:
        problems.append(f"`packer doctor` does not find the C extension the wheel holds:\n{doctor}")
    _run(sys.executable, "-m", "packer.tools.sample", "raw", "--per-class", "2", "--size", "640x480", cwd=work)
    _run(command, "build", "raw", "out.lmdb", "--quiet", cwd=work)
    _run(command, "verify", "out.lmdb", cwd=work)
    dataset = packer.ShardDataset(work / "out.lmdb")
    image, _ = dataset[0]
    if len(dataset) == 0 or image.ndim != 3:
        problems.append(f"the built dataset reads back {len(dataset)} records, the first of shape {tuple(image.shape)}")
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", type=Path, help="folder with the sdist and the wheel built from it")
    ap.add_argument("--no-compiler", type=Path, help="folder with the wheel built with CC=false")
    ap.add_argument("--installed", action="store_true", help="check the installed packer (run outside the checkout)")
    args = ap.parse_args(argv)
    if args.installed:
        problems = check_installed(Path.cwd())
    elif args.dist and args.no_compiler:
        problems = check_archives(args.dist, args.no_compiler)
    else:
        ap.error("give --dist and --no-compiler, or --installed")
    for line in problems:
        print(f"check_package: {line}", file=sys.stderr)
    if problems:
        sys.exit(1)
    checked = (
        "the installed wheel builds, verifies and reads a dataset" if args.installed else "sdist and wheels complete"
    )
    print(f"check_package: {checked}")


if __name__ == "__main__":
    main()
