"""cache_limit: making room for a download under the limit, evicting the units no reader holds
(those of no known next use first, then the one needed furthest in the future), and the room
of downloads that died. The cache is counted as ``du`` counts it: every file and folder under the
cache directory, each inode once, in whole blocks (:func:`footprint`), so that the limit a user
sets holds for the measure the user checks it with."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Union

from ...format import MANIFEST, DatasetError
from .locks import CACHE_LOCK, let_go, lock_now, locked
from .paths import LOCKS, LOG, PARTIAL, SIDECAR, UNITS, VERSIONS, file_mtime, log_of, remove, sidecar_of
from .settings import VERIFY_ATTEMPTS


class NoRoom(Exception):
    """A prefetch found no room without evicting what is needed sooner (the batch fetches it), or a
    batch's download found none at all (the batch reads its records past the cache)."""


class Full(Exception):
    """A batch's download found the cache full of units that readers hold: it lets go of its node
    locks and of its units, and tries again (Remote._until_room: no wait under a node lock), until
    the wait's deadline, then raises ``error`` (the limit that would hold the batches read at once)."""

    def __init__(self, error: DatasetError) -> None:
        super().__init__(str(error))
        self.error = error


def cache_locked(cache_dir: Path) -> contextlib.AbstractContextManager[bool]:
    """The lock of the cache in ``cache_dir``, under which it is counted and changed."""
    return locked(cache_dir / CACHE_LOCK, named=f"the cache {cache_dir}")


def _eviction_order(entry: tuple[Path, Optional[int]]) -> tuple[int, int, int]:
    """Units of no known next use first, then furthest next use first; least recently opened first."""
    unit, rank = entry
    return (0, 0, file_mtime(unit)) if rank is None else (1, -rank, file_mtime(unit))


#: The filesystem block a file's size is counted in (``du`` counts allocated blocks).
BLOCK = 4096
#: What a reservation creates: a path's size (a file to be written later: made that size, sparse),
#: its bytes (written now), or None: a folder (a version's metadata is staged in one).
Files = dict[Path, Union[int, bytes, None]]


def footprint(size: int, blocks: int = 0) -> int:
    """The room a file of ``size`` bytes with ``blocks`` 512-byte blocks allocated takes, counted
    as ``du`` may count it: its size in whole blocks, or its blocks where more."""
    return max(-(-size // BLOCK) * BLOCK, blocks * 512)


def room_for(files: Files) -> int:
    """The room a reservation of ``files`` takes once they are written."""
    return sum(BLOCK if v is None else footprint(v if isinstance(v, int) else len(v)) for v in files.values())


class _Taken:
    """What the files and folders under a cache directory take (:func:`footprint`, each inode
    once: a unit and its links in version folders are one, stat-ed once), and what deleting some
    gives back; its datasets' units and downloads (in ``units/``, ``partial/``; their sidecars and
    logs aside). Lock files are empty: their folder is counted, not they. One walk per count,
    under the lock of the cache: it is on every download's way."""

    def __init__(self, cache_dir: Path) -> None:
        top = os.lstat(cache_dir)
        self._inode: dict[str, int] = {str(cache_dir): top.st_ino}  # one filesystem: inode numbers suffice
        self._room: dict[int, int] = {top.st_ino: footprint(top.st_size, top.st_blocks)}
        self.units: list[Path] = []
        self.partial: list[Path] = []
        self.versions: list[Path] = []  # every dataset's cached version folders
        folders = [(str(cache_dir), 0, "")]
        while folders:
            folder, depth, name = folders.pop()
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:  # deleted meanwhile (a metadata download's staging folder)
                continue
            for entry in entries:
                ino = entry.inode()
                if ino not in self._room:
                    try:
                        st = entry.stat(follow_symlinks=False) if name != LOCKS else None
                    except FileNotFoundError:  # deleted meanwhile, by a process that takes no lock of the cache
                        continue
                    self._room[ino] = footprint(st.st_size, st.st_blocks) if st is not None else 0
                self._inode[entry.path] = ino
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, depth + 1, entry.name))
                    if depth == 2 and name == VERSIONS:
                        self.versions.append(Path(entry.path))
                elif depth == 2 and name in (UNITS, PARTIAL) and not entry.name.endswith((SIDECAR, LOG)):
                    (self.units if name == UNITS else self.partial).append(Path(entry.path))
        self.used = sum(self._room.values())

    def room_of(self, *paths: Path) -> int:
        """The room ``paths`` take (once per inode)."""
        return sum(self._room.get(k, 0) for k in {self._inode.get(str(p)) for p in paths} if k is not None)

    def give_back(self, *paths: Path) -> None:
        """``paths`` were deleted: their room is free (once per inode)."""
        for path in paths:
            ino = self._inode.get(str(path))
            if ino is not None:
                self.used -= self._room.pop(ino, 0)

    def fixed(self) -> int:
        """The room no eviction frees: every dataset's versions that a reader holds or that it opened
        last (manifest, index, labels), locks and folders."""
        units, partial = self.units, self.partial
        unused = sum(self.version_room(v) for v in self.stale_versions() if not _version_held(v))
        return (
            self.used
            - unused
            - self.room_of(*units, *map(sidecar_of, units), *partial, *map(log_of, partial), *map(sidecar_of, partial))
        )

    def stale_versions(self) -> list[Path]:
        """Every dataset's cached versions but the one it opened last, least recently opened first:
        the metadata of versions a refresh replaced, which :func:`evict_version` deletes once no
        reader holds them (a reader that opens the dataset again reads its current version)."""
        newest: dict[Path, Path] = {}
        for v in sorted(self.versions, key=_opened):
            newest[v.parent.parent] = v
        return [v for v in sorted(self.versions, key=_opened) if newest[v.parent.parent] != v]

    def version_room(self, root: Path) -> int:
        """The room deleting version folder ``root`` gives back: the folder and its metadata, not
        the units linked in it (``units/`` keeps them)."""
        return sum(self._room.get(k, 0) for k in self._version_inodes(root))

    def give_back_version(self, root: Path) -> None:
        for k in self._version_inodes(root):
            self.used -= self._room.pop(k, 0)

    def _version_inodes(self, root: Path) -> set[int]:
        units = {self._inode.get(str(u)) for u in self.units}
        inside = f"{root}{os.sep}"
        return {k for p, k in self._inode.items() if p == str(root) or p.startswith(inside)} - units


