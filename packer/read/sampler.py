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
across the ranks. Resuming: the state is (epoch, position), the number of global draws consumed;
with all ranks in step, rank ``r`` then continues at ``position + r``, whatever ``W`` is now.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np
from torch.utils.data import Sampler

ORDERS = ("random", "sequential", "block")
Ranges = tuple[tuple[int, int], ...]  # record ranges (first, end)


class Draw(int):
    """A record index drawn by :class:`ShardSampler`, carrying the key of its augmentation: the
    epoch and its position ``draw`` in the epoch's global sequence. ``int(d)`` is the record.
    ``ahead``: record ranges ``(first, end)`` that will be read soon (``order="block"``: the blocks
    of the next window, on the window's first draw), for the dataset to ask of the disk at once."""

    epoch: int
    draw: int
    ahead: Ranges

    def __new__(cls, record: int, epoch: int, draw: int, ahead: Ranges = ()) -> Draw:
        self = int.__new__(cls, record)
        self.epoch, self.draw, self.ahead = epoch, draw, ahead
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return Draw, (int(self), self.epoch, self.draw, *((self.ahead,) if self.ahead else ()))

    def __repr__(self) -> str:
        more = f", ahead={self.ahead}" if self.ahead else ""
        return f"Draw(record={int(self)}, epoch={self.epoch}, draw={self.draw}{more})"


