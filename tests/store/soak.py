"""The soak of the remote path (issue 39): DDP ranks (spawned processes, gloo on 127.0.0.1, an
all_reduce per batch as DDP's lockstep) reading one dataset from the real S3 server through one
node cache at about half the data (default ``ShardSampler(ds)``, a DataLoader of persistent
workers each), epoch after epoch, while the parent publishes refreshes of the dataset and reads
each new version whole through the same cache. Used by tests/store/test_soak.py (about a minute)
and scripts/soak_remote.py (the long run).

A hang fails, it never blocks: every rank reports each batch (and each of its workers its start)
to a file the parent polls, and once it has written its result it must exit; a rank (or the
parent's publisher) with no progress for ``stall_s`` seconds makes the parent dump the stacks of
every process (faulthandler, registered for SIGUSR1 in each rank and worker: it writes from its
signal handler, so a thread blocked in flock or on a lock is shown too) and the cache's flocks
each holds or waits for (/proc/locks), kill them all and report which threads waited where. Speed
is not checked: a slow run that moves passes (until every rank has read a batch, CPU time spent
counts as progress: interpreters importing torch on a loaded machine).

The default dataset (64 units of 240 KB, half of them cached) is the smallest tried that shows
issue 39's wait cycle within a few epochs (prefetch threads holding a unit's flock in their
process's Turns, behind a prefetch waiting for a flock another rank's thread holds); units of a
few KB never showed it.

Checked: every rank is served its share of every epoch (the ranks' draws of each epoch are every
record once), each sample's pixels are those of the record its sampler drew from the version it
opened (the first: a ShardDataset keeps the version it opened, docs/OBJECT-STORAGE.md), each fresh
open after a publish reads the newest version right, and ``du`` of the cache, sampled throughout,
never exceeds the limit."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import numpy as np
import psutil
import torch
from PIL import Image
from torch.utils.data import DataLoader

from packer import ShardDataset, ShardSampler
from packer.read.remote import settings
from packer.tools.publish import publish_build

from .du import du_peak, on_disk
from .seaweed import S3Server, _die_with_parent, _free_ports
from .test_redteam_refresh import _digest, _signal, _snapshot, _value

POLL_S = 0.1  # how often the parent looks at the ranks' events
DUMP_S = 20.0  # the longest the parent waits for the processes' stack dumps


@dataclass(frozen=True)
class Soak:
    """One soak's shape. ``records`` must be a multiple of ``ranks`` (no padded draws)."""

    ranks: int = 4
    workers: int = 2
    epochs: int = 20  # at least this many
    minutes: float = 0.0  # and at least this long (rank 0 decides at each epoch's end)
    #: the DataLoader workers' start method, rank by rank (cycled; the ranks are always spawned)
    contexts: tuple[str, ...] = ("fork",)
    records: int = 1024  # in the first version, 2 classes
    side: int = 64  # the images' height (width 5/4 of it): raw records of 3.75 * side**2 bytes (15 KB)
    batch_size: int = 4
    unit_bytes: int = 256 << 10  # settings.UNIT_BYTES: 16 records of side 64 a unit (240 KB), 64 units
    publish_every: int = 10  # epochs between refresh publishes (0: none)
    stall_s: float = 30.0  # no event for this long: a hang


@dataclass
class Run:
    """What a soak saw; :func:`verdict` says what is wrong with it."""

    soak: Soak
    limit: int
    first: str = ""  # the version the ranks opened
    epochs: int = 0  # epochs every rank finished
    published: list[str] = field(default_factory=list)  # the versions published mid-run, in order
    fresh: list[str] = field(default_factory=list)  # what each fresh open after a publish found wrong ("" ok)
    peak: int = 0  # the most du saw of the cache
    results: list[Any] = field(default_factory=list)  # each rank's result
    seconds: float = 0.0
    failure: str = ""  # a stall (with the stacks' summary) or a rank that failed
    left: list[int] = field(default_factory=list)  # processes still running after the ranks ended


def paint(raw: Path, first: int, count: int, side: int) -> None:
    """``count`` images numbered from ``first``, in 2 classes, each one flat colour of its own."""
    for j in range(first, first + count):
        path = raw / f"c{j % 2}" / f"m{j:04}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (side * 5 // 4, side), (40 + 80 * (j % 2), j % 256, 7 + 16 * (j // 256))).save(path)


