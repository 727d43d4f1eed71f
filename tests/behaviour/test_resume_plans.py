"""A --resume continues exactly the plan its interrupted run made, or refuses; it never writes into
a data file that a complete dataset links to (issue 21's invariant, items 1-3); an interrupted
``packer compact`` leaves OUT whole and a staging folder packer recognizes as its own (item 9).

Every interruption here is a real ``packer build`` subprocess killed with SIGKILL once its staging
folder's journal shows progress (a checkpoint after every file). After it: a ShardDataset opened on
OUT beforehand still reads every record as it was, OUT verifies, and the dataset a resume completes
has the digest of a fresh build of the same inputs (or the resume fails in one line, touching nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer import build
from packer.builder.paths import lock_path
from packer.builder.staging import PROGRESS, staging_path
from packer.format import Manifest
from packer.read.reader import open_reader
from packer.tools.verify import verify

from .test_resume import interrupt

PACKER = [sys.executable, "-m", "packer.cli"]
BACKENDS = ["lmdb", "memmap"]
N = 300  # files: a build with a checkpoint after each one runs long enough to be caught mid-way


def paint(path: Path, number: int, shade: int = 0, size: tuple[int, int] = (40, 32)) -> None:
    """A flat image whose colour encodes its number (and ``shade``: a re-export with other pixels)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (40 + 80 * (number % 3), number % 256, 128 + shade)).save(path)


def source(raw: Path, number: int) -> Path:
    return raw / f"c{number % 3}" / f"m{number:03d}.png"


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    for number in range(N):
        paint(source(root, number), number)
    return root


def out_path(tmp_path: Path, backend: str, name: str = "d") -> Path:
    return tmp_path / (f"{name}.lmdb" if backend == "lmdb" else name)


def packer(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKER, *map(str, args)], capture_output=True, text=True, timeout=120)


