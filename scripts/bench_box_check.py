"""What the read path's box check costs (issue 40 item 3): :func:`packer.transform.fields.check_boxes`
once a batch over its concatenated boxes (what readers do), against the same check per sample (what
a check in each record's decode would cost), for batches of 256 images of 0, 7 (COCO's mean) and 30
boxes each; best of ``--repeats``.

    .venv/bin/python scripts/bench_box_check.py [--batch 256] [--repeats 15]
"""

from __future__ import annotations

import argparse
import functools
import timeit

import numpy as np

from packer.format.fields import bad_box
from packer.transform.fields import check_boxes


def _each(batch: list[np.ndarray]) -> None:
    for boxes in batch:
        bad_box(boxes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for per in (0, 7, 30):
        batch = []
        for _ in range(args.batch):
            xy = rng.random((per, 2), dtype=np.float32) * 300
            batch.append(np.concatenate([xy, xy + rng.random((per, 2), dtype=np.float32) * 50], axis=1))
        every = np.concatenate(batch)
        at = np.repeat(np.arange(args.batch), per)
        once = min(timeit.repeat(functools.partial(check_boxes, every, at), number=100, repeat=args.repeats)) / 100
        each = min(timeit.repeat(functools.partial(_each, batch), number=10, repeat=args.repeats)) / 10
        print(
            f"{per:>2} boxes/image: once a batch {once / args.batch * 1e9:6.0f} ns/sample, "
            f"per sample {each / args.batch * 1e9:6.0f} ns/sample"
        )


if __name__ == "__main__":
    main()
