"""ShardSampler: the epoch's order of draws for a ShardDataset, seeded, distributed, resumable.

Each epoch is one global sequence of draws, a pure function of (seed, epoch, dataset): a
permutation of the records (``repeats`` times each, copies adjacent), or weighted picks with
replacement, or ``order="block"``'s locality order. Draw ``k`` of the sequence is yielded as a
:class:`Draw`: an ``int`` (the record index, so any Dataset or collate works with it) that also
carries ``(epoch, k)``, which :class:`~packer.read.dataset.ShardDataset` uses instead of the record index
to key the crop and the transform's random state. So a record drawn twice in an epoch gets two
crops, and ``set_epoch`` on the sampler is all a loop needs.

Distributed: rank ``r`` of ``W`` takes draws ``r, r + W, r + 2W, ...`` of the global sequence. The
sequence and every draw's augmentation do not depend on ``W`` (nor on num_workers), so a run moved
from 8 ranks to 4 sees the same samples, and unweighted every record is drawn exactly once per epoch
across the ranks (but for the few draws padded or dropped at the epoch's end). Every rank takes
as many draws (DDP's collectives need equal step counts): by default the sequence is padded at its
end with the epoch's first records again (as DistributedSampler pads), each padded draw with its
own key; ``drop_last=True`` drops the last draws instead, ``pad=False`` keeps the uneven split
(each draw exactly once). Resuming: the state is (epoch, position), the number of global draws
consumed, and what determines the sequence (refused when the sampler differs); with all ranks in
step, rank ``r`` then continues at ``position + r``, whatever ``W`` is now.

Several datasets: over a :class:`~packer.read.mix.MixDataset` the sequence holds the mix's indices
(``proportions=`` sets each member's share of an epoch's draws) and the mix hands each member its
draws with their keys.
"""

from __future__ import annotations

import copy
import hashlib
import math
import operator
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

# imported here, not on numpy's first use of ``np.random`` (numpy 2 imports it lazily): that first use
# is the sampler's first plan, as a DataLoader starts, and a Ctrl-C landing inside the import is lost
# in numpy.random's compiled module set-up, so the command would run on (tests/test_errors.py)
from numpy.random import default_rng
from torch.utils.data import ConcatDataset, Sampler

from ..errors import VersionsDiffer
from .dataset import ShardDataset
from .draw import Draw, Planned, Ranges
from .mix import MixDataset

ORDERS = ("random", "sequential", "block")
#: The batch size a default ``window`` is sized for (the sampler does not see the DataLoader's): a
#: larger batch from the same window mixes less, relative to a global shuffle's.
MIX_BATCH = 64
#: A default ``window`` is the smallest power of two whose batches' label entropy is at least this
#: fraction of a global shuffle's (:func:`label_entropy`; docs/PERFORMANCE.md, "Label mixing").
MIX_TARGET = 0.95
#: Batches of an epoch a candidate window's mixing is measured on (its first: every one is alike).
MIX_PROBE_BATCHES = 512
#: The window where labels cannot say how well batches mix (an unlabeled or multi-label dataset).
UNLABELED_WINDOW = 16