def too_small(limit: int, url: str, named: str, need: int, fixed: int) -> DatasetError:
    """The error of a ``limit`` that cannot work for the dataset at ``url``, in one line, with the
    limit that would: the room of its download ``named`` (``need``) and what no eviction frees."""
    return DatasetError(
        f"cache_limit {limit} bytes is too small for {url}: at least {need + fixed} bytes would work "
        f"({named} takes {need} bytes, and the versions the cache keeps {fixed})"
    )


def too_small_at_once(limit: int, url: str, cache_dir: Path, *, held: int, need: int, fixed: int) -> DatasetError:
    """The error of a ``limit`` too small for the batches being read at once (DataLoader workers
    that each hold their batch's units: a whole LMDB file each), in one line, with the limit that
    would have held them: what readers and downloads ``held``, the download that waited
    (``need``), and what no eviction frees (``fixed``)."""
    return DatasetError(
        f"{url}: cache_limit {limit} bytes is too small for the batches read at once: at least "
        f"{held + need + fixed} bytes would work ({held} bytes of the cache {cache_dir} are held by open readers, "
        f"{need} more are needed, and the versions the cache keeps take {fixed}); raise it, or read with "
        f"fewer DataLoader workers or smaller batches"
    )


def free_room(cache_dir: Path, limit: int) -> int:
    """The room under ``limit`` that nothing in ``cache_dir`` takes now, counted as
    :func:`make_room` counts it (a snapshot: make_room decides again)."""
    with cache_locked(cache_dir):
        return limit - _Taken(cache_dir).used


def fixed_room(cache_dir: Path) -> int:
    """The room in ``cache_dir`` that no eviction frees (_Taken.fixed): a limit must hold it and
    the largest download."""
    if not cache_dir.exists():
        return 0
    with cache_locked(cache_dir):
        return _Taken(cache_dir).fixed()


