"""The long soak of the remote path (issue 39; tests/store/test_soak.py is its minute in the suite):
DDP ranks (spawned, gloo on 127.0.0.1, an all_reduce per batch) x persistent DataLoader workers
reading one dataset from a SeaweedFS server this script starts (tests/store/seaweed.py, on
loopback, killed at the end) through one node cache of half the data, default ShardSampler, a
refresh published every --publish-every epochs while they read; for at least --epochs epochs and
--minutes minutes. One line per epoch, then the verdict: PASS, or FAIL with what was wrong (a
rank with no batch for --stall-s seconds: every process's stacks, summarised; the full dumps stay
in the run's folder). Exit status 0 on PASS, 1 on FAIL.

    python scripts/soak_remote.py --ranks 8 --workers 2 --minutes 10 --start-method spawn
    python scripts/soak_remote.py --ranks 4 --epochs 100 --side 64 --unit-bytes 65536

Every run is bounded: a hang is a stall (--stall-s), after which every process it started is killed."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.store.proxy import Faults, start  # noqa: E402
from tests.store.seaweed import seaweed  # noqa: E402
from tests.store.soak import Soak, soak, verdict  # noqa: E402

DEFAULT = Soak()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=DEFAULT.workers, help="persistent DataLoader workers a rank")
    parser.add_argument("--epochs", type=int, default=DEFAULT.epochs, help="at least this many epochs")
    parser.add_argument("--minutes", type=float, default=10.0, help="and at least this long")
    parser.add_argument(
        "--start-method", default="fork", help="of the workers: fork, spawn, forkserver, or a list (rank by rank)"
    )
    parser.add_argument("--records", type=int, default=DEFAULT.records, help="in the first version (x --ranks)")
    parser.add_argument("--side", type=int, default=DEFAULT.side, help="the images' height (records: 3.75 side^2 B)")
    parser.add_argument("--unit-bytes", type=int, default=DEFAULT.unit_bytes, help="packer's settings.UNIT_BYTES")
    parser.add_argument("--batch-size", type=int, default=DEFAULT.batch_size)
    parser.add_argument("--publish-every", type=int, default=DEFAULT.publish_every, help="epochs a refresh (0: none)")
    parser.add_argument("--delay", type=float, default=0.0, help="first-byte wait of every GET (a proxy adds it)")
    parser.add_argument("--stall-s", type=float, default=DEFAULT.stall_s, help="no batch for this long: a hang")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (the stack dumps are kept on FAIL)")
    args = parser.parse_args()
    shape = Soak(
        ranks=args.ranks,
        workers=args.workers,
        epochs=args.epochs,
        minutes=args.minutes,
        contexts=tuple(args.start_method.split(",")),
        records=args.records,
        side=args.side,
        batch_size=args.batch_size,
        unit_bytes=args.unit_bytes,
        publish_every=args.publish_every,
        stall_s=args.stall_s,
    )
    print(shape, flush=True)
    root = Path(tempfile.mkdtemp(prefix="packer-soak-"))
    for part in ("run", "seaweedfs"):
        (root / part).mkdir()
    with seaweed(root / "seaweedfs") as server:
        proxy, http = start(server.endpoint) if args.delay else (None, None)  # in this process's threads
        if proxy is not None:
            proxy.faults.append(Faults(delay=args.delay))
        os.environ.update(server.env(proxy.url if proxy else ""), PACKER_CACHE_DIR=str(root / "publisher-cache"))
        try:
            run = soak(server, root / "run", shape, say=lambda line: print(line, flush=True))
        finally:
            if http is not None:
                http.shutdown()
    wrong = verdict(run)
    summary = f"{run.epochs} epochs of {shape.ranks} ranks x {shape.workers} {args.start_method} workers"
    summary += f" in {run.seconds:.0f} s, {len(run.published)} published, du peak {run.peak} of {run.limit}"
    if wrong or args.keep:
        summary += f"; kept {root}"
    else:
        shutil.rmtree(root)
    print(("FAIL: " + "\n".join(wrong) if wrong else "PASS") + f" ({summary})", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
