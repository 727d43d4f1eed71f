"""What a refresh costs when a few files changed (format 3's segments): `packer build --update` after one
file of the tree was touched, warm and cold (the dataset's pages evicted first), alternately; the extra
disk each refresh left (bytes of the new version's files that are not the old version's, linked); then
`packer verify` of the result and `packer compact`.

Starts from copies made of hard links (``cp -al``: no disk, nothing of the originals is written) of a
tree and of a dataset built from it, e.g. scripts/bench_scale.py's (``--keep``):

    python scripts/bench_scale.py --sizes 100000 --keep       # makes $TMPDIR/packer-scale/raw-100000-500x375
    python scripts/bench_refresh.py RAW DATASET [--rounds 3]

Figures and the commands used are in docs/PERFORMANCE.md ("Refresh cost with segments").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_scale
from bench_scale import run, touch
from pagecache import evict, files

WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "packer-refresh"


def inodes(dataset: Path) -> dict[int, int]:
    """inode -> size of the dataset's files."""
    return {f.stat().st_ino: f.stat().st_size for f in files(dataset)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    bench_scale.WORK.mkdir(parents=True, exist_ok=True)  # where run() leaves each step's peak memory
    raw, out = WORK / "raw", WORK / args.dataset.name
    subprocess.run(["cp", "-al", str(args.raw), str(raw)], check=True)
    subprocess.run(["cp", "-al", str(args.dataset), str(out)], check=True)
    every = sorted(raw.rglob("*.jpg"))
    total = sum(size for size in inodes(out).values())
    print(f"{out.name}: {len(every):,} files, {total / 1e6:,.0f} MB")
    t, rss = run(["build", str(raw), str(out), "--update", "--quiet"])
    print(f"update, nothing changed: {t:.2f} s ({rss})")
    for k in range(2 * args.rounds):
        cold = k % 2 == 1
        touch(raw, [every[(k + 1) * len(every) // (2 * args.rounds + 1)]])
        before = inodes(out)
        if cold:
            evict(out)
        t, rss = run(["build", str(raw), str(out), "--update", "--quiet"])
        extra = sum(size for ino, size in inodes(out).items() if ino not in before)
        manifest = json.loads((out / "manifest.json").read_text())
        print(
            f"update, 1 file touched, {'cold' if cold else 'warm'}: {t:.2f} s ({rss}); extra disk {extra / 1e6:.1f} MB "
            f"= {extra / total:.2%} of the dataset; segments {manifest['segments']}, "
            f"dead {manifest['dead_bytes'] / 1e6:.2f} MB"
        )
    evict(out)
    t, rss = run(["verify", str(out)])
    print(f"verify, cold: {t:.1f} s ({rss})")
    t, rss = run(["compact", str(out)])
    print(f"compact: {t:.1f} s ({rss}); digest {json.loads((out / 'manifest.json').read_text())['digest']}")
    shutil.rmtree(WORK)


if __name__ == "__main__":
    main()