def evict(unit: Path) -> bool:
    """Delete ``unit``, its sidecar and its links in the version directories unless a reader holds it."""
    try:
        fd = os.open(unit, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        if not lock_now(fd):
            return False
        ino = os.fstat(fd).st_ino
        name = unit.name.rsplit(".", 2)[0]
        for link in unit.parent.parent.glob(f"{VERSIONS}/*/{name}"):
            with contextlib.suppress(FileNotFoundError):
                if link.stat().st_ino == ino:
                    link.unlink()
        remove(unit, sidecar_of(unit))
        return True
    finally:
        let_go(fd)


def _opened(root: Path) -> int:
    """When the version at ``root`` was last opened (Remote.pin touches its folder); 0: a folder
    left without its manifest (no reader can hold it), first to go."""
    return file_mtime(root) if (root / MANIFEST).is_file() else 0


def _version_held(root: Path) -> bool:
    """Whether a reader holds the cached version at ``root`` (a shared flock on its manifest)."""
    try:
        fd = os.open(root / MANIFEST, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not lock_now(fd)
    finally:
        let_go(fd)


def evict_version(root: Path) -> bool:
    """Delete the cached version folder ``root`` (its metadata, and its links to units, which stay
    in ``units/``) unless a reader holds it: the shared flock Remote.pin takes on its manifest
    before it reads anything of the version, and checks was not deleted under it."""
    try:
        fd = os.open(root / MANIFEST, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # a folder left without its manifest: nothing holds it
        shutil.rmtree(root, ignore_errors=True)
        return True
    try:
        if not lock_now(fd):
            return False
        shutil.rmtree(root, ignore_errors=True)
        return True
    finally:
        let_go(fd)


def _drop_partial(part: Path) -> bool:
    """Delete the reserved download ``part`` (with its log and sidecar) unless a process is
    downloading it (holds its unit's lock): one that died or failed left it, and its room would
    otherwise stay taken for good."""
    name = part.name.rsplit(".", 2)[0]
    try:
        fd = os.open(part.parent.parent / LOCKS / f"unit-{name}", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not lock_now(fd):
            return False
        remove(part, log_of(part), sidecar_of(part))
        return True
    finally:
        let_go(fd)


def evicted_too_often(name: str) -> DatasetError:
    return DatasetError(
        f"{name}: evicted from the cache by other readers as soon as it was fetched, {VERIFY_ATTEMPTS} times; "
        f"raise cache_limit"
    )


def make_room(
    cache_dir: Path,
    limit: int,
    files: Files,
    *,
    home: Path,
    demand: bool,
    next_use: Callable[[Path], Optional[int]],
    needed_before: Callable[[set[str]], int],
    url: str,
    named: Optional[str],
    past: bool = False,
    after: Callable[[int], Optional[int]] = lambda fits: -1,
) -> None:
    """Evict units no reader holds (see packer.read.remote's docstring for the order) until the room of ``files``
    (:func:`room_for`) fits under ``limit`` in ``cache_dir``, and reserve it: the files are made (a download's
    part at its full size) before the lock goes, so they count for the next one (the cache never exceeds the
    limit). A batch's download (``demand``) that finds the units readers hold fill it raises Full (its caller
    lets go and tries again); a prefetch evicts only units of no known next use (it would otherwise push out
    what the next batches need before it, and its reservation would keep their downloads from the room), leaves
    the room of the units needed before it (``needed_before`` the units ``there``, of dataset ``home``), and
    else raises NoRoom; ``next_use`` ranks a cached unit. A batch's download that can read its records past the
    cache instead (``past``: a memmap unit, packer.read.remote.ranges) evicts no unit needed before its own next
    use after the batch (``after(fits)``, packer.read.remote.nextuse.NextUses.after: ``fits`` units of its room
    in the limit; None: it evicts no unit, free room only) and raises NoRoom where the room cannot be made at
    once, rather than wait for other readers. A limit that cannot hold ``files`` beside what no eviction frees
    fails at once (``named``: the download, for the message); where ``named`` is None (a version's metadata,
    which the dataset's check of its limit needs: packer.read.remote.client.Remote.pin) the files are made once
    every unit no reader holds is evicted."""
    need = room_for(files)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with cache_locked(cache_dir):
        taken = _Taken(cache_dir)
        units, partial, fixed = taken.units, taken.partial, taken.fixed()
        overfull = fixed + need > limit
        if overfull and named is not None:
            if past:
                raise NoRoom()
            raise too_small(limit, url, named, need, fixed)
        for stale in partial:  # a download whose process died or gave up: its room first
            if taken.used + need > limit and _drop_partial(stale):
                taken.give_back(stale, log_of(stale), sidecar_of(stale))
        for old in taken.stale_versions():  # then versions a refresh replaced that no reader holds
            if taken.used + need > limit and evict_version(old):
                taken.give_back_version(old)
        evicted = set()
        keep = after(max(1, (limit - fixed) // need)) if past else -1  # units needed no later than this are kept
        for unit, rank in sorted(((u, next_use(u)) for u in units), key=_eviction_order):
            if keep is None or taken.used + need <= limit or (rank is not None and (not demand or rank <= keep)):
                break
            if evict(unit):
                taken.give_back(unit, sidecar_of(unit))  # its links in version folders are the same inode
                evicted.add(unit)
        there = {p.name.rsplit(".", 2)[0] for p in units + partial if p.parent.parent == home}
        there -= {p.name.rsplit(".", 2)[0] for p in evicted}
        if overfull or taken.used + need + (0 if demand else needed_before(there)) <= limit:
            create(files)
            return
        used = taken.used
    if not demand or past:
        raise NoRoom()
    raise Full(too_small_at_once(limit, url, cache_dir, held=used - fixed, need=need, fixed=fixed))


def create(files: Files) -> None:
    """Make ``files``, in order: a size, a file of that many bytes (sparse: written later); bytes,
    written; None, a folder."""
    for path, content in files.items():
        if content is None:
            path.mkdir(exist_ok=True)
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if isinstance(content, int):
                os.ftruncate(fd, content)
            else:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
