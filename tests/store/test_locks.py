"""The node cache's lock discipline (packer.read.remote's docstring) and its deadlines, with real
flocks and real processes: the check fires on a real wait under a node lock and on locks out of
order; the wait cycle of issue 39 (two processes, each a prefetch holding a unit's lock and waiting
for its turn behind one that waits for the other's lock) is caught by the check, bounded by the
deadline without it, and gone in the order the cache now takes them (turn, then lock); a reader
waiting for a unit another process holds fails after ``$PACKER_CACHE_WAIT`` in one line naming the
unit, its object and the holder's pid, and proceeds at once when that holder is killed (SIGKILL)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import pytest
import torch

from packer import ShardDataset
from packer.errors import CacheWaitTimeout, LockDisciplineError
from packer.read.remote import locks
from packer.read.remote.locks import CACHE_LOCK, hold, locked
from packer.read.remote.turns import Turns

from .redteam import Copy, in_time, read_local, same, samples, upload
from .seaweed import S3Server


def _entered(turns: Turns, *keys: tuple[str, str]) -> None:
    """``keys`` entered in ``turns`` in this order, as prefetches submitted to the threads are."""
    for rank, key in enumerate(keys):
        turns.enter(key, rank, concurrent.futures.Future)


def test_the_check_is_on_in_the_suite() -> None:
    assert locks.checking(), "tests/conftest.py sets PACKER_LOCK_CHECK=1 for every test and its processes"


def test_a_wait_under_a_node_lock_fails_the_check(tmp_path: Path) -> None:
    """A prefetch that holds its unit's lock and waits for its turn behind an earlier one (the
    order issue 39's frozen ranks were in) is a LockDisciplineError, raised before it waits."""
    turns = Turns()
    _entered(turns, ("d", "early"), ("d", "late"))
    with locked(tmp_path / "unit-late"), pytest.raises(LockDisciplineError, match="turn while holding"):
        turns.turn(("d", "late"), named="s3://b/late")
    # its turn taken with no lock held waits, as it should: here, until the earlier one leaves
    waiter = threading.Thread(target=turns.turn, args=(("d", "late"),), kwargs={"named": "s3://b/late"})
    waiter.start()
    turns.leave(("d", "early"))
    waiter.join(30)
    assert not waiter.is_alive()
    turns.leave(("d", "late"))


def test_node_locks_out_of_order_fail_the_check(tmp_path: Path) -> None:
    """The cache's lock, then a unit's lock or a hold: out of the order (version, unit, hold, cache)."""
    (tmp_path / "unit-a").touch()
    with locked(tmp_path / CACHE_LOCK):
        with (
            pytest.raises(LockDisciplineError, match="takes a unit lock while holding cache"),
            locked(tmp_path / "unit-a"),
        ):
            pass
        fd = os.open(tmp_path / "unit-a", os.O_RDONLY)
        try:
            with pytest.raises(LockDisciplineError, match="takes a hold lock while holding cache"):
                hold(fd, named="unit-a")
        finally:
            os.close(fd)
    with locked(tmp_path / "version-v"), locked(tmp_path / "unit-a"), locked(tmp_path / CACHE_LOCK):
        pass  # in order
    with locked(tmp_path / "unit-a"):  # the thread's record let go of them all
        pass