def kill_mid_build(raw: Path, out: Path, *extra: str, at_least: int = 20) -> int:
    """Start ``packer build raw out *extra``, SIGKILL it (and its workers) once the journal holds
    ``at_least`` files; the number the last checkpoint had done."""
    proc = subprocess.Popen(
        [*PACKER, "build", str(raw), str(out), "--workers", "1", "--quiet", "--checkpoint-seconds", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    progress = staging_path(out) / PROGRESS
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if json.loads(progress.read_text())["sources_done"] >= at_least:
                    break
            if proc.poll() is not None:
                pytest.fail(f"the build ended (rc {proc.returncode}) before it was killed: {proc.communicate()[1]}")
            time.sleep(0.001)
        else:
            pytest.fail("no checkpoint appeared in the staging folder")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done = int(json.loads(progress.read_text())["sources_done"])
    assert done < N, "the build finished before it was killed"
    return done


def contents(out: Path) -> list[bytes]:
    """Every record's bytes, through a reader pinned now."""
    reader = open_reader(out)
    return [bytes(b) for b in reader.get_many(list(range(len(reader.index))))]


def fresh_digest(raw: Path, tmp_path: Path, backend: str) -> str:
    full = out_path(tmp_path, backend, "fresh")
    return build(raw, full, backend=backend, workers=1, quiet=True, force=True).digest


def check_complete(out: Path, raw: Path, tmp_path: Path, backend: str) -> None:
    """OUT verifies and is what a fresh build of raw/ writes, and no staging folder is left."""
    assert verify(out).ok
    assert Manifest.load(out).digest == fresh_digest(raw, tmp_path, backend)
    assert not staging_path(out).exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupted_update_resumed_after_files_changed_never_writes_into_the_live_dataset(
    raw: Path, tmp_path: Path, backend: str
) -> None:
    """Item 1: --update killed, then files touched (enough that a new plan would rewrite every
    record), then --update --resume, as the CLI advises. The resume keeps the interrupted run's
    layout; OUT and a reader opened on it before stay intact; the result equals a fresh build."""
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True)
    before = contents(out)
    reader = open_reader(out)
    for number in range(0, N, 7):
        paint(source(raw, number), number, shade=9, size=(44, 32))
    kill_mid_build(raw, out, "--update")
    for number in range(N // 2):  # now over a quarter of the old bytes would be dead
        paint(source(raw, number), number, shade=5, size=(48, 32))
    run = packer("build", raw, out, "--workers", "1", "--quiet", "--update", "--resume")
    assert run.returncode == 0, run.stderr
    assert [bytes(b) for b in reader.get_many(list(range(len(before))))] == before
    check_complete(out, raw, tmp_path, backend)
    run = packer("build", raw, out, "--update")
    assert run.returncode == 0 and "up to date" in run.stdout + run.stderr, run.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_of_a_force_build_as_an_update_refuses_and_touches_nothing(
    raw: Path, tmp_path: Path, backend: str
) -> None:
    """Item 2: --force killed, then --update --resume: its journal's rows point into files the forced
    build wrote, not into OUT's: refused in one line; then the forced build resumes to a fresh build's digest."""
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True)
    before = contents(out)
    paint(source(raw, 3), 3, shade=9)
    kill_mid_build(raw, out, "--force")
    run = packer("build", raw, out, "--update", "--resume")
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "cannot --resume" in run.stderr, run.stderr
    assert contents(out) == before and verify(out).ok
    run = packer("build", raw, out, "--workers", "1", "--quiet", "--force", "--resume")
    assert run.returncode == 0, run.stderr
    check_complete(out, raw, tmp_path, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_of_an_update_as_a_force_build_refuses_and_never_rewrites_the_live_files(
    raw: Path, tmp_path: Path, backend: str
) -> None:
    """Item 2, the other way: --update killed (its staging folder links OUT's data files), then
    --force --resume: refused in one line, OUT and a reader of it intact; --update --resume completes."""
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True)
    before = contents(out)
    reader = open_reader(out)
    for number in range(0, N, 5):
        paint(source(raw, number), number, shade=9, size=(44, 32))
    kill_mid_build(raw, out, "--update")
    run = packer("build", raw, out, "--force", "--resume")
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "cannot --resume" in run.stderr, run.stderr
    assert [bytes(b) for b in reader.get_many(list(range(len(before))))] == before
    assert contents(out) == before and verify(out).ok
    run = packer("build", raw, out, "--workers", "1", "--quiet", "--update", "--resume")
    assert run.returncode == 0, run.stderr
    assert [bytes(b) for b in reader.get_many(list(range(len(before))))] == before
    check_complete(out, raw, tmp_path, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_re_exported_after_it_was_journalled_is_decoded_again_by_resume(
    raw: Path, tmp_path: Path, backend: str
) -> None:
    """Item 3: a build killed, one of the files it had already packed re-exported in place (same
    path, other pixels), --resume: the resume notices the file's scan identity changed and decodes
    it again, so the dataset equals a fresh build; a later --update is then rightly up to date."""
    out = out_path(tmp_path, backend)
    done = kill_mid_build(raw, out, "--backend", backend)
    journalled = 3 * (done // 2)  # class c0 comes first in scan order: its (done // 2)-th file
    paint(source(raw, journalled), journalled, shade=60)
    run = packer("build", raw, out, "--backend", backend, "--workers", "1", "--quiet", "--resume")
    assert run.returncode == 0, run.stderr
    check_complete(out, raw, tmp_path, backend)
    run = packer("build", raw, out, "--backend", backend, "--update")
    assert run.returncode == 0 and "up to date" in run.stdout + run.stderr, run.stderr


#: (the killed build's option, the command after it): whether that command finishes (0) or refuses (1)
RERUNS = {
    ("--update", "--update --resume"): 0,
    ("--update", "--force --resume"): 1,  # its plan links OUT's files: a --force must not continue it
    ("--update", "--resume"): 1,  # OUT is built from other input than this plain --resume's
    ("--update", "--update"): 0,
    ("--update", "--force"): 0,
    ("--force", "--force --resume"): 0,
    ("--force", "--update --resume"): 1,  # its rows point into its own files, not OUT's
    ("--force", "--resume"): 1,
    ("--force", "--update"): 0,
    ("--force", "--force"): 0,
}


@pytest.mark.parametrize(("killed", "then"), list(RERUNS))
def test_every_rerun_of_an_interrupted_build_finishes_right_or_refuses_touching_nothing(
    raw: Path, tmp_path: Path, killed: str, then: str
) -> None:
    """The matrix behind items 1 and 2: a refresh or forced rebuild killed mid-journal, then each way to
    run it again (the backend alternates over the cases). A reader opened before keeps its bytes, OUT
    verifies; a refusal is one line and leaves OUT as it was, a finished build equals a fresh one."""
    backend = BACKENDS[list(RERUNS).index((killed, then)) % 2]
    out = out_path(tmp_path, backend)
    build(raw, out, backend=backend, workers=1, quiet=True)
    before, reader = contents(out), open_reader(out)
    for number in range(0, N, 4):
        paint(source(raw, number), number, shade=9, size=(44, 32))
    kill_mid_build(raw, out, killed)
    run = packer("build", raw, out, "--backend", backend, "--workers", "1", "--quiet", *then.split())
    assert run.returncode == RERUNS[killed, then], run.stderr
    assert [bytes(b) for b in reader.get_many(list(range(len(before))))] == before
    if run.returncode:
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("packer: error:"), run.stderr
        assert contents(out) == before and verify(out).ok
    else:
        check_complete(out, raw, tmp_path, backend)


def test_compact_over_an_interrupted_refresh_says_it_deletes_it(raw: Path, tmp_path: Path) -> None:
    """compact takes the staging folder of OUT: an interrupted --update's work there (links to OUT's
    files, which it unlinks, never writes) is deleted with a note; the --update --resume after it starts over."""
    out = out_path(tmp_path, "lmdb")
    build(raw, out, workers=1, quiet=True)
    before = contents(out)
    for number in range(0, N, 5):
        paint(source(raw, number), number, shade=9, size=(44, 32))
    kill_mid_build(raw, out, "--update")
    run = packer("compact", out)
    assert run.returncode == 0 and "deleting the interrupted build" in run.stderr, run.stderr
    assert contents(out) == before and verify(out).ok
    run = packer("build", raw, out, "--workers", "1", "--quiet", "--update", "--resume")
    assert run.returncode == 0, run.stderr
    check_complete(out, raw, tmp_path, "lmdb")


@pytest.fixture(scope="module")
def noisy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw-format dataset of 200 noise images (47 MB): big enough that a compact takes a while."""
    root = tmp_path_factory.mktemp("noisy")
    rng = np.random.default_rng(0)
    for number in range(200):
        path = root / "raw" / f"c{number % 2}" / f"m{number:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(path, compress_level=0)
    build(root / "raw", root / "d.lmdb", format="raw", workers=1, quiet=True)
    return root / "d.lmdb"


def start_compact(noisy: Path, tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """``packer compact`` of a copy of ``noisy``, once it is copying records into its staging folder."""
    out = tmp_path / "d.lmdb"
    shutil.copytree(noisy, out)
    proc = subprocess.Popen(
        [*PACKER, "compact", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C lands as in a terminal
    )
    data = staging_path(out) / "data.mdb"
    deadline = time.monotonic() + 60
    while not (data.is_file() and data.stat().st_size > 4 << 20):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"compact ended (rc {proc.returncode}) before it was interrupted: {proc.communicate()[1]}")
        time.sleep(0.001)
    return out, proc


def test_compact_killed_leaves_out_whole_and_a_folder_packer_takes_back(noisy: Path, tmp_path: Path) -> None:
    """Item 9: kill -9 mid-copy: OUT is the old version, whole; `packer compact` again finishes
    over the leftover staging folder, and after another kill `packer clean` deletes it (it is packer's)."""
    before = contents(noisy)
    out, proc = start_compact(noisy, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert staging_path(out).is_dir() and contents(out) == before and verify(out).ok
    run = packer("compact", out)
    assert run.returncode == 0 and not staging_path(out).exists(), run.stderr
    assert contents(out) == before and verify(out).ok
    shutil.rmtree(out)
    out, proc = start_compact(noisy, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    run = packer("clean", out)
    assert run.returncode == 0, run.stderr
    assert not out.exists() and not staging_path(out).exists() and not lock_path(out).exists()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_compact_interrupted_says_what_is_true_for_compact(noisy: Path, tmp_path: Path, how: str) -> None:
    """Item 9: Ctrl-C (the job) or SIGTERM (the process) mid-copy: exit 130/143, one line that says the
    dataset is whole and to run compact again (not a build's --resume), no traceback, OUT intact."""
    before = contents(noisy)
    out, proc = start_compact(noisy, tmp_path)
    interrupt(proc, how)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (130 if how == "ctrl-c" else 143), stderr
    assert stderr.splitlines() == [
        "packer: interrupted; the dataset is whole, compacted or as it was (run the same packer compact again)"
    ]
    assert contents(out) == before and verify(out).ok
    assert not staging_path(out).exists() or packer("clean", out).returncode == 0
