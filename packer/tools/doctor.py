"""``packer doctor``: what this install and machine give packer, and what to change where reads are slow.

Each fast path packer takes has a condition someone can miss: the C extension (crop-on-decode and the
AVX2 resize) is built only where a compiler and libjpeg's headers were present at install; PyTurboJPEG
needs the system libjpeg-turbo; a container's default 64 MB ``/dev/shm`` is too small for DataLoader
workers' batches; a node cache on a nearly full disk evicts constantly. Silent fallbacks keep packer
working without them, so this says which ones are in effect, each with the fix.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .. import codec
from .._version import DISTRIBUTION, __version__
from ..read.remote import default_cache_dir
from ..transform.resize import resize_backend
from .bench import cores, mem_available

#: Below this, DataLoader workers' batches can fail with a bus error ("unable to write to file </torch_...>").
MIN_SHM = 1 << 30
#: Below this free space, a node cache of a dataset in object storage has little room to keep units.
MIN_CACHE_FREE = 10 << 30
#: Optional integrations: (import name shown, distribution, the extra that installs it, what it gives).
OPTIONAL = (
    ("botocore", "botocore", "s3", "s3:// datasets"),
    ("dask.distributed", "distributed", "dask", "multi-machine builds (packer build --dask)"),
    ("pillow_heif", "pillow-heif", "heif", "HEIC/HEIF photos in builds"),
    ("torchdata", "torchdata", "train", "StatefulDataLoader (exact mid-epoch resume)"),
    ("lightning", "lightning", "train", "scripts/train_lightning.py"),
)


@dataclass(frozen=True)
class Finding:
    """One fact: ``ok`` False where packer runs slower (or may fail) than it could, with the fix; None
    for an optional integration, neither good nor bad."""

    name: str
    value: str
    ok: Optional[bool] = True
    fix: str = ""


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _cpu_flags() -> Optional[set[str]]:
    """The CPU's feature flags (Linux), or None where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent: where free space is measured for a folder not made yet."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _native() -> list[Finding]:
    built = codec._native is not None
    flags = _cpu_flags()
    avx2 = "unknown" if flags is None else ("yes" if "avx2" in flags else "no")
    kernel = "vectorised" if codec.native_shrink() else "scalar"
    return [
        Finding(
            "C extension",
            f"built ({Path(codec._native.__file__).name})" if built else "not built",
            built,
            ""
            if built
            else "crop-on-decode and the AVX2 resize need it: install a C compiler and libjpeg62-turbo-dev "
            f"(apt), then reinstall: pip install --force-reinstall --no-deps --no-binary {DISTRIBUTION} "
            f"{DISTRIBUTION}",
        ),
        Finding(
            "AVX2",
            avx2 + (f" (packer's resize kernel {kernel})" if built else ""),
            avx2 != "no",
            "" if avx2 != "no" else "packer's resize kernel is scalar on this CPU: Pillow-SIMD or torch resize instead",
        ),
    ]


def _codecs() -> list[Finding]:
    import PIL

    found = codec.turbojpeg() is not None
    simd = ".post" in PIL.__version__
    kernel = resize_backend()
    return [
        Finding(
            "libjpeg-turbo",
            "found (PyTurboJPEG " + (_version("PyTurboJPEG") or "?") + ")" if found else "not found: Pillow decodes",
            found,
            "" if found else "apt install libturbojpeg0 (PyTurboJPEG 1.x binds it): faster decode and scaled decode",
        ),
        Finding(
            "Pillow",
            f"{PIL.__version__} ({'pillow-simd' if simd else 'plain Pillow'})",
            simd or kernel == "packer",
            ""
            if simd or kernel == "packer"
            else 'crops are resized by Pillow without SIMD: `CC="cc -mavx2" pip install --no-cache-dir pillow-simd` '
            "(after uninstalling pillow), or build the C extension",
        ),
        Finding("resize kernel", kernel + (" (PACKER_RESIZE)" if os.environ.get("PACKER_RESIZE") else "")),
    ]


def _machine() -> list[Finding]:
    findings = [Finding("cores", f"{cores()} usable of {os.cpu_count()}")]
    available = mem_available()
    if available is not None:
        findings.append(Finding("memory available", _gib(available)))
    if os.path.isdir("/dev/shm"):
        shm = shutil.disk_usage("/dev/shm")
        findings.append(
            Finding(
                "/dev/shm",
                f"{_gib(shm.total)}, {_gib(shm.free)} free",
                shm.total >= MIN_SHM,
                ""
                if shm.total >= MIN_SHM
                else "DataLoader workers hand batches over in /dev/shm: in Docker, run with --shm-size=8g "
                "(or --ipc=host)",
            )
        )
    return findings


def _torch() -> Finding:
    version = _version("torch")
    if version is None:
        return Finding("torch", "not installed", False, "pip install torch (the CPU wheel, or your CUDA build)")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Finding("torch", f"{version}, " + (f"{gpus} CUDA device(s)" if gpus else "no CUDA device"))


def _cache() -> Finding:
    where = default_cache_dir()
    free = shutil.disk_usage(_existing(where)).free
    return Finding(
        "cache dir",
        f"{where} ({_gib(free)} free){'' if where.exists() else ', not created yet'}",
        free >= MIN_CACHE_FREE,
        ""
        if free >= MIN_CACHE_FREE
        else "datasets read from object storage are cached here: set PACKER_CACHE_DIR (or cache_dir=) to a disk "
        "with room",
    )


def _optional() -> list[Finding]:
    findings = []
    for name, distribution, extra, what in OPTIONAL:
        version = _version(distribution)
        findings.append(
            Finding(name, version, True)
            if version
            else Finding(name, f"not installed: {what} needs pip install '{DISTRIBUTION}[{extra}]'", None)
        )
    return findings


def diagnose() -> list[Finding]:
    """Every finding, in the order ``packer doctor`` prints them."""
    return [
        Finding("packer", f"{__version__} ({DISTRIBUTION}, {Path(__file__).parents[1]})"),
        Finding("python", f"{platform.python_version()} ({sys.executable})"),
        _torch(),
        *_native(),
        *_codecs(),
        *_machine(),
        _cache(),
        *_optional(),
    ]


def as_dicts(findings: list[Finding]) -> list[dict[str, Any]]:
    """``packer doctor --json``'s rows."""
    return [asdict(f) for f in findings]
