"""Interrupted builds for real: kill -9 and Ctrl-C of a running `packer build`, then --resume.

The build runs as a subprocess in its own process group (as a shell job would), with 2 workers and
checkpoints every 0.2 s, and is interrupted once its staging folder holds a checkpoint with some
records. Resuming must reuse that work and give the digest of an uninterrupted build. Also the
expected failures (read-only OUT, missing or empty raw/, disk full): one line, non-zero exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer import build
from packer.builder.staging import PROGRESS, staging_path
from packer.format import Manifest
from packer.tools.verify import verify

from ..conftest import BACKEND_NAMES

PACKER = [sys.executable, "-m", "packer.cli"]
N_IMAGES = 480


def interrupt(proc: subprocess.Popen, how: str) -> None:
    """Stop ``proc`` as a terminal's Ctrl-C does (SIGINT to its whole process group, the job) or as
    kill or a scheduler does (SIGTERM to the process alone)."""
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N_IMAGES varied 640x480 JPEGs in 3 classes (big enough that a 2-worker build takes a while),
    plus two bad files, so that the resumed report must not repeat or lose a line."""
    root = tmp_path_factory.mktemp("resume") / "raw"
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:480, 0:640]
    template = np.stack([x % 256, (y * 2) % 256, (x * y // 7) % 256], -1).astype(np.uint8)
    for i in range(N_IMAGES):
        pixels = np.roll(template, 5 * i, axis=1) + rng.integers(0, 24, template.shape, dtype=np.uint8)
        path = root / f"class{i % 3}" / f"img{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=85)
    (root / "class0" / "img0100.jpg").write_bytes(b"")  # replaced by an empty file: skipped
    (root / "class1" / "readme.txt").write_text("ignored")
    return root


@pytest.fixture(scope="module")
def reference(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted build; the digest covers labels and record bytes, so it is the same for both backends."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    build(raw, out, workers=2, quiet=True)
    return out


def _as_a_foreground_job() -> None:
    """SIGINT handled as in a terminal's job: a shell without job control starts background commands
    (``make test &``, nohup) with SIGINT ignored, and a child inherits that, so Ctrl-C would never land."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_build(raw: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        PACKER + ["build", str(raw), str(out), "--workers", "2", "--quiet", "--checkpoint-seconds", "0.2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_foreground_job,
    )


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 60) -> int:
    """Poll until the staging folder has a checkpoint with some (not all) sources done; return that count."""
    progress = staging_path(out) / PROGRESS
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"the build ended (rc {proc.returncode}) before it could be interrupted: "
                f"make the test images bigger\n{proc.stderr.read() if proc.stderr else ''}"
            )
        with contextlib.suppress(OSError, ValueError):
            done = json.loads(progress.read_text())["sources_done"]
            if done > 0:
                return done
        time.sleep(0.02)
    pytest.fail("no checkpoint appeared in the staging folder")


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state"


def group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) whose process group is ``pgid``, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry.name))
    return pids


def check_resumed(raw: Path, out: Path, reference: Path, backend: str) -> None:
    report = build(raw, out, backend=backend, workers=2, quiet=True, resume=True)
    assert report.resumed_from > 0, "--resume started over instead of reusing the checkpoint"
    ref = Manifest.load(reference)
    assert report.digest == ref.digest
    m = Manifest.load(out)
    assert (m.count, m.scanned, m.skipped, m.ignored) == (ref.count, ref.scanned, ref.skipped, ref.ignored)
    assert (out / "report.jsonl").read_bytes() == (reference / "report.jsonl").read_bytes()
    assert verify(out).ok
    assert not staging_path(out).exists()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_kill_9_then_resume_gives_the_same_digest(raw: Path, reference: Path, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "out"
    proc = start_build(raw, out, "--backend", backend)
    done = wait_for_checkpoint(proc, out)
    os.killpg(proc.pid, signal.SIGKILL)  # the build, its workers, any helper: like a power cut for them
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < done < N_IMAGES
    assert not out.exists(), "a killed build must leave nothing at OUT"
    assert (staging_path(out) / PROGRESS).is_file()
    check_resumed(raw, out, reference, backend)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupt_exits_cleanly_leaves_no_output_no_processes_and_resumes(
    raw: Path, reference: Path, tmp_path: Path, how: str
) -> None:
    """Ctrl-C goes to the whole foreground job (exit 130); SIGTERM (kill, a scheduler) to the build
    process alone (exit 143), which must stop its workers itself."""
    out = tmp_path / "out.lmdb"
    proc = start_build(raw, out)
    wait_for_checkpoint(proc, out)
    interrupt(proc, how)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (130 if how == "ctrl-c" else 143), stderr
    assert "interrupted" in stderr and "--resume" in stderr and "Traceback" not in stderr
    assert not out.exists()
    assert staging_path(out).is_dir(), "the staging folder (the work so far) must be kept for --resume"
    deadline = time.monotonic() + 10
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(proc.pid) == [], "worker processes outlived the interrupted build"
    check_resumed(raw, out, reference, "lmdb")


def test_overlapping_builds_are_refused_and_kill_9_of_the_holder_leaves_no_stale_lock(
    raw: Path, reference: Path, tmp_path: Path
) -> None:
    """Cron overlapping itself: a second --update, or a --resume, beside a live build fails at once
    naming it and touches nothing of its staging; once the live build is killed (the build process
    alone: its workers may outlive it for a moment), --resume takes over its work at once."""
    out = tmp_path / "out.lmdb"
    proc = start_build(raw, out)
    wait_for_checkpoint(proc, out)
    os.killpg(proc.pid, signal.SIGSTOP)  # live, holding its lock, but it cannot finish meanwhile
    journal = staging_path(out) / "index.part"
    for extra in (["--update"], ["--resume"], ["--force"]):
        size = journal.stat().st_size
        run = subprocess.run(PACKER + ["build", str(raw), str(out), *extra], capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and run.stderr.strip() == f"packer: error: {out} is being built by pid {proc.pid}"
        assert journal.stat().st_size >= size, "the refused build touched the live build's journal"
    os.killpg(proc.pid, signal.SIGCONT)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    check_resumed(raw, out, reference, "lmdb")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any worker that outlived its build


def test_resume_refuses_changed_options(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_build(raw, out)
    wait_for_checkpoint(proc, out)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    run = subprocess.run(
        PACKER + ["build", str(raw), str(out), "--resume", "--quality", "80"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "cannot --resume" in run.stderr and "Traceback" not in run.stderr


def one_line_error(args: list[str], *needles: str) -> None:
    """The CLI fails with exit 1 and one 'packer: error:' line; with --debug the traceback shows."""
    run = subprocess.run(PACKER + args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("packer: error:"), run.stderr
    for needle in needles:
        assert needle in lines[0]
    debug = subprocess.run(PACKER + ["--debug"] + args, capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_raw_missing_or_empty(tmp_path: Path) -> None:
    one_line_error(["build", str(tmp_path / "nope"), str(tmp_path / "out")], "does not exist")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    one_line_error(["build", str(tmp_path / "empty"), str(tmp_path / "out")], "no images found")
    assert not (tmp_path / "out").exists()


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A real small or read-only filesystem (needs root and a mount-capable container, else skip)."""
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to simulate it ({mount.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_output_on_a_read_only_filesystem(raw: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        one_line_error(
            ["build", str(raw), str(ro / "out.lmdb")], "cannot write beside the output", "Read-only file system"
        )


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_disk_full_then_resume_after_freeing_space(raw: Path, reference: Path, tmp_path: Path, backend: str) -> None:
    with tmpfs(tmp_path / "small", "size=2m") as small:
        out = small / "out"
        args = [
            "build",
            str(raw),
            str(out),
            "--backend",
            backend,
            "--workers",
            "2",
            "--quiet",
            "--checkpoint-seconds",
            "0",
        ]
        one_line_error(args, "disk full?", "--resume")
        assert not out.exists()
        subprocess.run(["mount", "-o", "remount,size=256m", str(small)], check=True)  # "free some space"
        check_resumed(raw, out, reference, backend)


def test_a_worker_killed_mid_build_loses_nothing(raw: Path, reference: Path, tmp_path: Path) -> None:
    """The OOM killer (or a decoder crash) takes one worker process: the pool is replaced, the lost
    chunk's files are decoded again one by one, and the build ends normally with the same digest."""
    out = tmp_path / "out.lmdb"
    proc = start_build(raw, out)
    wait_for_checkpoint(proc, out)
    # the workers are the fork server's children; the build's own are the fork server and resource tracker
    workers = [pid for pid in group_members(proc.pid) if pid != proc.pid and parent(pid) != proc.pid]
    assert workers, "no worker processes to kill"
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    m, ref = Manifest.load(out), Manifest.load(reference)
    assert (m.digest, m.count, m.skipped) == (ref.digest, ref.count, ref.skipped)