def publish(raw: Path, url: str, soak: Soak, staging: Path, *, update: bool) -> None:
    """``packer build raw/ URL [--update]``: raw records, shards of 64."""
    options: dict[str, Any] = {"workers": 1, "quiet": True, "shard_size": 64, "format": "raw", "short_edge": soak.side}
    publish_build(raw, url, backend="memmap", update=update, staging=staging, **options)


def prepare(s3: S3Server, root: Path, soak: Soak) -> tuple[str, dict[str, list[Any]], int]:
    """The first version published under ``root``'s name; its URL, {version: each record's (digest,
    label)} and the cache limit: what the cache keeps of two versions (the ranks' and a fresh
    open's) and half the units' room, both measured as ``du`` counts on a probe cache read whole."""
    assert soak.records % soak.ranks == 0, "records must be a multiple of ranks"
    settings.UNIT_BYTES = soak.unit_bytes
    paint(root / "raw", 0, soak.records, soak.side)
    url = f"s3://{s3.bucket}/soak/{root.name}"
    publish(root / "raw", url, soak, root / "staging", update=False)
    version, records = _snapshot(root / "staging")
    probe = root / "probe"
    ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=probe)
    assert [(_digest(x), int(y)) for x, y in (ds[i] for i in range(len(ds)))] == records
    units = sum(on_disk(p)[1] for p in probe.glob("*/units"))
    fixed = on_disk(probe)[1] - units
    return url, {version: records}, 2 * fixed + units // 2


def soak(s3: S3Server, root: Path, soak: Soak, *, say: Callable[[str], None] = print) -> Run:
    """Run ``soak`` on a dataset published under ``root`` (its raw folder, staging, cache and the
    processes' event files there), saying a line per epoch; the ranks and their workers are gone
    (killed on a stall or failure) when it returns."""
    url, versions, limit = prepare(s3, root, soak)
    run = Run(soak, limit, first=next(iter(versions)))
    folder, cache = root / "events", root / "cache"
    folder.mkdir()
    _signal(folder, "want", versions[run.first])
    import torch.multiprocessing as mp

    port = _free_ports(1)[0]
    ranks = [
        mp.get_context("spawn").Process(target=_rank, args=(r, soak, port, url, str(cache), limit, str(folder)))
        for r in range(soak.ranks)
    ]
    start = time.monotonic()
    for p in ranks:
        p.start()
    try:
        with du_peak(cache, every=0.02) as peak:
            run.failure = _watch(run, ranks, folder, peak, lambda: _refresh(run, root, url, cache, versions), say)
        run.peak = max(peak)
    finally:
        run.left = _end(ranks, folder)
    run.seconds = time.monotonic() - start
    run.results = [_value(folder, f"result{r}") for r in range(soak.ranks)]
    return run


def _watch(
    run: Run,
    ranks: list[Any],
    folder: Path,
    peak: list[int],
    publish: Callable[[], threading.Thread],
    say: Callable[[str], None],
) -> str:
    """Poll the events until every rank has ended, starting a publish every ``publish_every``
    epochs; the failure ("" none): a rank that failed, or no progress for ``stall_s`` of a rank
    still running, or of the publisher. A rank's progress is its events (its workers' starts
    count, and its result: then its exit, which must follow); until every rank has read a batch,
    any CPU time the soak's processes spend counts for every rank too (interpreters importing
    torch: the ranks wait for each other in their collectives, and spawned workers tell nothing
    until they are up)."""
    soak, start = run.soak, time.monotonic()
    seen: dict[str, Any] = {}
    last = {f"rank {r}": start for r in range(soak.ranks)}
    publisher: Optional[threading.Thread] = None
    up, cpu = False, 0.0
    while True:
        now = time.monotonic()
        events = {
            f"rank {r}": (_value(folder, f"rank{r}"), _workers(folder, r), (folder / f"result{r}").exists())
            for r in range(soak.ranks)
        }
        if publisher is not None:
            events["publisher"] = _value(folder, "publisher")
        for who, event in events.items():
            if seen.get(who) != event:
                seen[who], last[who] = event, now
        ranks_events = [events[f"rank {r}"][0] or {} for r in range(soak.ranks)]
        if not all(e.get("steps") for e in ranks_events) and _cpu(ranks) > cpu:
            cpu = _cpu(ranks)
            last.update({f"rank {r}": now for r in range(soak.ranks)})
        running = {"publisher"} | {f"rank {r}" for r, p in enumerate(ranks) if p.exitcode is None}
        for r, p in enumerate(ranks):
            if p.exitcode is not None:
                result = _value(folder, f"result{r}")
                if p.exitcode != 0 or result is None:
                    return f"rank {r} ended with exit code {p.exitcode}: {(result or {}).get('error', 'no result')}"
        if not up and all(e.get("phase") == "reading" for e in ranks_events):
            up = True
            say(f"every rank opened the dataset and built its sampler ({time.monotonic() - start:.1f} s)")
        finished = min(e.get("epochs", 0) for e in ranks_events)
        while run.epochs < finished:
            run.epochs += 1
            say(
                f"epoch {run.epochs}: every rank read its {ranks_events[0].get('per_epoch')} draws "
                f"({time.monotonic() - start:.1f} s), du peak {max(peak)} of the limit {run.limit}, "
                f"{len(run.published)} published"
            )
        if publisher is not None and not publisher.is_alive():
            publisher = None
            del last["publisher"], seen["publisher"]
        due = soak.publish_every and finished >= (len(run.published) + 1) * soak.publish_every
        if publisher is None and due and (finished < soak.epochs or soak.minutes):  # while the ranks read
            publisher, last["publisher"] = publish(), now
        if publisher is None and all(p.exitcode is not None for p in ranks):
            return ""
        stalled = [who for who, t in last.items() if now - t > soak.stall_s and who in running]
        if stalled:
            return f"no progress for {soak.stall_s:.0f} s: {', '.join(stalled)}\n" + _dump(ranks, folder)
        time.sleep(POLL_S)


