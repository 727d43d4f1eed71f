"""Random sequences of build / --update / --force / --resume / compact / file edits / kill -9, on both
backends (issue 21, "Done when"), each step a real ``packer`` subprocess, some killed with SIGKILL at a
random moment or once their journal shows progress. After every step:

- OUT, when there is one, verifies, and its digest is that of a fresh build of the inputs its manifest
  says it was built from (a fresh build of every input state is made, and cached, as the state appears);
- a step that succeeded left the dataset of the inputs as they are now (a build) or as they were (compact);
- every reader opened on an earlier version still reads its own version's bytes;
- nothing beside the dataset changed (a sibling folder's hash), and nothing else appeared there;
- a step that failed said so in one line (one of the expected refusals), never a traceback.

The default suite runs a few short sequences. More: ``PACKER_STATE_STEPS=200 PACKER_STATE_SEEDS=1,2,3,4
python -m pytest tests/behaviour/test_state_machine.py`` (steps per sequence; seeds, one sequence per seed and backend).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from packer import build
from packer.backends import Reader
from packer.builder.paths import lock_path
from packer.builder.staging import PROGRESS, old_path, staging_path
from packer.format import MANIFEST, Manifest
from packer.read.reader import open_reader
from packer.tools.verify import verify

PACKER = [sys.executable, "-m", "packer.cli"]
STEPS = int(os.environ.get("PACKER_STATE_STEPS", "20"))
SEEDS = [int(s) for s in os.environ.get("PACKER_STATE_SEEDS", "1,2").split(",")]
SHARD_SIZE = 7  # several memmap shards per segment
#: the one-line refusals a random step may meet (stderr "packer: error: ...")
REFUSALS = (
    "already exists (use --force",  # a plain build over OUT
    "cannot --resume",  # the interrupted build's plan is not this command's
    "built from other input or options than this --resume",
    "no such dataset",  # compact without OUT
    "not a packer dataset",
)


def paint(path: Path, number: int, shade: int, width: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, 24), (40 + 80 * (number % 3), (7 * number) % 256, shade)).save(path)


def tree_hash(root: Path) -> str:
    """Names, sizes, mtimes and bytes of everything under ``root``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def records(reader: Reader) -> list[bytes]:
    return [bytes(b) for b in reader.get_many(list(range(len(reader.index))))]