def _prefetches(folder: str, mine: str, theirs: str, *, old_order: bool, ready: Any, held: list[Any]) -> str:
    """Two prefetches of one process, as issue 39's ranks ran them: the earlier needs unit
    ``theirs`` (whose lock the other process's later prefetch takes), the later needs ``mine``.
    ``old_order``: each takes its unit's lock, then its turn (the cycle); else its turn, then its
    lock (the order the cache takes them in now). What each ended with, in one line."""
    turns = Turns()
    early, late = ("d", theirs), ("d", mine)
    _entered(turns, early, late)
    got: dict[str, str] = {}

    def fetch(key: tuple[str, str], name: str, *, first: bool) -> None:
        try:
            if old_order:
                if first:
                    for event in held:  # both later prefetches hold their units' locks
                        assert event.wait(60)
                with locked(Path(folder) / f"unit-{name}"):
                    if not first:
                        ready.set()
                    turns.turn(key, named=name)
            else:
                turns.turn(key, named=name)
                with locked(Path(folder) / f"unit-{name}"):
                    pass
            got[name] = "ok"
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
        finally:
            turns.leave(key)

    threads = [
        threading.Thread(target=fetch, args=(late, mine), kwargs={"first": False}),
        threading.Thread(target=fetch, args=(early, theirs), kwargs={"first": True}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"{got[theirs]} | {got[mine]}"


def _rank(folder: str, mine: str, theirs: str, old_order: bool, ready: Any, held: list[Any], out: Any) -> None:
    out.put((mine, _prefetches(folder, mine, theirs, old_order=old_order, ready=ready, held=held)))


@pytest.mark.parametrize("case", ["checked", "deadline", "turn-then-lock"])
def test_the_wait_cycle_across_processes(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39's cycle, with real flocks and two forked processes, made certain by events (each
    earlier prefetch reaches for its lock only once both later ones hold theirs): in the old order
    the check fails the wait under the lock at once ("checked"); without the check, the deadline
    ends it in one line naming the unit ("deadline", 1 s: the first to end breaks the cycle); in
    the cache's order, turn then lock, every prefetch ends well."""
    if case != "checked":
        monkeypatch.setenv("PACKER_LOCK_CHECK", "0" if case == "deadline" else "1")
    monkeypatch.setenv("PACKER_CACHE_WAIT", "1" if case == "deadline" else "60")
    ctx = mp.get_context("fork")
    events, out = [ctx.Event(), ctx.Event()], ctx.Queue()
    old = case != "turn-then-lock"
    ranks = [
        ctx.Process(target=_rank, args=(str(tmp_path), a, b, old, events[i], events, out))
        for i, (a, b) in enumerate([("x", "y"), ("y", "x")])
    ]
    for p in ranks:
        p.start()
    try:
        ended = dict(out.get(timeout=120) for _ in ranks)
    finally:
        for p in ranks:
            p.join(30)
            p.kill()
    if case == "deadline":  # the first deadline breaks the cycle: the rest may then end well
        lines = [part for line in ended.values() for part in line.split(" | ")]
        assert any(f"{m}: its prefetch waited 1 s for its turn" in ended[m] for m in ended), ended
        assert all(part == "ok" or part.startswith("CacheWaitTimeout: ") for part in lines), ended
        return
    for line in ended.values():
        early, late = line.split(" | ")
        if case == "turn-then-lock":
            assert (early, late) == ("ok", "ok"), line
        else:
            assert late.startswith("LockDisciplineError: waits for a prefetch's turn while holding node lock(s): unit")
            assert early == "ok", line  # the other's lock was let go of with its error


# --- a unit another process holds: the deadline, and a holder killed ----------------------------------

#: A process that holds the flock at argv[1] (as a fetcher of that unit does) until it is killed.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _held_unit(s3_server: S3Server, built, tmp_path: Path, prefix: str) -> tuple[str, Path, str, subprocess.Popen]:
    """An LMDB dataset in the store, its version opened in a cache, and a process holding the lock
    of its first data file (as one fetching it does): (url, cache, that file, the holder)."""
    local = built("lmdb", "jpeg")
    copy = Copy.of(local, published=False)
    url = upload(s3_server, prefix, copy.objects())
    cache = tmp_path / "cache"
    ShardDataset(url, crop_size=None, cache_dir=cache)  # the version's metadata cached, its folders made
    first = str(copy.manifest["shards"][0]["file"])
    lock = next(cache.glob("*/locks")) / f"unit-{first}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    return url, cache, first, holder


def test_a_unit_held_past_the_deadline_is_named_with_its_holder(
    built, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, cache, first, holder = _held_unit(s3_server, built, tmp_path, "locks/deadline")
    monkeypatch.setenv("PACKER_CACHE_WAIT", "1")
    try:
        ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
        with pytest.raises(CacheWaitTimeout) as failed:
            in_time(lambda: ds[0], 60)
    finally:
        holder.kill()
        holder.wait()
    line = str(failed.value)
    assert "\n" not in line
    assert f"{url}/{first}: waited 1 s for the lock unit-{first}, held by pid {holder.pid} " in line, line


def _waits_in_take() -> bool:
    """Whether a thread of this process (the reader's fetch, in a pool thread) waits for a unit's lock
    another process holds: in locks.take's loop (its deadline set)."""
    for top in sys._current_frames().values():
        frame: Optional[FrameType] = top
        while frame is not None:
            if frame.f_code is locks.take.__code__:
                told = frame.f_locals
                if str(told.get("what", "")).startswith("the lock unit-") and "deadline" in told:
                    return True
            frame = frame.f_back
    return False


def test_a_holder_killed_lets_the_waiter_proceed(built, s3_server: S3Server, tmp_path: Path) -> None:
    """The holder of the unit a reader waits for dies (SIGKILL): the kernel releases its flock,
    and the reader takes it and reads the dataset's bytes (well before the default deadline)."""
    url, cache, _, holder = _held_unit(s3_server, built, tmp_path, "locks/killed")
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(samples(ds)), daemon=True)
    try:
        reader.start()
        ended = threading.Event()
        while not _waits_in_take():  # the reader waits for the holder's lock
            assert reader.is_alive(), "the reader ended without waiting for the held unit"
            ended.wait(0.01)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    reader.join(120)
    assert not reader.is_alive(), "the reader still waits for a dead holder's lock"
    assert same(got[0], read_local(built("lmdb", "jpeg")))
