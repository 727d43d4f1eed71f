"""The nightly-refresh recipe, for real: overlapping builds, retried jobs, a symlinked OUT, special files
and signals, unreadable folders, a closed output pipe, `packer clean`, and thread-safe decoding.

Builds run as real `python -m packer.cli` processes on real LMDB/memmap datasets of small generated
JPEGs; a lock held "by another build" is held by a real process (this one, or a child).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import unicodedata
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packer import build
from packer.builder.options import BuildOptions
from packer.builder.paths import build_lock, lock_path
from packer.builder.preprocess import Record, Skip, process
from packer.builder.staging import staging_path
from packer.format import Manifest
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]


def jpeg(path: Path, seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A small varied JPEG at ``path`` (parents created); returns its bytes."""
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def make_raw(root: Path, classes: tuple[str, ...] = ("a", "b", "c"), per_class: int = 4, seed: int = 0) -> Path:
    for k, cls in enumerate(classes):
        for i in range(per_class):
            jpeg(root / cls / f"img{i}.jpg", seed * 1000 + k * 100 + i)
    return root


def packer(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PACKER, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def report_lines(out: Path) -> dict[str, dict]:
    lines = (out / "report.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["path"]: r for r in map(json.loads, lines)}


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    return make_raw(tmp_path / "raw")


# ------------------------------------------------------------------------------ one build per OUT


@pytest.mark.parametrize(
    "extra",
    [[], ["--update"], ["--resume"], ["--force"], ["--split", "val=0.3"], ["--dask", "local", "--workers", "1"]],
)
def test_a_second_build_of_the_same_out_fails_at_once_naming_the_holder(
    raw: Path, tmp_path: Path, extra: list[str]
) -> None:
    out = tmp_path / "out.lmdb"
    with build_lock(out):  # this process is "the build already running"
        t0 = time.monotonic()
        run = packer("build", raw, out, "--quiet", *extra)
        took = time.monotonic() - t0
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == f"packer: error: {out} is being built by pid {os.getpid()}"
    assert took < 20  # an interpreter start and imports, no work
    assert not out.exists() and not staging_path(out).exists()
    assert not lock_path(out).exists(), "the holder removes its lock file on release"


def test_split_datasets_inside_out_are_locked_too(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "splits"
    with build_lock(out / "val.lmdb"):  # e.g. a plain build of OUT/val.lmdb is running
        run = packer("build", raw, out, "--backend", "lmdb", "--split", "val=0.3", "--quiet")
    assert run.returncode == 1 and f"{out / 'val.lmdb'} is being built by pid {os.getpid()}" in run.stderr


HOLD = """
import sys, time
from pathlib import Path
from packer.builder.paths import build_lock
with build_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_wait_waits_for_the_holder_and_kill_9_leaves_no_stale_lock(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        refused = packer("build", raw, out, "--update", "--quiet")
        assert refused.returncode == 1
        assert refused.stderr.strip() == f"packer: error: {out} is being built by pid {holder.pid}"

        # --wait blocks on the lock; SIGTERM still stops it at once
        waiting = subprocess.Popen(
            [*PACKER, "build", str(raw), str(out), "--update", "--wait"], stderr=subprocess.PIPE, text=True
        )
        assert waiting.stderr is not None and f"waiting for pid {holder.pid}" in waiting.stderr.readline()
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=10) == 143

        waiting = subprocess.Popen(
            [*PACKER, "build", str(raw), str(out), "--update", "--wait", "--quiet"], stderr=subprocess.PIPE, text=True
        )
        time.sleep(1.0)
        assert waiting.poll() is None, "--wait must wait while the lock is held"
        holder.kill()  # kill -9: the kernel drops the lock with the process
        holder.wait()
        _, stderr = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, stderr
    finally:
        holder.kill()
        holder.wait()
    assert verify(out).ok and Manifest.load(out).count == 12
    assert not lock_path(out).exists()


# ------------------------------------------------------------------------------ --resume idempotent


def test_resume_of_a_finished_build_says_so_and_exits_0(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    assert packer("build", raw, out, "--quiet").returncode == 0
    before = (out / "data.mdb").stat()
    again = packer("build", raw, out, "--resume")
    assert again.returncode == 0, again.stderr
    assert "is up to date" in again.stderr and "nothing to do" in again.stderr
    after = (out / "data.mdb").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    split = tmp_path / "splits"
    assert packer("build", raw, split, "--split", "val=0.3", "--quiet").returncode == 0
    retried = packer("build", raw, split, "--split", "val=0.3", "--resume")
    assert retried.returncode == 0 and retried.stderr.count("is up to date") == 2, retried.stderr

    other = make_raw(tmp_path / "other", classes=("x", "y"), seed=5)
    wrong = packer("build", other, out, "--resume")
    assert wrong.returncode == 1
    assert wrong.stderr.strip() == (
        f"packer: error: {out} is a complete dataset built from other input or "
        f"options than this --resume (use --update to refresh it, or --force to "
        f"replace it)"
    )
    assert verify(out).ok and Manifest.load(out).classes == ["a", "b", "c"]


# ------------------------------------------------------------------------------ OUT is a symlink


def test_a_symlinked_out_is_refreshed_behind_the_link_night_after_night(raw: Path, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "big").mkdir()
    target = tmp_path / "big" / "train-v1"  # the target's name need not end in .lmdb: the link's does
    link = tmp_path / "data" / "train.lmdb"
    link.symlink_to(target)  # dangling at first: the first night builds the target
    for night, args in enumerate([["--update"], ["--update"], ["--force"], ["--update"]]):
        jpeg(raw / "a" / f"new{night}.jpg", 900 + night)
        run = packer("build", raw, link, "--quiet", *args)
        assert run.returncode == 0, (night, run.stderr)
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.lmdb"]
        assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["train-v1"]
        m = Manifest.load(link)
        assert (m.backend, m.count) == ("lmdb", 13 + night)
        checked = packer("verify", link)  # a fresh process each night (this one's LMDB handles are the read side's)
        assert checked.returncode == 0, checked.stderr
    up_to_date = packer("build", raw, link, "--update")
    assert up_to_date.returncode == 0 and "is up to date" in up_to_date.stderr
    with build_lock(target):  # a build that names the target directly holds the same lock
        run = packer("build", raw, link, "--update")
    assert run.returncode == 1 and f"{target} is being built by pid {os.getpid()}" in run.stderr


# ------------------------------------------------------------------------------ special files, signals


def test_special_files_behind_image_symlinks_are_ignored_never_opened(raw: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (raw / "a" / "fifo.jpg").symlink_to(tmp_path / "fifo")
    (raw / "a" / "zero.jpg").symlink_to("/dev/zero")
    os.mkfifo(raw / "b" / "pipe.png")
    (raw / "b" / "gone.jpg").symlink_to(tmp_path / "nothing-here.jpg")
    out = tmp_path / "out"
    run = packer("build", raw, out, "--update", "--checksum", "--quiet", timeout=60)
    assert run.returncode == 0, run.stderr
    report = report_lines(out)
    assert report["a/fifo.jpg"] == {
        "path": "a/fifo.jpg",
        "status": "ignored",
        "reason": "not a regular file (symlink to a FIFO)",
    }
    assert report["a/zero.jpg"]["reason"] == "not a regular file (symlink to a character device)"
    assert report["b/pipe.png"]["reason"] == "not a regular file (FIFO)"
    assert report["b/gone.jpg"] == {
        "path": "b/gone.jpg",
        "status": "skipped",
        "reason": "unreadable: No such file or directory",
    }
    m = Manifest.load(out)
    assert (m.count, m.skipped, m.ignored) == (12, 1, 3) and m.scanned == m.count + m.skipped + m.ignored


def test_a_file_swapped_for_a_fifo_after_the_scan_is_skipped_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "late.jpg")
    result = process(str(tmp_path / "late.jpg"), BuildOptions().preprocess)
    assert result == Skip("unreadable: not a regular file")


def open_files(pid: int) -> list[str]:
    fds = Path(f"/proc/{pid}/fd")
    names = []
    for fd in fds.iterdir() if fds.is_dir() else []:
        try:
            names.append(os.readlink(fd))
        except OSError:
            pass
    return names


def test_sigterm_while_checksum_hashes_large_files_stops_within_seconds(raw: Path, tmp_path: Path) -> None:
    for i in range(2):  # sparse: 16 GiB each to hash, nothing on disk
        with open(raw / "c" / f"huge{i}.jpg", "wb") as f:
            f.truncate(16 << 30)
    out = tmp_path / "out.lmdb"
    proc = subprocess.Popen(
        [*PACKER, "build", str(raw), str(out), "--update", "--checksum", "--quiet"], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not any("huge" in name for name in open_files(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started hashing"
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 143 and "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert took < 5, f"SIGTERM took {took:.1f} s to stop the hashing"
    assert not out.exists() and not lock_path(out).exists()


# ------------------------------------------------------------------------------ unreadable folders


def test_an_unreadable_class_folder_fails_the_refresh_and_never_renumbers_classes(tmp_path: Path) -> None:
    """Root reads any folder whatever its mode, so the folder is made unreadable by a path that is too
    long (ENAMETOOLONG from stat and scandir, for any user): the same tree is readable through a short
    symlink and has one unreadable class folder when named by its long path."""
    deep = tmp_path
    while len(str(deep)) < 3880:
        deep /= "d" * 200
    deep = deep.parent if len(str(deep)) > 3890 else deep
    deep.mkdir(parents=True)
    short = tmp_path / "raw"
    short.symlink_to(deep)
    long_name = "b" + "x" * (4100 - len(str(deep)))  # deep/long_name passes PATH_MAX
    make_raw(short, classes=("a", long_name, "c"))
    out = tmp_path / "out"
    assert packer("build", short, out, "--quiet").returncode == 0
    classes = Manifest.load(out).classes
    assert classes == ["a", long_name, "c"]

    failed = packer("build", deep, out, "--update", "--quiet")
    assert failed.returncode == 1
    assert failed.stderr.startswith(f"packer: error: {deep / long_name}: unreadable directory (File name too long)")
    assert "--on-error skip" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    assert Manifest.load(out).class_counts == [4, 4, 4], "OUT must be untouched"

    skipped = packer("build", deep, out, "--update", "--on-error", "skip", "--quiet")
    assert skipped.returncode == 0, skipped.stderr
    m = Manifest.load(out)
    assert m.classes == classes and m.class_counts == [4, 0, 4], "class ids must not shift"
    assert report_lines(out)[f"{long_name}/"]["reason"] == "unreadable directory (File name too long)"
    assert m.scanned == m.count + m.skipped + m.ignored


def test_a_refresh_that_renumbers_classes_says_so(raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    build(raw, out, workers=1, quiet=True)
    for f in (raw / "a").iterdir():
        f.unlink()
    (raw / "a").rmdir()
    build(raw, out, workers=1, update=True)
    assert "packer: warning: class ids change from those of" in capsys.readouterr().err
    assert Manifest.load(out).classes == ["b", "c"]


def test_class_names_equal_but_for_normalization_or_case_warn(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    nfc, nfd = unicodedata.normalize("NFC", "Café"), unicodedata.normalize("NFD", "Café")
    raw = make_raw(tmp_path / "raw", classes=(nfc, nfd, "cats", "Cats"))
    build(raw, tmp_path / "out", workers=1)
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    why = "differ only in Unicode normalization or case: they are two classes"
    assert warned == [
        f"packer: warning: class names {nfd!r} and {nfc!r} {why}",  # in class order
        f"packer: warning: class names {'Cats'!r} and {'cats'!r} {why}",
    ]


# ------------------------------------------------------------------------------ CLI hygiene


def test_info_into_a_closed_pipe_ends_quietly(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    proc = subprocess.Popen([*PACKER, "info", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and stderr == ""
    head = subprocess.run(["bash", "-c", f"{' '.join(PACKER)} info {out} | head -n 1"], capture_output=True, text=True)
    assert head.returncode == 0 and head.stderr == "" and head.stdout.startswith(str(out))


def test_clean_deletes_only_packer_datasets_and_their_build_folders(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    build(raw, out, workers=1, quiet=True)
    staging_path(out).mkdir()
    (staging_path(out) / "build.json").write_text("{}")
    (tmp_path / ".out.lmdb.packer-old").mkdir()
    (tmp_path / "out.lmdb.backup").mkdir()
    (tmp_path / "notes.txt").write_text("keep")

    with build_lock(out):
        busy = packer("clean", out)
    assert busy.returncode == 1 and "is being built by pid" in busy.stderr and out.exists()

    done = packer("clean", out)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out.lmdb.backup", "raw"]

    for victim in (tmp_path / "raw", tmp_path / "out.lmdb.backup", tmp_path / "notes.txt", tmp_path):
        refused = packer("clean", victim)
        assert refused.returncode == 1 and "refusing to delete it" in refused.stderr, victim
    assert (raw / "a" / "img0.jpg").is_file() and (tmp_path / "notes.txt").is_file()

    split = tmp_path / "splits"
    build(raw, split, workers=1, quiet=True, split={"val": 0.3}, backend="lmdb")
    (split / "mine.txt").write_text("not packer's")
    assert packer("clean", split).returncode == 1 and split.is_dir()
    (split / "mine.txt").unlink()
    assert packer("clean", split).returncode == 0 and not split.exists()

    nothing = packer("clean", tmp_path / "no" / "such.lmdb")
    assert nothing.returncode == 0 and "nothing to delete" in nothing.stderr and not (tmp_path / "no").exists()

    target, link = tmp_path / "elsewhere", tmp_path / "link.lmdb"
    build(raw, target, workers=1, quiet=True)
    link.symlink_to(target)
    assert packer("clean", link).returncode == 0
    assert not target.exists() and not link.is_symlink()


# ------------------------------------------------------------------------------ decoding in threads


def test_damaged_jpegs_are_skipped_by_every_thread_whatever_the_others_do(tmp_path: Path) -> None:
    """A Dask worker runs tasks in threads beside other code; warnings filters are process-wide. Damage
    must be detected per call: threads decode good and truncated files while another thread keeps
    resetting the warnings filters."""
    good, bad = [], []
    for i in range(8):
        data = jpeg(tmp_path / f"good{i}.jpg", i, size=(400, 300))
        good.append(str(tmp_path / f"good{i}.jpg"))
        (tmp_path / f"bad{i}.jpg").write_bytes(data[: len(data) * 2 // 3])
        bad.append(str(tmp_path / f"bad{i}.jpg"))
    stop = threading.Event()

    def meddle() -> None:
        while not stop.is_set():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                time.sleep(0.0005)

    meddler = threading.Thread(target=meddle)
    meddler.start()
    try:
        paths = (good + bad) * 25
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: process(p, BuildOptions(short_edge=64).preprocess), paths))
    finally:
        stop.set()
        meddler.join()
    for path, result in zip(paths, results):
        if "bad" in path:
            assert isinstance(result, Skip) and "corrupt JPEG data" in result.reason, (path, result)
        else:
            assert isinstance(result, Record), (path, result)


def test_pillows_bomb_guard_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing and running packer's build leaves Pillow's process-wide limit as it was; packer's own
    --max-pixels governs its decodes."""
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from PIL import Image; before = Image.MAX_IMAGE_PIXELS; "
                "import packer.builder.pipeline, packer.builder.dask; print(Image.MAX_IMAGE_PIXELS == before)"
            ),
        ],
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "True", check.stderr
    path = tmp_path / "photo.jpg"
    jpeg(path, 1, size=(400, 300))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # someone else's strict limit, in this process
    assert isinstance(process(str(path), BuildOptions().preprocess), Record)
    result = process(str(path), BuildOptions(max_pixels=100_000).preprocess)
    assert isinstance(result, Skip) and result.reason.startswith("decompression bomb guard")
    with pytest.raises(Image.DecompressionBombError):
        Image.open(path)  # still in force for everyone else
    assert Image.MAX_IMAGE_PIXELS == 1000


# ------------------------------------------------------------------------------ refreshes that renumber classes


def test_on_class_change_fail_stops_a_refresh_that_would_renumber_classes(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.lmdb"
    assert packer("build", raw, out, "--quiet").returncode == 0
    before = (out / "manifest.json").read_bytes()
    jpeg(raw / "0new" / "x.jpg", 7)  # sorts first: a 0 -> 1, b 1 -> 2, c 2 -> 3
    for args in (["--on-class-change", "fail"], ["--on-error", "fail"]):  # the second: fail by default
        run = packer("build", raw, out, "--update", *args)
        assert run.returncode == 1, run.stderr
        assert run.stderr.startswith(f"packer: error: class ids change from those of {out}: 'a' 0 -> 1, 'b' 1 -> 2")
        assert "--classes" in run.stderr and len(run.stderr.strip().splitlines()) == 1
        assert (out / "manifest.json").read_bytes() == before
    (raw / "0new" / "x.jpg").rename(raw / "0new" / "y.jpg")
    (raw / "0new").rename(raw / "z")  # a class added after the others shifts nobody
    assert packer("build", raw, out, "--update", "--on-class-change", "fail", "--quiet").returncode == 0
    assert Manifest.load(out).classes == ["a", "b", "c", "z"]
    jpeg(raw / "0new" / "x.jpg", 8)
    warned = packer("build", raw, out, "--update", "--on-class-change", "warn")
    assert warned.returncode == 0 and "packer: warning: class ids change from those of" in warned.stderr
    assert Manifest.load(out).classes == ["0new", "a", "b", "c", "z"]


# ------------------------------------------------------------------------------ builds that pack nothing


def test_a_script_without_the_main_guard_fails_clearly_and_keeps_out(raw: Path, tmp_path: Path) -> None:
    """Forkserver workers import the main module again: without the guard each one runs the script's
    build, which fails on OUT's lock, so every worker dies before it serves a file."""
    out = tmp_path / "out.lmdb"
    assert packer("build", raw, out, "--quiet").returncode == 0
    before = (out / "manifest.json").read_bytes()
    call = f"packer.build({str(raw)!r}, {str(out)!r}, force=True, workers=2, quiet=True)"
    script = tmp_path / "unguarded.py"
    script.write_text(f"import packer\n{call}\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("packer.errors.BuildError: a decoding worker process exited while starting (status 1)")
    assert 'if __name__ == "__main__":' in last
    assert (out / "manifest.json").read_bytes() == before and verify(out).ok
    script.write_text(f"import packer\nif __name__ == '__main__':\n    {call}\n")
    guarded = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert guarded.returncode == 0, guarded.stderr
    assert Manifest.load(out).count == 12 and verify(out).ok


def test_a_build_that_packs_nothing_fails_and_keeps_out_unless_allowed(raw: Path, tmp_path: Path) -> None:
    out, bad = tmp_path / "out", tmp_path / "bad"
    assert packer("build", raw, out, "--quiet").returncode == 0
    before = (out / "manifest.json").read_bytes()
    for i in range(3):
        (bad / "a").mkdir(parents=True, exist_ok=True)
        (bad / "a" / f"{i}.jpg").write_bytes(b"not a jpeg")
    run = packer("build", bad, out, "--force", "--quiet")
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("packer: error: packed 0 of 3 files: every one was skipped (the first, a/0.jpg: ")
    assert f"{out} is left as it was (pass --allow-empty" in run.stderr
    assert (out / "manifest.json").read_bytes() == before
    allowed = packer("build", bad, out, "--force", "--allow-empty", "--quiet")
    assert allowed.returncode == 0, allowed.stderr
    m = Manifest.load(out)
    assert (m.count, m.skipped) == (0, 3) and verify(out).ok


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_pool_whose_workers_keep_dying_fails_the_build(tmp_path: Path) -> None:
    """Every decoding process is SIGKILLed the moment it opens an image (a decoder that crashes on
    everything, an OOM killer that never stops): after CRASH_LIMIT files the build fails, OUT untouched."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    rng = np.random.default_rng(0)
    for i in range(10):  # PNGs of noise take tens of milliseconds to decode: the kill comes first
        (raw / "a").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (1000, 1000, 3), dtype=np.uint8)).save(raw / "a" / f"{i}.png")
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert watch >= 0 and libc.inotify_add_watch(watch, os.fsencode(raw / "a"), 0x20) >= 0  # IN_OPEN
    args = [*PACKER, "build", str(raw), str(out), "--workers", "2", "--quiet"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    killed = 0
    try:
        while proc.poll() is None:
            if select.select([watch], [], [], 0.05)[0]:
                os.read(watch, 1 << 16)
                for server in _children(proc.pid):  # the fork server; the workers are its children
                    for worker in _children(server):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(worker, signal.SIGKILL)
                            killed += 1
        _, stderr = proc.communicate(timeout=120)
    finally:
        os.close(watch)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and killed >= 8, stderr
    assert stderr.startswith("packer: error: the decoding worker processes keep dying: each of the first 8 files"), (
        stderr
    )
    assert not out.exists()