class ShardSampler(Sampler[Draw]):
    """Seeded, distributed, resumable draws for a map-style DataLoader over a ShardDataset.

    ``DataLoader(ds, batch_size=B, sampler=ShardSampler(ds))``, then ``sampler.set_epoch(e)`` each
    epoch (it sets the dataset's epoch too). Options:

    - ``shuffle``/``order``: ``"random"`` (default for a local dataset), ``"sequential"``, or
      ``"block"`` (default for a dataset in object storage): blocks of ``block_size`` records stored
      together (default: a cache unit's records from object storage, else ~4 MiB), in random block
      order, records shuffled within each ``window`` of consecutive blocks (reads stay within a
      window's region of the files: for data bigger than the page cache, or fetched unit by unit).
      The default window is the smallest whose batches' labels mix almost as well as a global
      shuffle's (:data:`MIX_TARGET`), within a cache limit; docs/DATASET.md, "Order";
    - ``weights`` (one per record) or ``balanced=True`` (inverse class frequency): ``num_samples``
      picks (default: len(dataset)) with replacement;
    - ``num_samples`` unweighted: that many draws, from as many permutations as it takes (with
      ``replacement=True``: uniform picks);
    - ``repeats=N``: each pick drawn N times in a row (repeated augmentation: N crops; distributed,
      on N consecutive ranks);
    - ``proportions`` (a :class:`~packer.read.mix.MixDataset` only, one share per member): each epoch
      draws ``round(share * num_samples)`` indices of each member, without replacement within a
      member while it lasts (then from a fresh permutation of it), all members' draws shuffled
      together;
    - ``num_replicas``/``rank``: default from torch.distributed when initialised, else 1/0. Every
      rank gets the same number of draws, as DDP needs: the epoch's sequence is padded by repeating
      its first records (``pad=True``, the default, as DistributedSampler does), or its last draws
      are dropped (``drop_last=True``); ``pad=False`` leaves the split uneven (a rank may get one
      draw fewer; for evaluation loops that run no collective per step). Both taken from
      torch.distributed: the ranks agree on the dataset's version (a collective: every rank builds
      the sampler), see :func:`_agree_on_version`.

    Exact mid-epoch resume: :meth:`state_dict` / :meth:`load_state_dict` (works with torchdata's
    StatefulDataLoader as it is, and with a plain DataLoader given the samples the loop consumed).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: Optional[int] = None,
        order: Optional[str] = None,
        weights: Optional[Sequence[float]] = None,
        balanced: bool = False,
        num_samples: Optional[int] = None,
        replacement: bool = False,
        repeats: int = 1,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        drop_last: bool = False,
        block_size: Optional[int] = None,
        window: Optional[int] = None,
        prefetch: int = 1,
        pad: bool = True,
        proportions: Optional[Sequence[float]] = None,
    ) -> None:
        _refuse_concat(dataset)
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
            if initialised and num_replicas is None and rank is None and dist.get_world_size() > 1:
                _agree_on_version(dataset)  # all ranks build it alike: they can agree on a version
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialised else 1)
            rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        num_replicas, rank = _integer("num_replicas", num_replicas), _integer("rank", rank)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}) and num_replicas positive, not {rank}")
        units = _fetch_units(dataset)
        order = order or ("sequential" if not shuffle else "block" if units else "random")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
        if not shuffle and order != "sequential":
            raise ValueError(f"shuffle=False contradicts order={order!r}")
        if weights is not None and balanced:
            raise ValueError("give weights= or balanced=True, not both")
        if balanced:
            weights = dataset.sample_weights()
        n = len(dataset)
        if n == 0:
            raise ValueError("ShardSampler needs a non-empty dataset")
        self.weights: Optional[np.ndarray] = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                raise ValueError(f"weights must be {n} finite non-negative numbers, not all zero")
            if order == "block":
                raise ValueError('order="block" draws every record once; it does not take weights')
            self.weights = w / w.sum()
        repeats, prefetch = _integer("repeats", repeats), _integer("prefetch", prefetch)
        window = None if window is None else _integer("window", window)
        num_samples = None if num_samples is None else _integer("num_samples", num_samples)
        block_size = None if block_size is None else _integer("block_size", block_size)
        if (
            repeats < 1
            or (num_samples is not None and num_samples < 1)
            or (window is not None and window < 1)
            or prefetch < 0
        ):
            raise ValueError("repeats, num_samples and window must be positive, prefetch not negative")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be a positive number of records, not {block_size}")
        self.members = _member_sizes(dataset)  # a MixDataset's member sizes, else None
        self.counts: Optional[np.ndarray] = None  # draws per member (proportions=)
        if proportions is not None:
            if weights is not None or order == "block" or replacement:
                raise ValueError("proportions= cannot be combined with weights, balanced, replacement or order='block'")
            if self.members is None:
                raise ValueError("proportions= needs a packer.MixDataset (one share per member dataset)")
            self.counts = _member_counts(self.members, proportions, num_samples if num_samples is not None else n)
        self.dataset = dataset
        self.seed = int(seed if seed is not None else getattr(dataset, "seed", 0))
        self.order = order
        self.size = n
        self.num_samples = num_samples if num_samples is not None else n
        self.replacement = replacement or self.weights is not None
        self.repeats = repeats
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last, self.pad = drop_last, pad
        self.block_size = block_size or min((u for u, _ in units if u), default=0) or _default_block(dataset)
        self.prefetch = prefetch
        self.window = window or (_mixing_window(self, units) if order == "block" else UNLABELED_WINDOW)
        self.epoch = 0
        self._resume: Optional[int] = None  # global position the next iteration starts at
        self._base = 0  # global position the current iteration started at
        self._yielded = 0  # draws this rank yielded in the current iteration
        self._done_epoch: Optional[int] = None  # the epoch last iterated to its end
        if isinstance(dataset, Planned):  # told the plan (a dataset in object storage evicts by it)
            alone = copy.copy(self)
            alone.dataset = None  # pickled to every worker with the dataset: not a second copy of it
            dataset.ordered_by(alone._order)

    # --- the epoch's global sequence -------------------------------------------------------------

    @property
    def total(self) -> int:
        """Draws per epoch across all ranks."""
        return self.num_samples * self.repeats

    def sequence(self, epoch: Optional[int] = None) -> np.ndarray:
        """The record of every global draw of ``epoch`` (default: the current one), all ranks'."""
        return self._plan(self.epoch if epoch is None else epoch)[0]

    def _plan(self, epoch: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """The record of every global draw of ``epoch``, and with ``order="block"`` the window of
        each (numbered through the epoch, ascending along the sequence); else None."""
        rng = default_rng([self.seed & (2**63 - 1), int(epoch)])
        n = self.size
        windows = None
        if self.weights is not None:
            picks = rng.choice(n, size=self.num_samples, replace=True, p=self.weights)
        elif self.replacement:
            picks = rng.integers(0, n, self.num_samples)
        elif self.counts is not None:
            picks = self._mixed(rng)
        elif self.order == "sequential":
            picks = np.arange(self.num_samples) % n
        elif self.order == "block":
            parts = [_block_permutation(rng, n, self.block_size, self.window) for _ in range(-(-self.num_samples // n))]
            per_round = -(-n // (self.block_size * self.window))  # windows in one permutation
            picks = np.concatenate([perm for perm, _ in parts])[: self.num_samples]
            windows = np.concatenate([w + k * per_round for k, (_, w) in enumerate(parts)])[: self.num_samples]
        else:
            rounds = -(-self.num_samples // n)
            picks = np.concatenate([rng.permutation(n) for _ in range(rounds)])[: self.num_samples]
        if self.repeats > 1:
            picks = np.repeat(picks, self.repeats)
            windows = None if windows is None else np.repeat(windows, self.repeats)
        return picks, windows

    def _mixed(self, rng: np.random.Generator) -> np.ndarray:
        """proportions=: ``counts[m]`` draws of member ``m`` (mix indices), from as many permutations of
        the member as it takes; shuffled together (``order="sequential"``: member after member)."""
        assert self.counts is not None, "called with proportions only"
        parts = []
        assert self.members is not None, "proportions need a MixDataset"
        offsets = np.cumsum(self.members) - self.members
        for first, size, count in zip(offsets.tolist(), self.members.tolist(), self.counts.tolist()):
            if count == 0:
                continue
            if self.order == "sequential":
                parts.append(first + np.arange(count) % size)
            else:
                rounds = -(-count // size)
                parts.append(first + np.concatenate([rng.permutation(size) for _ in range(rounds)])[:count])
        picks = np.concatenate(parts)
        return picks if self.order == "sequential" else rng.permutation(picks)

    def _ahead(self, records: np.ndarray, windows: np.ndarray, positions: np.ndarray) -> dict[int, Ranges]:
        """order="block": what the dataset should ask of the disk, by global position. This rank's
        first draw of window ``w`` carries the record ranges of the blocks of window ``w +
        prefetch`` (the iteration's first draw: of windows ``w`` to ``w + prefetch``), so that
        each block is read whole, in few requests, ahead of its draws (docs/PERFORMANCE.md, "Block
        order")."""
        mine = windows[positions]
        firsts = np.flatnonzero(np.diff(mine, prepend=-1))
        ahead: dict[int, Ranges] = {}
        for j, at in enumerate(firsts.tolist()):
            w = int(mine[at]) + self.prefetch
            lo, hi = np.searchsorted(windows, [w - self.prefetch if j == 0 else w, w + 1])
            blocks = np.unique(records[lo:hi] // self.block_size)
            if len(blocks):
                cut = np.flatnonzero(np.diff(blocks) != 1) + 1
                first, last = blocks[np.r_[0, cut]], blocks[np.r_[cut - 1, len(blocks) - 1]]
                ends = np.minimum((last + 1) * self.block_size, self.size)
                ahead[int(positions[at])] = tuple(zip((first * self.block_size).tolist(), ends.tolist()))
        return ahead

    # --- iteration -------------------------------------------------------------------------------

    def _iteration(self, epoch: int, start: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """This rank's global positions in an iteration of ``epoch`` from ``start``, and the
        epoch's sequence and windows (:meth:`_plan`), padded to cover them."""
        first, end = self._span(start)
        positions = np.arange(first, end, self.num_replicas)
        sequence, windows = self._plan(epoch)
        if end > self.total:  # padded: the wrapped draws' records, in the last window (kept ascending)
            wrapped = np.arange(self.total, end) % self.total
            sequence = np.concatenate([sequence, sequence[wrapped]])
            windows = None if windows is None else np.concatenate([windows, np.full(len(wrapped), windows[-1])])
        return positions, sequence, windows

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's draws of ``epoch`` (from its start): their global positions and records (the
        :data:`~packer.read.draw.Order` its datasets' DataLoader workers evict their cache by)."""
        positions, sequence, _ = self._iteration(epoch, 0)
        return positions, sequence[positions]

    def _span(self, start: int) -> tuple[int, int]:
        """(first, end) global positions of this rank's draws in an iteration starting at ``start``:
        the draws left, cut (drop_last) or padded (pad) to a multiple of the ranks. Padded positions
        are past ``total``: position ``k`` draws the record of ``k % total``, under its own key."""
        end, uneven = self.total, (self.total - start) % self.num_replicas
        if uneven and self.drop_last:
            end -= uneven
        elif uneven and self.pad:
            end += self.num_replicas - uneven
        return start + self.rank, end

    def __len__(self) -> int:
        """This rank's draws in a whole epoch (also while resuming mid-epoch: loops such as
        Lightning's compare the batches they restored with the epoch's length)."""
        first, end = self._span(0)
        return max(0, -(-(end - first) // self.num_replicas))

    def __iter__(self) -> Iterator[Draw]:
        start, self._resume = self._resume or 0, None
        epoch = self.epoch
        if start == 0 and self._done_epoch == epoch and (self.order != "sequential" or self.replacement):
            warnings.warn(
                f"ShardSampler: epoch {epoch} iterated again without set_epoch(): the same order "
                "and augmentation as last time",
                stacklevel=2,
            )
        self._base, self._yielded = start, 0
        positions, sequence, windows = self._iteration(epoch, start)
        ahead = self._ahead(sequence, windows, positions) if windows is not None and self.prefetch else {}
        planned = self.dataset if isinstance(self.dataset, Planned) else None
        if planned is not None:  # a dataset in object storage evicts its cache by these next uses
            planned.will_read(epoch, sequence[positions])
        fetch = planned.fetch_ahead if planned is not None else None
        read = 0  # this iteration's draws before the previous announcement's: read by now, or being read
        for j, (k, record) in enumerate(zip(positions.tolist(), sequence[positions].tolist())):
            self._yielded += 1
            soon = ahead.get(k, ())
            if soon and fetch is not None and fetch(epoch, read, soon):
                soon, read = (), j  # fetched by this process: the worker that reads the draw does not
            yield Draw(record, epoch, k, soon)
        self._done_epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and augmentation (the dataset's ``set_epoch`` too). Setting the
        epoch a loaded state is in keeps its position; any other epoch starts at its beginning."""
        epoch = operator.index(epoch)
        if not 0 <= epoch < 2**63:
            raise ValueError(f"epoch must be in 0..2**63-1, not {epoch}")
        if epoch != self.epoch:
            self._resume, self._base, self._yielded = None, 0, 0
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # --- resume ----------------------------------------------------------------------------------

    def state_dict(self, consumed: Optional[int] = None) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "total", "config"}``: ``position`` is the global draws
        consumed, ``config`` what else determines the epoch's sequence (see :meth:`config`).

        ``consumed``: samples this rank's loop has taken from the current iteration (a plain
        DataLoader runs ahead of the loop: workers prefetch, so the sampler cannot know). Without
        it: the draws this sampler has yielded, which is what torchdata's StatefulDataLoader asks
        at the moment matching the batch it hands out."""
        if self._resume is not None:
            position = self._resume
        else:
            done = self._yielded if consumed is None else consumed
            position = min(self.total, self._base + done * self.num_replicas)
        return {
            "epoch": self.epoch,
            "position": position,
            "seed": self.seed,
            "total": self.total,
            "config": self.config(),
        }

    def config(self) -> str:
        """What the epoch's sequence depends on besides seed and epoch, as ``name=value`` words:
        the dataset's size (a mix's member sizes), num_samples, repeats, order, replacement, a
        digest of the weights, block_size and window (block order), the proportions' counts. Not
        the ranks, drop_last or pad: a state resumes on any number of ranks."""
        words = [
            f"size={self.size}",
            f"num_samples={self.num_samples}",
            f"repeats={self.repeats}",
            f"order={self.order}",
        ]
        if self.weights is not None:
            words.append("weights=" + hashlib.sha256(self.weights.tobytes()).hexdigest()[:16])
        elif self.replacement:
            words.append("replacement=True")
        if self.order == "block":
            words += [f"block_size={self.block_size}", f"window={self.window}"]
        if self.members is not None:
            words.append("members=" + "+".join(map(str, self.members.tolist())))
        if self.counts is not None:
            words.append("proportions=" + "+".join(map(str, self.counts.tolist())))
        return " ".join(words)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from any number of ranks): its epoch, at its position. A state
        from a sampler with another configuration is refused (ValueError) and this one is left as it
        was. A state saved by packer before states carried ``config`` is checked for seed and total
        only (with a warning)."""
        try:
            epoch, position, seed, total = (operator.index(state[k]) for k in ("epoch", "position", "seed", "total"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a ShardSampler state (integers epoch, position, seed, total): {state!r}") from e
        if seed != self.seed or total != self.total:
            raise ValueError(
                f"sampler state for seed {seed} and {total} draws an epoch, but this "
                f"sampler has seed {self.seed} and {self.total}: it would not continue the same order"
            )
        config = state.get("config")
        if config is None:
            warnings.warn(
                "ShardSampler: this state has no 'config' (saved by an older packer): only its seed and "
                "draws per epoch can be checked against this sampler's",
                stacklevel=2,
            )
        elif config != self.config():
            theirs, ours = _words(str(config)), _words(self.config())
            differ = [
                f"{k} {theirs.get(k, '(unset)')} -> {ours.get(k, '(unset)')}"
                for k in sorted(theirs.keys() | ours.keys())
                if theirs.get(k) != ours.get(k)
            ]
            raise ValueError(
                f"sampler state from another configuration ({', '.join(differ)}): it would not continue the same order"
            )
        if not 0 <= position <= self.total:
            raise ValueError(f"sampler state position {position} outside 0..{self.total}")
        if not 0 <= epoch < 2**63:
            raise ValueError(f"sampler state epoch {epoch} outside 0..2**63-1")
        self.set_epoch(epoch)
        self._resume = position
        self._done_epoch = None


def _agree_on_version(dataset: Any) -> None:
    """DDP: every rank must read the same version of the dataset. Each rank opened the newest at its
    open, so a refresh between two ranks' opens gives them different lengths, step counts, and a hang
    at the next collective. The ranks gather what each opened (per member: manifest digest, length,
    root); where they differ, every rank reopens that member's newest version (a local
    ShardDataset at its path, one in object storage at the store's current version: Remote.reopen),
    and they gather again, for :data:`_AGREE_ROUNDS` rounds (a refresh may land during one); a
    member that cannot be reopened (not a ShardDataset, or its reopen failed on any rank: every
    rank gathers why), or ranks still apart after the rounds, make every rank raise
    :class:`~packer.errors.VersionsDiffer`. Every rank decides from the same gathered lists, so all
    take the same branch (docs/DATASET.md, "One version on every rank"). It runs before the
    DataLoader starts its workers, so they read the agreed version."""
    import torch.distributed as dist

    members = dataset.datasets if isinstance(dataset, MixDataset) else [dataset]
    world = dist.get_world_size()
    told: list[Any] = [[] for _ in range(world)]  # each rank's reasons its last reopen failed
    for round_ in range(_AGREE_ROUNDS + 1):  # the last gather checks the last round's reopen
        seen: list[Any] = [None] * world
        dist.all_gather_object(seen, [_opened(m) for m in members])
        apart = [j for j in range(len(members)) if any(s[j][:2] != seen[0][j][:2] for s in seen)]
        if not apart:
            if isinstance(dataset, MixDataset):
                dataset._measure()
            return
        if round_ == _AGREE_ROUNDS:
            break
        failed = []  # why this rank could not reopen a member, in one line each
        for j in apart:
            m = members[j]
            if not isinstance(m, ShardDataset):
                failed.append(f"{type(m).__name__} is not a packer dataset (it cannot be reopened)")
                continue
            try:
                m._reopen()
            except Exception as e:  # any failure is voted on: a rank that raised alone would hang the rest
                failed.append(f"{m.root}: {type(e).__name__}: {e}")
        told = [None] * world
        dist.all_gather_object(told, failed)
        if any(told):
            break
    opened = "; ".join(
        f"rank {r}: " + ", ".join(f"{root} version {digest[:12]} ({count} records)" for digest, count, root in s)
        for r, s in enumerate(seen)
    )
    why = "; ".join(f"rank {r}: {problem}" for r, problems in enumerate(told) for problem in problems)
    raise VersionsDiffer(
        f"the ranks opened different versions of the dataset (a refresh landed between their opens) and "
        f"cannot all reopen one: {opened}" + (f" (reopening failed: {why})" if why else "") + ". Open the "
        "dataset on every rank after a torch.distributed.barrier() that follows the refresh, or run the job again"
    )


#: Rounds of reopening the newest version in :func:`_agree_on_version` before the ranks give up.
_AGREE_ROUNDS = 3


def _opened(dataset: Any) -> tuple[str, int, str]:
    """What a rank opened: (manifest digest, length, root)."""
    if not isinstance(dataset, ShardDataset):
        return "", len(dataset), type(dataset).__name__
    return dataset.manifest.manifest_digest or dataset.manifest.digest, len(dataset), dataset.root


def _default_block(dataset: Any) -> int:
    """Records per block for order="block": about 4 MiB of records (at least 16)."""
    lengths = [i["length"] for i in _indexes(dataset) if len(i)]
    mean = float(np.concatenate(lengths).mean()) if lengths else 65536.0
    return max(16, math.ceil((4 << 20) / max(mean, 1.0)))


def _block_permutation(
    rng: np.random.Generator, size: int, block_size: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``block_size`` consecutive records in random order; records shuffled within each
    run of ``window`` consecutive blocks of that order. Also each draw's window."""
    records = np.arange(size)
    block_rank = np.argsort(rng.permutation(-(-size // block_size)))
    window_of = block_rank[records // block_size] // window
    perm = np.lexsort((rng.random(size), window_of))
    return perm, window_of[perm]


def _fetch_units(dataset: Any) -> list[tuple[int, Optional[int]]]:
    """(records per cache unit, cache limit) of each member in object storage (ShardDataset.fetch_unit)."""
    members = getattr(dataset, "datasets", [dataset])  # a mix: its members'
    found = [m.fetch_unit() for m in members if hasattr(m, "fetch_unit")]
    return [f for f in found if f is not None]


def label_entropy(labels: np.ndarray, sequence: np.ndarray, batch_size: int) -> float:
    """Mean Shannon entropy (bits) of the labels in each whole batch of ``sequence``: 0 where every
    batch holds one class, log2(min(classes, batch_size)) at most. Labels below 0 (none) count as one."""
    batches = len(sequence) // batch_size
    if batches == 0:
        return 0.0
    drawn = np.asarray(labels, dtype=np.int64)[np.asarray(sequence)[: batches * batch_size]] + 1
    kinds = int(drawn.max()) + 1
    _, counts = np.unique(np.repeat(np.arange(batches), batch_size) * kinds + drawn, return_counts=True)
    p = counts / batch_size  # each (batch, label) pair's share of its batch
    return float(-(p * np.log2(p)).sum() / batches)


def _mixing_window(sampler: ShardSampler, units: list[tuple[int, Optional[int]]]) -> int:
    """The smallest power-of-two window whose batches (of :data:`MIX_BATCH`) have at least
    :data:`MIX_TARGET` of a global shuffle's label entropy, measured on one epoch of each
    candidate's order (seeded: a function of the dataset alone; more blocks a window never mix
    less, so the powers are searched by bisection); no larger than the cache limit holds with the
    windows fetched ahead. Unlabeled or multi-label: :data:`UNLABELED_WINDOW`."""
    n, block = sampler.size, sampler.block_size
    most = -(-n // block)
    limited = [(per_unit, limit) for per_unit, limit in units if limit is not None and per_unit]
    if limited:  # the mean record's bytes, over every member's index at once
        record_bytes = max(1.0, float(np.concatenate([i["length"] for i in _indexes(sampler.dataset)]).mean()))
        for per_unit, limit in limited:
            most = min(most, max(1, int(limit // (per_unit * record_bytes * (sampler.prefetch + 2)))))
    labels = np.asarray(getattr(sampler.dataset, "labels", np.full(n, -1)))
    if (labels < 0).all():
        return min(UNLABELED_WINDOW, most)
    batch = min(MIX_BATCH, n)
    probe = batch * MIX_PROBE_BATCHES
    target = MIX_TARGET * label_entropy(labels, default_rng(0).permutation(n)[:probe], batch)
    lo, hi = 0, max(0, (most - 1).bit_length())  # exponents: 2**hi >= most
    while lo < hi:
        mid = (lo + hi) // 2
        order = _block_permutation(default_rng(0), n, block, 1 << mid)[0][:probe]
        if label_entropy(labels, order, batch) >= target:
            hi = mid
        else:
            lo = mid + 1
    return min(1 << lo, most)


def _indexes(dataset: Any) -> list[np.ndarray]:
    """The index of the dataset (a mix: of each member)."""
    return [d.index for d in getattr(dataset, "datasets", [dataset]) if getattr(d, "index", None) is not None]


def _words(config: str) -> dict[str, str]:
    """:meth:`ShardSampler.config`'s ``name=value`` words as a dict."""
    return dict(w.partition("=")[::2] for w in config.split())


def _integer(name: str, value: Any) -> int:
    """``value`` as an int (a bool or float is refused: 2.5 repeats is not a count)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None


def _refuse_concat(dataset: Any) -> None:
    """A torch ConcatDataset of packer datasets would drop every draw's key (its index arithmetic
    returns plain ints) and never pass set_epoch on: the same crops every epoch."""

    def holds_shards(ds: Any) -> bool:
        return isinstance(ds, (ShardDataset, MixDataset)) or (
            isinstance(ds, ConcatDataset) and any(map(holds_shards, ds.datasets))
        )

    if isinstance(dataset, ConcatDataset) and holds_shards(dataset):
        raise ValueError(
            "ShardSampler over a torch ConcatDataset of ShardDatasets would give the same crops every "
            "epoch (it drops the draws' keys and set_epoch): use packer.MixDataset([...]) instead "
            "(and ShardSampler(mix, proportions=...) for per-dataset shares)"
        )


def _member_sizes(dataset: Any) -> Optional[np.ndarray]:
    """A MixDataset's member sizes (what ``proportions`` and the state's config refer to), else None."""
    return dataset.sizes if isinstance(dataset, MixDataset) else None


def _member_counts(sizes: np.ndarray, proportions: Sequence[float], num_samples: int) -> np.ndarray:
    """Draws per member for ``proportions`` (largest remainders, so they add up to num_samples)."""
    p = np.asarray(proportions, dtype=np.float64)
    if p.shape != sizes.shape or not np.isfinite(p).all() or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"proportions must be {len(sizes)} finite non-negative numbers (one per member), not all zero")
    if ((p > 0) & (sizes == 0)).any():
        raise ValueError("proportions give draws to an empty member dataset")
    exact = p / p.sum() * num_samples
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: num_samples - int(counts.sum())]] += 1
    return counts