def _cpu(ranks: list[Any]) -> float:
    """CPU seconds the ranks and their children have spent so far (those alive now)."""
    total = 0.0
    for p in ranks:
        try:
            process = psutil.Process(p.pid)
            for one in [process, *process.children(recursive=True)]:
                times = one.cpu_times()
                total += times.user + times.system
        except (psutil.NoSuchProcess, ValueError, TypeError):  # not started, or gone
            pass
    return total


def _refresh(run: Run, root: Path, url: str, cache: Path, versions: dict[str, list[Any]]) -> threading.Thread:
    """A thread that publishes the next refresh (records added to both classes) while the ranks
    read, then opens it fresh on the ranks' cache and reads it whole, each record checked."""
    folder = root / "events"

    def refresh() -> None:
        k = len(run.published) + 1
        _signal(folder, "publisher", ["publishing", k])
        wrong = ""
        try:
            paint(root / "raw", run.soak.records + 8 * (k - 1), 8, run.soak.side)
            publish(root / "raw", url, run.soak, root / "staging", update=True)
            version, records = _snapshot(root / "staging")
            versions[version] = records
            run.published.append(version)
            ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=run.limit)
            if ds._remote is None or ds._remote.version != version:
                wrong = f"a fresh open after publish {k} did not open it"
            for i in range(len(ds)):
                x, y = ds[i]
                if (_digest(x), int(y)) != tuple(records[i]):
                    wrong = wrong or f"a fresh open after publish {k}: record {i} differs"
                _signal(folder, "publisher", ["read", k, i])
        except Exception as e:  # reported in the verdict
            wrong = f"publish {k} and its fresh open: {type(e).__name__}: {e}"
        run.fresh.append(wrong)

    thread = threading.Thread(target=refresh, name="soak-publisher", daemon=True)
    thread.start()
    return thread


def verdict(run: Run) -> list[str]:
    """What is wrong with ``run``, one line each (none: it passed)."""
    if run.failure:
        return [run.failure]
    soak, wrong = run.soak, []
    if run.epochs < soak.epochs:
        wrong.append(f"{run.epochs} epochs of {soak.epochs}")
    if run.peak > run.limit:
        wrong.append(f"du of the cache reached {run.peak} bytes, over the limit {run.limit}")
    wrong += [f for f in run.fresh if f]
    if run.left:
        wrong.append(f"processes left running after the ranks ended: {run.left}")
    results = run.results
    for r, result in enumerate(results):
        if result is None or "error" in result:
            wrong.append(f"rank {r}: {result and result['error']}")
        elif result["version"] != run.first:
            wrong.append(f"rank {r} read version {result['version']}, not the one it opened, {run.first}")
        elif result["wrong"]:
            wrong.append(f"rank {r} was served other pixels or labels than its draws' at {result['wrong'][:5]}")
    if not wrong:
        epochs = {len(result["draws"]) for result in results}
        if epochs != {run.epochs}:
            wrong.append(f"the ranks read {sorted(epochs)} epochs, not {run.epochs}")
        for e in range(run.epochs):
            drawn = sorted(d for result in results for d in result["draws"][e])
            if drawn != list(range(soak.records)):
                wrong.append(f"epoch {e}: the ranks' draws are not every record once")
    return wrong


