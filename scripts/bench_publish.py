"""What a nightly refresh of a dataset in object storage costs: `packer build raw/ s3://... --update`
after one file was touched, beside the local `packer build raw/ OUT --update` of the same change, on
SeaweedFS on 127.0.0.1 (tests/store/seaweed.py) through the counting proxy (tests/store/proxy.py):
wall time of each (medians over --rounds), the bytes the publish uploaded against the dataset's, and
the requests of an --update that finds nothing changed.

    python scripts/bench_publish.py [--images 20000] [--rounds 3]

Goals (issue 24): the publish uploads < 1% of the dataset's bytes and takes < 2x the local --update;
nothing changed: no upload. Figures and the command are in docs/PERFORMANCE.md ("Publishing to
object storage").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.store import open_store  # noqa: E402
from packer.store.published import read_files, version_id  # noqa: E402
from packer.tools.sample import make_folder  # noqa: E402
from tests.store.proxy import start  # noqa: E402
from tests.store.seaweed import seaweed  # noqa: E402


def packer(*args: str, env: dict[str, str]) -> float:
    """Wall seconds of ``packer ARGS`` (a fresh process, as cron runs it)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "packer.cli", *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"packer {' '.join(args)} failed:\n{proc.stderr}")
    return time.perf_counter() - t0


def touch(path: Path) -> None:
    """A new identity (mtime) for one file, as an edit would give it."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--size", type=int, nargs=2, default=(320, 240), metavar=("W", "H"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, seaweed(Path(tmp)) as server:
        work = Path(tmp) / "work"
        raw, local = work / "raw", work / "local"
        every = make_folder(raw, args.images, size=tuple(args.size), workers=2)
        proxy, proxy_server = start(server.endpoint)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PACKER_CACHE_DIR=str(work / "cache")) | server.env(proxy.url)
        url = f"s3://{server.bucket}/bench/train"
        common = ["--quiet"]
        first_local = packer("build", str(raw), str(local), *common, env=env)
        first_publish = packer("build", str(raw), url, *common, env=env)
        os.environ.update(env)
        store = open_store(url)
        current = version_id(store.get("manifest.json"))
        files = read_files(store, current) or {}
        data_bytes = sum(e.size for e in files.values())
        metadata = (o.size for o in store.list(f"versions/{current}/") if o.key.rsplit("/", 1)[-1] not in files)
        total = data_bytes + sum(metadata)
        print(
            f"{args.images:,} images of {args.size[0]}x{args.size[1]}: dataset {total / 1e6:.1f} MB in the bucket "
            f"({len(files)} data files); first build {first_local:.1f} s, first publish {first_publish:.1f} s"
        )
        local_s, publish_s, uploaded = [], [], []
        for k in range(args.rounds):
            touch(every[(k + 1) * len(every) // (args.rounds + 1)])
            order = [("local", str(local)), ("publish", url)]
            for what, out in order if k % 2 == 0 else order[::-1]:
                proxy.clear()
                t = packer("build", str(raw), out, *common, "--update", env=env)
                if what == "local":
                    local_s.append(t)
                else:
                    publish_s.append(t)
                    uploaded.append(sum(proxy.received.values()))
        proxy.clear()
        nothing_s = packer("build", str(raw), url, *common, "--update", env=env)
        methods = Counter(method for (method, _), n in proxy.requests.items() for _ in range(n))
        proxy_server.shutdown()
    local_m, publish_m, sent_m = (statistics.median(v) for v in (local_s, publish_s, uploaded))
    print(
        f"one file touched, medians of {args.rounds}: local --update {local_m:.2f} s, publish --update "
        f"{publish_m:.2f} s ({publish_m / local_m:.2f}x); uploaded {sent_m / 1e3:.1f} kB = "
        f"{100 * sent_m / total:.3f}% of the dataset"
    )
    print(f"  every round: local {local_s}, publish {publish_s}, uploaded {uploaded}")
    writes = sum(n for m, n in methods.items() if m in ("PUT", "POST", "DELETE"))
    print(f"nothing changed: publish --update {nothing_s:.2f} s, requests {dict(methods)}, {writes} writes")
    goals = {
        "uploads < 1% of the dataset": sent_m < 0.01 * total,
        "publish < 2x local --update": publish_m < 2 * local_m,
        "nothing changed: no upload": writes == 0,
    }
    for goal, met in goals.items():
        print(f"  {'met' if met else 'MISSED'}: {goal}")


if __name__ == "__main__":
    main()
