"""Datasets in object storage (``s3://bucket/prefix/train.lmdb``, ``https://...``), read through a
node-local cache that the readers open as a local dataset.

**Lock discipline** (checked where ``PACKER_LOCK_CHECK=1``, as the test suite sets it: :mod:`.locks`):

1. A thread holding a node lock (a version's, a unit's, the cache's flock) waits for no other thread
   or process: no turn, no future, no room in the cache; only for a node lock later in the order.
2. Node locks are taken in one order: version, unit, hold (a unit's shared flock), cache; a lock
   out of that order is only tried, never waited for (eviction tries the units it deletes).
3. Every wait has a deadline (:data:`~.settings.WAIT_S`, ``$PACKER_CACHE_WAIT``), then fails in one
   line naming the unit, its object and the pid holding it; a holder that dies releases its flocks.

So no wait cycle can form: a holder of a node lock only waits down the order, for holders that do
the same, and the last lock's (the cache's) holders wait for nothing.

A dataset URL resolves to a directory of the cache holding one version: its manifest, index and
label arrays, fetched and checked against the manifest's digests when the version is first opened
on the node, and its data, fetched in units when a reader first needs them and hard-linked in. The
readers (packer.backends) then read local files as they read any dataset; nothing of the store
reaches them.

- **Units**: an LMDB segment is fetched whole (packer.backends.pin's ``fetch``: the environment maps the
  file). A memmap shard is fetched in ranges of a power of two records (about :data:`UNIT_BYTES`,
  less for a dataset of fewer than :data:`MIN_UNITS` units: :func:`unit_records`; global record
  numbers ``u * per_unit`` and up, cut at shard ends, so ShardSampler's blocks of a power of two
  records up to that never straddle two units), each its own file ``FILE@START-END`` (a whole shard
  is named as its file): one file per range, not a sparse file per shard, so that a unit is evicted,
  held and counted as a file (unlink, flock, size) with no byte-range locks or hole punching, and a
  unit never exists in part. The reader maps each unit as it first reads a record of it
  (:class:`RangedShard`). A unit is downloaded in :data:`UNIT_STREAMS` parallel ranged parts
  (packer.store.base; parts of at most its ``PART_BYTES``) into ``partial/``, then renamed into
  ``units/``. A broken part is resumed from the byte it reached (``If-Match`` pins the object's
  version); parts already written by a process that died are kept and skipped (``.parts`` lists
  them, after the part size they were cut at). A memmap unit asks no HEAD first: the manifest lists
  its shard's size, and its GET's response gives the version, which the shard's other units then ask
  ``If-Match``.
- **Checked before any decoder sees a byte**: the size against the manifest, then every record the
  version's index names in the unit by length and CRC-32 (a memmap unit's computed as its bytes are
  written; LMDB files after their page tree is checked, as ``packer verify`` does); a mismatch is
  fetched again, up to :data:`VERIFY_ATTEMPTS` times, then a DatasetError names the object and the
  record.
- **Versions**: the version directory is keyed by the manifest's sha256 and units by file name, size
  and ETag, so a refreshed dataset gets a new version directory that reuses every unchanged segment
  (a sidecar lists the records each unit was checked for) and never serves a byte of the old one; a
  ShardDataset keeps reading the version it opened (its pickled copies reopen that one), unless
  ShardSampler's agreement of DDP ranks that opened different versions reopens it at the store's
  current one (Remote.reopen), letting go of the old one. A version's files.json that a read of its
  data found wrong (an object missing, of another size or other bytes) is read from the bucket again
  at the next open (versions.suspect_files).
- **One fetch per node**: every process of the node (ranks, DataLoader workers) takes the file lock
  of a unit (flock: released by the kernel when its holder dies) before fetching it, and finds it
  fetched once the lock is theirs. Nothing is kept in shared memory.
- **Who fetches**: ShardSampler's next blocks are fetched by the process that iterates the sampler
  (with DataLoader workers: the training process), in its background threads, the unit needed next
  first; the workers that decode find their units cached or wait for the fetch in flight, so a
  download's receiving, writing and checking take no CPU from them. The prefetches of a process
  receive in the order they are needed, one unit at a time while one stream alone outpaces the
  readers (:class:`Turns`): the next one's GET goes out as the one before it is a first-byte wait
  from its end, so the store's latency is covered and the unit needed next does not share the
  bandwidth with ones needed after it (four at once, the first of them came when all four did);
  where one stream is slower than the readers consume, as many receive at once as they need. A
  prefetch takes its turn before its unit's lock (a turn is a wait: rule 1), and only tries that lock
  (a unit another process fetches is left to it: its batch waits for it). A batch whose unit is
  neither (the first ones, a sampler that announces nothing) is fetched by the process reading it; a
  process that reads its batches itself (no workers) fetches the next blocks after each batch's own.
  A batch waits for the downloads of its units (its own, or those in flight elsewhere).
- **cache_limit**: units no reader holds are evicted before a download would take the cache (every
  dataset under ``cache_dir``) past the limit, counted as ``du`` counts it (every file and folder,
  each inode once, in whole blocks: the versions' manifests, indexes and labels, the sidecars, a
  download's log); a download reserves its whole room first (its part at full size, its log and
  sidecar written), so concurrent fetches never overshoot. Eviction takes first the units this
  process knows no next use of (other datasets, blocks already read), least recently opened first,
  then those the sampler's next blocks (a Draw's ``ahead``) need, the one needed furthest in the
  future first (Belady); units whose records this process has not all read this epoch come after the
  announced ones. A background prefetch takes free room or evicts units of no known next use only,
  else it leaves the unit to the batch that needs it. The room a failed or killed download reserved
  goes first (no process holds its unit's lock), then the versions a refresh replaced that no reader
  holds (a reader holds the version it pinned: a shared flock on its manifest, for its life; each
  dataset's last opened version stays). A limit below the largest unit's room and what the cache
  keeps of its versions (an LMDB file's: its size as the manifest lists it) is refused at once, in
  one line that says what limit would work. A memmap batch whose unit finds no room (the units the
  batches in flight hold fill the limit: a global shuffle through a small cache) reads just its
  records of it past the cache (:mod:`.ranges`: byte ranges, records closer than a small gap in one
  GET, each record checked), so any order works down to that limit. Where the process has the
  epoch's plan (the process that iterates ShardSampler, and its DataLoader workers: the sampler
  hands its order to the dataset, and each worker computes it once an epoch,
  :meth:`~.nextuse.NextUses.follow`), such a download evicts no unit needed before its own next use
  (Belady with bypass), and evicts none at all where it would not pay for itself: fewer than
  :data:`settings.PAST_SHARE` of the unit's records read before the cache would have turned over (a
  global shuffle through a cache smaller than its batches touch keeps the units it holds and reads
  the others' records past it: each record fetched about once an epoch, not whole units for a record
  each); an LMDB batch that cannot make room lets go of its own units (they are opened again,
  fetched again if evicted meanwhile), so two batches never wait on each other, and waits for other
  readers to let go (its unit's lock let go of meanwhile: rule 1) until the deadline, then fails
  clearly. Every count of the cache and every change to it (a reservation, an eviction, a download
  renamed into ``units/``) is under one lock.
- **Holding and letting go**: a process holds a unit (a shared flock on its own descriptor: no
  process evicts it; the kernel drops it if the holder dies) from before its download is renamed
  into ``units/`` (so none evicts it between its arrival and its first use), or from when it opens
  it; a forked child closes the holds it inherited (it holds only what it opens itself). A memmap
  reader lets go after each batch (:meth:`Remote.release`; a dataset has thousands of units, more
  than ``ulimit -n`` would let it hold): without a limit it keeps its mappings (a unit evicted by
  another process's limit stays readable through them); with a limit the unit's mapping is dropped
  first, then the flock, and the next batch that needs it opens (or fetches) it again. Eviction
  unlinks a unit only under an exclusive flock, so never one that a reader holds or is reading; a
  buffer of a released unit that a caller still keeps stays valid (an unlinked file stays readable
  through its mapping on Linux; its disk space is freed with the last mapping). LMDB readers keep
  their environments open, so they hold every segment they opened until the dataset goes: each
  thread keeps a long-lived read transaction per environment whose buffers are zero-copy views of
  the map, and an environment closed while another thread's transaction or a caller's view is alive
  is a use-after-unmap, so no batch boundary of one thread is a safe point to close it.

Files: client (Remote: pin, hold, release, prefetch, fetch a unit), versions (the pointer, a
version's metadata), units (what is fetched, a memmap shard mapped unit by unit), download (a
unit's ranged parts), ranges (records read past the cache), checks (digests, CRC-32s, sidecars),
eviction and nextuse (cache_limit),
turns (the prefetch threads and their turns), locks (flocks, holds, fork), paths (the cache
directory's layout), settings (the tunables named above, the cache's directory and limit).
"""

from __future__ import annotations

from .client import Remote, local_version
from .settings import default_cache_dir, parse_limit

__all__ = ["Remote", "default_cache_dir", "local_version", "parse_limit"]