# --- the processes ------------------------------------------------------------------------------

_DUMPS: list[TextIO] = []  # each process's stack dump file, kept open for faulthandler


def _stacks_on_signal(folder: Path) -> None:
    """This process's stacks (all threads) into ``folder``/stacks-PID on SIGUSR1, and on a crash."""
    for f in _DUMPS:  # a forked worker's inherited ones are its rank's
        f.close()
    _DUMPS[:] = [open(folder / f"stacks-{os.getpid()}", "w")]  # open for the process's life
    faulthandler.enable(file=_DUMPS[0], all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_DUMPS[0], all_threads=True, chain=False)


def _worker_up(worker: int, *, folder: str, rank: int) -> None:
    """A DataLoader worker's start: its stacks on SIGUSR1, its death with its rank, its pid told."""
    _die_with_parent()
    _stacks_on_signal(Path(folder))
    _signal(Path(folder), f"worker-{os.getpid()}", [rank, worker])


def _workers(folder: Path, rank: int) -> list[int]:
    """The pids of ``rank``'s workers that have started."""
    return sorted(
        int(p.name.split("-")[1]) for p in folder.glob("worker-*") if (_value(folder, p.name) or [None])[0] == rank
    )


def _rank(rank: int, soak: Soak, port: int, url: str, cache: str, limit: int, folder_: str) -> None:
    """One DDP rank: its epochs through ``soak.workers`` persistent workers, an all_reduce per
    batch, each sample checked against the first version's record its sampler drew; an event after
    each batch; its result (or error) at the end."""
    _die_with_parent()
    folder = Path(folder_)
    _stacks_on_signal(folder)
    event: dict[str, Any] = {"phase": "started", "epochs": 0, "steps": 0, "per_epoch": 0}
    _signal(folder, f"rank{rank}", event)
    settings.UNIT_BYTES = soak.unit_bytes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=soak.ranks, timeout=datetime.timedelta(minutes=30))
    out: dict[str, Any] = {"draws": [], "wrong": []}
    try:
        want = [tuple(w) for w in _value(folder, "want")]
        _signal(folder, f"rank{rank}", event | {"phase": "opening"})
        ds = ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, cache_limit=limit)
        out["version"] = ds._remote.version if ds._remote is not None else ""
        sampler = ShardSampler(ds)
        event |= {"phase": "reading", "per_epoch": len(sampler)}
        _signal(folder, f"rank{rank}", event)
        up = functools.partial(_worker_up, folder=folder_, rank=rank)
        loader = DataLoader(
            ds,
            batch_size=soak.batch_size,
            sampler=sampler,
            num_workers=soak.workers,
            persistent_workers=True,
            multiprocessing_context=soak.contexts[rank % len(soak.contexts)],
            worker_init_fn=up,
        )
        positions = rank + soak.ranks * np.arange(len(sampler))
        go, end = torch.ones(1), time.monotonic() + 60 * soak.minutes
        epoch = 0
        while go.item():
            sampler.set_epoch(epoch)
            draws = sampler.sequence()[positions].tolist()
            served = 0
            for images, labels in loader:
                for x, y in zip(images, labels.tolist()):
                    if (_digest(x), y) != want[draws[served]]:
                        out["wrong"].append([epoch, served])
                    served += 1
                lockstep = torch.ones(1)
                dist.all_reduce(lockstep)
                event["steps"] += 1
                _signal(folder, f"rank{rank}", event)
            out["draws"].append(draws[:served])
            epoch += 1
            event["epochs"] = epoch
            _signal(folder, f"rank{rank}", event)
            go = torch.tensor([float(epoch < soak.epochs or time.monotonic() < end)])
            dist.broadcast(go, 0)  # rank 0's clock decides
        del loader  # its workers shut down (joined) before the rank says it is done
    except Exception as e:  # reported to the parent, which fails the run with it
        out["error"] = f"{type(e).__name__}: {e}"
    _signal(folder, f"result{rank}", out)
    if "error" not in out:
        dist.barrier()
    dist.destroy_process_group()


# --- a stall: the stacks, then every process killed ----------------------------------------------


