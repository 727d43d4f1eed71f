"""What the read path checks in data.mdb before liblmdb touches a record.

liblmdb trusts every page it maps, and py-lmdb's ``get`` touches every page of the value it found
before returning it. A damaged node size or overflow page number therefore makes ``get`` read past
the end of the file and die of SIGBUS, whatever the file's mtime says. So before a record is asked
of liblmdb, :class:`PageGuard` walks the path liblmdb's lookup will walk, in its own read-only map of
the file: the newer meta page, then branch pages down to the leaf holding the record's key, and the
value's place (inline, or on overflow pages). Each page on the way is checked whole, once per process:
its own page number, its node table inside the page, keys in strictly increasing order, child page
numbers inside the file, every value inside the file. liblmdb's binary search over such a page
lands where packer's did, so it only touches checked bytes; a record it can reach is also checked
to be as long as the index says (the reader compares the length the walk found). Anything else is
a DatasetError naming the record, before liblmdb reads it. The walk's result is kept for every
record of the leaf page it reached (~100 JPEG records per page), so its cost is paid about once per
leaf page per process.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import struct
import threading
from typing import Optional

import numpy as np

_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch/leaf/overflow pages, entries, md_root
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08  # page flags
F_BIGDATA = 0x01
MAGIC = 0xBEEFC0DE
HEADER = 16  # PAGEHDRSZ
NO_PAGE = 2**64 - 1  # P_INVALID: an empty database's root
MAX_DEPTH = 32


class Damaged(Exception):
    """data.mdb is malformed on the way to a record; the message says where."""


class PageGuard:
    """Checks, per record, that liblmdb can fetch it without reading outside data.mdb (see module)."""

    def __init__(self, fd: int, count: int) -> None:
        size = os.fstat(fd).st_size
        self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        self.size = size
        #: per record (up to ``count``): its value's length once the path to it was checked, else -1
        self.lengths = np.full(count, -1, dtype=np.int64)
        #: per record: where its value's bytes start in the file, once known (as ``lengths``)
        self.offsets = np.full(count, -1, dtype=np.int64)
        self.pages: dict[int, tuple] = {}  # page number -> its checked contents (a leaf's: once read)
        self.lock = threading.Lock()
        self.root, self.psize, self.last = self._meta()

    def _meta(self) -> tuple[int, int, int]:
        """(root page, page size, last page) of the meta page a read transaction picks (newer txnid)."""
        metas = []
        psize = 0
        for k in range(2):
            at = k * psize
            if at + HEADER + _META.size + 2 * _DB.size + 16 > self.size:
                raise Damaged("data.mdb is too short for its meta pages")
            flags = _HEADER.unpack_from(self.mm, at)[2]
            magic, _version, _, _ = _META.unpack_from(self.mm, at + HEADER)
            if not flags & P_META or magic != MAGIC:
                raise Damaged(f"meta page {k} is not an LMDB meta page")
            free_db = _DB.unpack_from(self.mm, at + HEADER + _META.size)
            main_db = _DB.unpack_from(self.mm, at + HEADER + _META.size + _DB.size)
            last, txnid = struct.unpack_from("<QQ", self.mm, at + HEADER + _META.size + 2 * _DB.size)
            if k == 0:
                psize = free_db[0]
                if psize < 512 or psize > 65536 or psize & (psize - 1):
                    raise Damaged(f"page size {psize} is invalid")
            elif free_db[0] != psize:
                raise Damaged(f"the meta pages disagree on the page size ({psize}, {free_db[0]})")
            metas.append((txnid, main_db[7], last))
        txnid, root, last = metas[metas[0][0] < metas[1][0]]
        if (last + 1) * psize > self.size:
            raise Damaged(f"data.mdb is truncated ({self.size} bytes, its meta page needs {(last + 1) * psize})")
        return root, psize, last

    def known(self, keys: np.ndarray) -> np.ndarray:
        """The checked lengths of the values of key numbers ``keys`` (-1 where not checked yet)."""
        inside = keys < len(self.lengths)
        return (
            np.where(inside, self.lengths[np.where(inside, keys, 0)], -1)
            if len(self.lengths)
            else np.full(len(keys), -1)
        )

    def reserve(self, count: int) -> None:
        """Keep lengths for key numbers below ``count`` too (another version of the dataset, sharing
        this file, names more of its keys): leaves are walked again to fill them in."""
        if count <= len(self.lengths):  # the usual case, without the lock
            return
        with self.lock:
            if count > len(self.lengths):
                more = np.full(count - len(self.lengths), -1, np.int64)
                self.offsets = np.concatenate([self.offsets, more])  # first: never shorter than lengths
                self.lengths = np.concatenate([self.lengths, more])
                self.pages = {page: entry for page, entry in self.pages.items() if entry[0] != P_LEAF}

    def length(self, i: int) -> Optional[int]:
        """The length of the value of key number ``i``, which liblmdb can then fetch without reading
        outside the file; None when the file has no such key (or only one beyond the keys this guard
        keeps: see :meth:`reserve`). Damaged when the way to it is malformed."""
        if i < len(self.lengths) and self.lengths[i] >= 0:
            return int(self.lengths[i])
        with self.lock:
            return self._walk(i)

    def extents(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file offsets, lengths) of the values of key numbers ``keys`` whose way is sound (walked
        first where not known yet); keys missing or damaged are left out: their read will say so."""
        keys = keys[keys < len(self.lengths)]
        for i in keys[self.lengths[keys] < 0].tolist():
            try:
                self.length(i)
            except Damaged:
                pass
        known = keys[self.lengths[keys] >= 0]
        return self.offsets[known], self.lengths[known]

    def check_tree(self) -> None:
        """Check every branch and leaf page reachable from the root, each once (what a cursor over
        all keys touches: packer.backends.walk's sequential passes); Damaged when one is malformed or
        reachable twice (a cycle)."""
        if self.root == NO_PAGE:
            return
        seen, todo = set(), [(self.root, 0)]
        while todo:
            page, depth = todo.pop()
            if page in seen or depth > MAX_DEPTH:
                raise Damaged(f"page {page} is reached twice or too deep (a cycle?)")
            seen.add(page)
            kind, _, targets = self._page(page)
            if kind == P_BRANCH:
                todo += [(child, depth + 1) for child in targets]

    def _walk(self, i: int) -> Optional[int]:
        key = b"%010d" % i
        page, lo, hi = self.root, b"", None  # the key interval liblmdb's search sends to ``page``
        if page == NO_PAGE:
            return None
        for _ in range(MAX_DEPTH):
            kind, keys, targets = self._page(page)
            if kind == P_LEAF:
                if keys is not None:  # first visit: keep what liblmdb's search can reach here, drop the rest
                    self._remember(keys, targets, lo, hi)
                    self.pages[page] = (P_LEAF, None, None)  # a leaf is reached by one key interval only
                return int(self.lengths[i]) if i < len(self.lengths) and self.lengths[i] >= 0 else None
            j = max(bisect.bisect_right(keys, key, 1) - 1, 0)  # liblmdb: largest key <= ours, else node 0
            lo = keys[j] if j else lo
            hi = keys[j + 1] if j + 1 < len(keys) else hi
            page = targets[j]
        raise Damaged(f"the B-tree is deeper than {MAX_DEPTH} levels (a cycle?)")

    def _remember(self, keys: list[bytes], values: list[tuple[int, int]], lo: bytes, hi: Optional[bytes]) -> None:
        """Keep the lengths and offsets of the records this leaf holds for liblmdb's search (keys in
        [lo, hi))."""
        for key, (length, offset) in zip(keys, values):
            if (
                lo <= key
                and (hi is None or key < hi)
                and len(key) == 10
                and key.isdigit()
                and int(key) < len(self.lengths)
            ):
                self.lengths[int(key)], self.offsets[int(key)] = length, offset

    def _page(self, page: int) -> tuple:
        """(flags, keys, child pages or values' (length, offset)) of a branch or leaf page, checked whole."""
        entry = self.pages.get(page)
        if entry is None:
            entry = self.pages[page] = self._read_page(page)
        return entry

    def _read_page(self, page: int) -> tuple:
        if not 2 <= page <= self.last:
            raise Damaged(f"page number {page} is outside the file (pages 2..{self.last})")
        at, ps = page * self.psize, self.psize
        pgno, _, flags, lower, upper = _HEADER.unpack_from(self.mm, at)
        if pgno != page:
            raise Damaged(f"page {page} says it is page {pgno}")
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META)
        if kind not in (P_BRANCH, P_LEAF) or flags & ~(P_BRANCH | P_LEAF | 0x10):
            raise Damaged(f"page {page} has flags {flags:#x}, not a plain branch or leaf page")
        if not HEADER <= lower <= upper <= ps or (lower - HEADER) % 2:
            raise Damaged(f"page {page} has a malformed node table (lower {lower}, upper {upper})")
        count = (lower - HEADER) // 2
        if count == 0 or (kind == P_BRANCH and count < 2):
            raise Damaged(f"page {page} has {count} nodes")
        keys, targets = [], []
        for ptr in struct.unpack_from(f"<{count}H", self.mm, at + HEADER):
            if not upper <= ptr <= ps - _NODE.size:
                raise Damaged(f"page {page} has a node at offset {ptr}, outside its node area")
            lo16, hi16, nflags, ksize = _NODE.unpack_from(self.mm, at + ptr)
            start = at + ptr + _NODE.size
            end = start + ksize
            if end > at + ps:
                raise Damaged(f"page {page} has a key running past the page")
            keys.append(bytes(self.mm[start:end]))
            if kind == P_BRANCH:
                child = lo16 | hi16 << 16 | nflags << 32
                if not 2 <= child <= self.last:
                    raise Damaged(f"branch page {page} points to page {child}, outside the file")
                targets.append(child)
            else:
                targets.append(self._value(page, nflags, lo16 | hi16 << 16, end, at + ps))
        ordered = keys[1:] if kind == P_BRANCH else keys
        if any(a >= b for a, b in itertools.pairwise(ordered)):
            raise Damaged(f"page {page} has keys out of order")
        return kind, keys, targets

    def _value(self, page: int, nflags: int, length: int, start: int, page_end: int) -> tuple[int, int]:
        """A leaf value's (length, file offset), once its bytes are known to lie inside the file."""
        if nflags & ~F_BIGDATA:
            raise Damaged(f"leaf page {page} has a node with flags {nflags:#x} (packer writes none)")
        if not nflags & F_BIGDATA:
            if start + length > page_end:
                raise Damaged(f"leaf page {page} has a value running past the page")
            return length, start
        if start + 8 > page_end:
            raise Damaged(f"leaf page {page} has an overflow node running past the page")
        (first,) = struct.unpack_from("<Q", self.mm, start)
        # liblmdb reads a big value from right after its first overflow page's header, without
        # looking at that header; the overflow pages themselves are not read here (a cold dataset's
        # first read of each record stays in the fetch threads, see packer.backends.lmdb)
        if not 2 <= first <= self.last or first * self.psize + HEADER + length > (self.last + 1) * self.psize:
            raise Damaged(
                f"leaf page {page} has a value of {length} bytes on overflow page {first}: past the end of the file"
            )
        return length, first * self.psize + HEADER