class ShardSampler(Sampler[Draw]):
    """Seeded, distributed, resumable draws for a map-style DataLoader over a ShardDataset.

    ``DataLoader(ds, batch_size=B, sampler=ShardSampler(ds))``, then ``sampler.set_epoch(e)`` each
    epoch (it sets the dataset's epoch too). Options:

    - ``shuffle``/``order``: ``"random"`` (default), ``"sequential"``, or ``"block"``: blocks of
      ``block_size`` records stored together, in random block order, records shuffled within each
      ``window`` of consecutive blocks (reads stay within a window's region of the files: for data
      bigger than the page cache; docs/DATASET.md gives the shuffle quality measured);
    - ``weights`` (one per record) or ``balanced=True`` (inverse class frequency): ``num_samples``
      picks (default: len(dataset)) with replacement;
    - ``num_samples`` unweighted: that many draws, from as many permutations as it takes (with
      ``replacement=True``: uniform picks);
    - ``repeats=N``: each pick drawn N times in a row (repeated augmentation: N crops; distributed,
      on N consecutive ranks);
    - ``num_replicas``/``rank``: default from torch.distributed when initialised, else 1/0;
      ``drop_last=True`` drops the last draws so that every rank gets as many (a rank may otherwise
      get one fewer, and DDP needs every rank to take the same number of steps).

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
        window: int = 16,
        prefetch: int = 1,
    ) -> None:
        order = order or ("random" if shuffle else "sequential")
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
        if repeats < 1 or (num_samples is not None and num_samples < 1) or window < 1 or prefetch < 0:
            raise ValueError("repeats, num_samples and window must be positive, prefetch not negative")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialised else 1)
            rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), not {rank}")
        self.dataset = dataset
        self.seed = int(seed if seed is not None else getattr(dataset, "seed", 0))
        self.order = order
        self.size = n
        self.num_samples = num_samples if num_samples is not None else n
        self.replacement = replacement or self.weights is not None
        self.repeats = repeats
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last = drop_last
        self.block_size = block_size or _default_block(dataset)
        self.window = window
        self.prefetch = prefetch
        self.epoch = 0
        self._resume: Optional[int] = None  # global position the next iteration starts at
        self._base = 0  # global position the current iteration started at
        self._yielded = 0  # draws this rank yielded in the current iteration
        self._done_epoch: Optional[int] = None  # the epoch last iterated to its end

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
        rng = np.random.default_rng([self.seed & (2**63 - 1), int(epoch)])
        n = self.size
        windows = None
        if self.weights is not None:
            picks = rng.choice(n, size=self.num_samples, replace=True, p=self.weights)
        elif self.replacement:
            picks = rng.integers(0, n, self.num_samples)
        elif self.order == "sequential":
            picks = np.arange(self.num_samples) % n
        elif self.order == "block":
            parts = [self._block_permutation(rng) for _ in range(-(-self.num_samples // n))]
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

    def _block_permutation(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of ``block_size`` consecutive records in random order; records shuffled within
        each run of ``window`` consecutive blocks of that order. Also each draw's window."""
        records = np.arange(self.size)
        block_rank = np.argsort(rng.permutation(-(-self.size // self.block_size)))
        window_of = block_rank[records // self.block_size] // self.window
        perm = np.lexsort((rng.random(self.size), window_of))
        return perm, window_of[perm]

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

    def _span(self, start: int) -> tuple[int, int]:
        """(first, end) global positions of this rank's draws in an iteration starting at ``start``."""
        end = self.total
        if self.drop_last:
            end -= (end - start) % self.num_replicas
        return start + self.rank, end

    def __len__(self) -> int:
        """This rank's draws in a whole epoch (also while resuming mid-epoch: loops such as
        Lightning's compare the batches they restored with the epoch's length)."""
        first, end = self._span(0)
        return max(0, -(-(end - first) // self.num_replicas))

    def __iter__(self) -> Iterator[Draw]:
        start, self._resume = self._resume or 0, None
        epoch = self.epoch
        if start == 0 and self._done_epoch == epoch:
            warnings.warn(
                f"ShardSampler: epoch {epoch} iterated again without set_epoch(): the same order "
                "and augmentation as last time",
                stacklevel=2,
            )
        self._base, self._yielded = start, 0
        first, end = self._span(start)
        positions = np.arange(first, end, self.num_replicas)
        sequence, windows = self._plan(epoch)
        ahead = self._ahead(sequence, windows, positions) if windows is not None and self.prefetch else {}
        for k, record in zip(positions.tolist(), sequence[positions].tolist()):
            self._yielded += 1
            yield Draw(record, epoch, k, ahead.get(k, ()))
        self._done_epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and augmentation (the dataset's ``set_epoch`` too). Setting the
        epoch a loaded state is in keeps its position; any other epoch starts at its beginning."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self._resume, self._base, self._yielded = None, 0, 0
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # --- resume ----------------------------------------------------------------------------------

    def state_dict(self, consumed: Optional[int] = None) -> dict[str, int]:
        """``{"epoch", "position", "seed", "total"}``: ``position`` is the global draws consumed.

        ``consumed``: samples this rank's loop has taken from the current iteration (a plain
        DataLoader runs ahead of the loop: workers prefetch, so the sampler cannot know). Without
        it: the draws this sampler has yielded, which is what torchdata's StatefulDataLoader asks
        at the moment matching the batch it hands out."""
        if self._resume is not None:
            position = self._resume
        else:
            done = self._yielded if consumed is None else consumed
            position = min(self.total, self._base + done * self.num_replicas)
        return {"epoch": self.epoch, "position": position, "seed": self.seed, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from any number of ranks): its epoch, at its position."""
        if int(state["seed"]) != self.seed or int(state["total"]) != self.total:
            raise ValueError(
                f"sampler state for seed {state['seed']} and {state['total']} draws an epoch, but this "
                f"sampler has seed {self.seed} and {self.total}: it would not continue the same order"
            )
        if not 0 <= int(state["position"]) <= self.total:
            raise ValueError(f"sampler state position {state['position']} outside 0..{self.total}")
        self.set_epoch(int(state["epoch"]))
        self._resume = int(state["position"])
        self._done_epoch = None


def _default_block(dataset: Any) -> int:
    """Records per block for order="block": about 4 MiB of records (at least 16)."""
    lengths = getattr(dataset, "index", None)
    mean = float(lengths["length"].mean()) if lengths is not None and len(lengths) else 65536.0
    return max(16, math.ceil((4 << 20) / max(mean, 1.0)))