def _roles(ranks: list[Any], folder: Path) -> dict[int, str]:
    """pid -> "rank R" or "rank R worker W", of every process of the soak that has started."""
    roles = {p.pid: f"rank {r}" for r, p in enumerate(ranks) if p.pid is not None}
    for path in folder.glob("worker-*"):
        rank, worker = _value(folder, path.name) or [None, None]
        roles[int(path.name.split("-")[1])] = f"rank {rank} worker {worker}"
    for r, p in enumerate(ranks):  # children that did not tell (yet)
        try:
            for child in psutil.Process(p.pid).children(recursive=True):
                roles.setdefault(child.pid, f"rank {r} child")
        except (psutil.NoSuchProcess, ValueError, TypeError):
            pass
    return roles


def _dump(ranks: list[Any], folder: Path) -> str:
    """Every process's stacks (SIGUSR1; the parent's own too), summarised: for each thread not
    idle in the DataLoader's or the interpreter's own waits, its innermost frames; then the cache's
    flocks each process holds and waits for (/proc/locks)."""
    roles = _roles(ranks, folder)
    sizes = {pid: _size(folder / f"stacks-{pid}") for pid in roles}
    for pid in roles:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            roles[pid] += " (gone)"
    with open(folder / "stacks-parent", "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    deadline, before = time.monotonic() + DUMP_S, dict(sizes)
    while time.monotonic() < deadline:  # until every live process's dump is written and stays the same
        now = {pid: _size(folder / f"stacks-{pid}") for pid in roles}
        if now == before and all(now[pid] > sizes[pid] or "gone" in roles[pid] for pid in roles):
            break
        before = now
        time.sleep(POLL_S)
    lines = [f"stack dumps in {folder}:"]
    dumps = [(f"{role} (pid {pid})", folder / f"stacks-{pid}", sizes[pid]) for pid, role in roles.items()]
    for title, path, start in [*sorted(dumps), ("the parent (publisher)", folder / "stacks-parent", 0)]:
        lines.append(f"{title}:")
        text = path.read_text(errors="replace")[start:] if path.exists() else ""
        lines += [f"  {t}" for t in summarise(text)] or ["  (no dump)"]
    return "\n".join(lines + flocks(folder.parent / "cache", roles))


def flocks(cache: Path, roles: dict[int, str]) -> list[str]:
    """The flocks on files under ``cache`` that the processes of ``roles`` wait for or hold
    exclusively, as /proc/locks lists them (not the shared ones every reader holds): a line a file."""
    inodes = {}
    for where, _, files in os.walk(cache):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                inodes[os.lstat(os.path.join(where, name)).st_ino] = os.path.relpath(os.path.join(where, name), cache)
    held: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            found = re.match(r"\d+:\s*(->)?\s*FLOCK\s+\S+\s+(\S+)\s+(\d+)\s+\S+:\S+:(\d+)", line)
            if found and int(found[3]) in roles and int(found[4]) in inodes:
                who = f"{roles[int(found[3])]} {'waits for' if found[1] else 'holds'} ({found[2].lower()})"
                held.setdefault(inodes[int(found[4])], []).append(who)
    lines = ["flocks under the cache, taken or waited for:"]
    for path, holders in sorted(held.items()):
        if any("waits" in h or "(write)" in h for h in holders):
            lines.append(f"  {path}: {'; '.join(holders)}")
    return lines


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def summarise(dump: str) -> list[str]:
    """One line per thread of a faulthandler dump: its innermost packer frames (else its innermost
    frames), innermost first; threads other than the main one with no packer frame (the pool's
    idle threads, queue feeders: the interpreter's and DataLoader's own) left out."""
    out = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip()):
        frames = [m.groupdict() for m in _FRAME.finditer(block)]
        ours = [f for f in frames if "/packer/" in f["file"]]
        if not frames or (not ours and frames[-1]["func"] == "_bootstrap"):
            continue
        where = " <- ".join(f"{Path(f['file']).name}:{f['line']} {f['func']}" for f in (ours or frames)[:5])
        out.append(f"{block.split(' (', 1)[0]}: {where}")
    return out


def _end(ranks: list[Any], folder: Path) -> list[int]:
    """Kill whatever of the soak still runs (the ranks, their workers); the workers that were still
    running although their rank had ended by itself (it shuts them down before it ends)."""
    ended = tuple(f"rank {r} " for r, p in enumerate(ranks) if p.exitcode is not None)
    left = []
    for pid, role in _roles(ranks, folder).items():
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                if role.startswith(ended):  # a worker of a rank that had ended
                    left.append(pid)
                process.kill()
        except psutil.NoSuchProcess:
            pass
    for p in ranks:
        p.join(DUMP_S)
    return left
