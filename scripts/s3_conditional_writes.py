#!/usr/bin/env python3
"""What an S3 server does with conditional writes, the facts packer's one-writer lease and its
pointer commit rest on (docs/OBJECT-STORAGE.md, "What the store must support"): PUT with
``If-None-Match: *`` on an existing key, ``If-Match`` with a stale and with the current ETag,
DeleteObject and CompleteMultipartUpload with them; then races: THREADS writers at once, each
with its own connection, PUTting the same key conditionally, TRIALS times, counting the winners.

    python scripts/s3_conditional_writes.py [--trials 20] [--threads 16]

Starts SeaweedFS on 127.0.0.1 (tests/store/seaweed.py) unless AWS_ENDPOINT_URL and the AWS keys
point at another server and --bucket names a bucket there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer.errors import PreconditionFailed  # noqa: E402
from packer.store import open_store  # noqa: E402
from packer.store.base import Store  # noqa: E402
from packer.store.s3 import S3Store  # noqa: E402
from tests.store.seaweed import seaweed  # noqa: E402

STALE = '"0123456789abcdef0123456789abcdef"'


def outcome(write: Callable[[], object]) -> str:
    try:
        write()
    except PreconditionFailed:
        return "refused (412)"
    return "accepted"


def single(store: Store) -> list[tuple[str, str]]:
    first = store.put("k", b"one")
    rows = [("PUT If-None-Match: * on an existing key", outcome(lambda: store.put("k", b"two", if_none_match=True)))]
    rows.append(("PUT If-Match: stale ETag", outcome(lambda: store.put("k", b"two", if_match=STALE))))
    rows.append(("PUT If-Match: any ETag, key absent", outcome(lambda: store.put("absent", b"x", if_match=first.etag))))
    rows.append(("DELETE If-Match: stale ETag", outcome(lambda: store.delete("k", if_match=STALE))))
    rows.append(("PUT If-Match: current ETag", outcome(lambda: store.put("k", b"two", if_match=first.etag))))
    return rows


def multipart(store: Store) -> list[tuple[str, str]]:
    """CompleteMultipartUpload with each condition, through botocore's client (packer's put_file
    sends none: only the pointer, one PUT, is conditional)."""
    import botocore.exceptions
    import botocore.session

    assert isinstance(store, S3Store)
    client = botocore.session.get_session().create_client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    key = f"{store.prefix}/k" if store.prefix else "k"
    rows = []
    for label, condition in [("If-None-Match: *", {"IfNoneMatch": "*"}), ("If-Match: stale", {"IfMatch": STALE})]:
        upload = client.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
        part = client.upload_part(Bucket=store.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"p")
        parts = {"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]}
        try:
            client.complete_multipart_upload(
                Bucket=store.bucket, Key=key, UploadId=upload, MultipartUpload=parts, **condition
            )
            result = "accepted"
        except botocore.exceptions.ClientError as e:
            result = f"refused ({e.response['ResponseMetadata']['HTTPStatusCode']})"
            client.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=upload)
        rows.append((f"CompleteMultipartUpload {label} on an existing key", result))
    return rows


def races(url: str, trials: int, threads: int) -> list[tuple[str, str]]:
    stores = [open_store(url) for _ in range(threads)]  # one connection pool per writer
    counts: dict[str, list[int]] = {"If-None-Match: *": [], "If-Match: current ETag": []}
    for t in range(trials):
        key = f"race-{t}"

        def one(i: int, condition: dict[str, object], key: str = key) -> int:
            try:
                stores[i].put(key, b"%d" % i, **condition)  # type: ignore[arg-type]
            except PreconditionFailed:
                return 0
            return 1

        with ThreadPoolExecutor(threads) as pool:
            create = functools.partial(one, condition={"if_none_match": True})
            counts["If-None-Match: *"].append(sum(pool.map(create, range(threads))))
            replace = functools.partial(one, condition={"if_match": stores[0].head(key).etag})
            counts["If-Match: current ETag"].append(sum(pool.map(replace, range(threads))))
    return [
        (
            f"{threads} racing PUT {name}",
            f"{sum(1 for n in won if n == 1)} of {trials} trials had one winner; most winners {max(won)}",
        )
        for name, won in counts.items()
    ]


@contextlib.contextmanager
def server(bucket: str) -> Iterator[str]:
    if bucket:
        yield f"s3://{bucket}/packer-conditional-writes"
        return
    with tempfile.TemporaryDirectory() as tmp, seaweed(Path(tmp)) as s:
        os.environ.update(s.env())
        yield f"s3://{s.bucket}/conditional"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--bucket", default="", help="a bucket of the server AWS_ENDPOINT_URL names")
    args = parser.parse_args()
    with server(args.bucket) as url:
        store = open_store(url)
        rows = single(store) + multipart(store) + races(url, args.trials, args.threads)
    width = max(len(r[0]) for r in rows)
    for what, result in rows:
        print(f"{what:<{width}}  {result}")


if __name__ == "__main__":
    main()
