"""Memory and time of `--update`'s path join (which old record each scanned file had) at ImageNet
scale: ``packer.builder.update.PathIndex`` against the dict of every old path it replaced, on synthetic
ImageNet-style paths (``n01440764/n01440764_10026.JPEG``), each in a fresh process, alternately. Peak
memory is the process's peak RSS growth over the join (VmHWM after minus VmRSS before).

    python scripts/bench_join.py [--files 1000000] [--repeats 3]

Figures: docs/PERFORMANCE.md ("Refresh cost with segments").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import sys, time
import numpy as np
from packer.format import INDEX_DTYPE
from packer.builder.update import PathIndex

def status(field):
    with open("/proc/self/status") as f:
        return int(next(l.split()[1] for l in f if l.startswith(field)))

n, how = int(sys.argv[1]), sys.argv[2]
rels = [f"n{c:08d}/n{c:08d}_{i:06d}.JPEG" for i, c in ((i, i % 1000) for i in range(n))]
rels.sort()
blob = "".join(rels).encode()
index = np.zeros(n, INDEX_DTYPE)
lengths = np.array([len(r) for r in rels], np.uint64)
index["src_length"], index["src_offset"] = lengths, np.concatenate([[0], np.cumsum(lengths)[:-1]])
paths = np.frombuffer(blob, np.uint8)
scan = rels[: n // 2] + ["n99999999/new.JPEG"] + rels[n // 2 + 1 :]  # one file replaced by another
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
start = time.perf_counter()
if how == "dict":  # what reuse_plan did before
    old = {
        bytes(paths[o : o + k]).decode("utf-8", "surrogateescape"): j
        for j, (o, k) in enumerate(zip(index["src_offset"].tolist(), index["src_length"].tolist()))
    }
    candidate = np.array([old.get(r, -1) for r in scan], dtype=np.int64)
else:
    candidate = PathIndex(index, paths).find(scan)
seconds = time.perf_counter() - start
assert (candidate >= 0).sum() == n - 1
print(seconds, (status("VmHWM:") - base) / 1024)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"dict": [], "hash join": []}
    for _ in range(args.repeats):
        for how in got:
            run = subprocess.run(
                [sys.executable, "-c", _RUN, str(args.files), how], capture_output=True, text=True, check=True
            )
            seconds, mb = (float(v) for v in run.stdout.split())
            got[how].append((seconds, mb))
    for how, runs in got.items():
        seconds, mb = statistics.median(s for s, _ in runs), statistics.median(m for _, m in runs)
        each = ", ".join(f"{s:.2f} s/{m:.0f} MB" for s, m in runs)
        print(f"{how}: {seconds:.2f} s, peak +{mb:.0f} MB (runs: {each})")


if __name__ == "__main__":
    main()