@dataclass
class Machine:
    """One random sequence: raw/ with files c<k>/m<nnn>.png, OUT, a sibling folder, and what was seen."""

    root: Path
    backend: str
    rng: random.Random
    files: dict[int, tuple[int, int]] = field(default_factory=dict)  # number -> (shade, width)
    fresh: dict[str, str] = field(default_factory=dict)  # manifest inputs -> digest of a fresh build
    readers: list[tuple[Reader, list[bytes]]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.raw, self.sibling = self.root / "raw", self.root / "sibling"
        self.out = self.root / ("d.lmdb" if self.backend == "lmdb" else "d")
        for number in range(36):
            self.write(number, 128, 32)
        self.sibling.mkdir()
        (self.sibling / "notes.txt").write_text("not packer's")
        shutil.copytree(self.raw / "c0", self.sibling / "c0")
        self.sibling_hash = tree_hash(self.sibling)
        self.now = self.fresh_build()

    def write(self, number: int, shade: int, width: int) -> None:
        paint(self.raw / f"c{number % 3}" / f"m{number:03d}.png", number, shade, width)
        self.files[number] = (shade, width)

    def fresh_build(self) -> str:
        """A fresh build of raw/ as it is now (in this process, into a scratch folder): its inputs."""
        scratch = self.root / "fresh" / self.out.name
        report = build(self.raw, scratch, backend=self.backend, shard_size=SHARD_SIZE, workers=0, quiet=True)
        inputs = Manifest.load(scratch).inputs
        self.fresh[inputs] = report.digest
        shutil.rmtree(self.root / "fresh")
        return inputs

    def edit(self) -> None:
        """Add a file, re-export one in place (other pixels and size, same path), or delete one."""
        how = self.rng.choice(["add", "rewrite", "rewrite", "delete"] if len(self.files) > 20 else ["add", "rewrite"])
        number = self.rng.choice(sorted(self.files))
        if how == "add":
            number = self.rng.choice([max(self.files) + 1, min(set(range(max(self.files) + 2)) - set(self.files))])
            self.write(number, self.rng.randrange(256), self.rng.choice([24, 32, 40]))
        elif how == "rewrite":
            time.sleep(0.002)  # a new mtime even on a coarse clock
            self.write(number, self.rng.randrange(256), self.rng.choice([24, 32, 40]))
        else:
            (self.raw / f"c{number % 3}" / f"m{number:03d}.png").unlink()
            del self.files[number]
        self.log.append(f"edit {how} {number}")
        self.now = self.fresh_build()

    def run(self, args: list[str], label: str, kills: list[str]) -> tuple[int, str]:
        """``packer *args``, killed with SIGKILL (and its workers) as ``kills`` (one drawn) says: "none",
        after a random "moment", or once its journal holds a random number of files ("progress");
        its exit status and stderr."""
        proc = subprocess.Popen(
            [*PACKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        kill = self.rng.choice(kills)
        if kill == "moment":
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.rng.uniform(0.1, 0.6))
        elif kill == "progress":
            at, progress = self.rng.randrange(1, len(self.files) // 2), staging_path(self.out) / PROGRESS
            while proc.poll() is None:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    if json.loads(progress.read_text())["sources_done"] >= at:
                        break
                time.sleep(0.001)
        if kill != "none":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        self.log.append(f"{label} kill={kill} -> {proc.returncode}")
        return proc.returncode, stderr

    def step(self) -> None:
        """An edit or a command. Weighted towards what breaks: after an interrupted build, files
        change under its journal, then a --resume of either kind (mostly left to finish)."""
        interrupted = (staging_path(self.out) / PROGRESS).is_file()
        if self.rng.random() < 0.3:
            self.edit()
        elif interrupted:
            mode = self.rng.choice(["--resume", "--update --resume", "--update --resume", "--force --resume"])
            self.operate(mode, compacting=False, kills=["none", "none", "moment", "progress"])
        else:
            mode = self.rng.choice(["", "--update", "--update", "--update", "--force", "--force", "--resume"])
            compacting = (self.out / MANIFEST).is_file() and self.rng.random() < 0.1
            self.operate(mode, compacting, kills=["none", "moment", "progress", "progress"])

    def operate(self, mode: str, compacting: bool, kills: list[str]) -> None:
        """``packer compact`` or ``packer build`` with ``mode``'s options, then every check."""
        before = Manifest.load(self.out) if (self.out / MANIFEST).is_file() else None
        if compacting:
            args = ["compact", str(self.out)]
        else:
            args = ["build", str(self.raw), str(self.out), "--backend", self.backend, "--shard-size", str(SHARD_SIZE)]
            args += ["--workers", "1", "--quiet", "--checkpoint-seconds", "0", *mode.split()]
        rc, stderr = self.run(args, "compact" if compacting else f"build {mode}", kills)
        assert "Traceback" not in stderr, stderr
        if rc == 1:
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and any(r in lines[0] for r in REFUSALS), stderr
        else:
            assert rc in (0, -signal.SIGKILL), stderr
        after = Manifest.load(self.out) if (self.out / MANIFEST).is_file() else None
        if rc == 0 and compacting:
            assert before is not None and after is not None and after.digest == before.digest
        elif rc == 0:
            assert after is not None and after.inputs == self.now, "a finished build left other inputs"
        if rc != -signal.SIGKILL and before is not None:
            assert after is not None, "a command that was not killed lost the dataset"
        self.check()

    def check(self) -> None:
        if (self.out / MANIFEST).is_file():
            m = Manifest.load(self.out)
            result = verify(self.out)
            assert result.ok, result.problems
            assert m.inputs in self.fresh, "OUT claims inputs no state of raw/ had"
            assert m.digest == self.fresh[m.inputs], "OUT differs from a fresh build of the inputs it claims"
            if self.rng.random() < 0.5:
                reader = open_reader(self.out)
                self.readers = [*self.readers[-2:], (reader, records(reader))]
        else:
            assert not self.out.exists(), "OUT is there but not a complete dataset"
        for reader, seen in self.readers:
            assert records(reader) == seen, "a reader of an earlier version reads other bytes"
        assert tree_hash(self.sibling) == self.sibling_hash, "a file beside the dataset changed"
        allowed = {self.raw, self.sibling, self.out, staging_path(self.out), lock_path(self.out), old_path(self.out)}
        assert set(self.root.iterdir()) <= allowed, sorted(set(self.root.iterdir()) - allowed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", ["lmdb", "memmap"])
def test_random_sequences_keep_every_version_whole(tmp_path: Path, backend: str, seed: int) -> None:
    machine = Machine(tmp_path, backend, random.Random(f"{seed}-{backend}"))
    try:
        for _ in range(STEPS):
            machine.step()
        run = subprocess.run(
            [*PACKER, "build", str(machine.raw), str(machine.out), "--backend", backend]
            + ["--shard-size", str(SHARD_SIZE), "--workers", "1", "--quiet", "--update"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        assert Manifest.load(machine.out).inputs == machine.now
        machine.check()
    except AssertionError as e:
        raise AssertionError(f"after: {'; '.join(machine.log)}") from e
