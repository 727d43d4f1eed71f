"""The red-team's shared tools (tests/store/test_redteam_*.py): a dataset's objects as a bucket holds
them, edited by an attack and uploaded to the real S3 server; one attempt to read it through a node
cache; and the outcome's checks that every attack asserts: the right bytes or one line of a packer
error naming the object, the cache within its limit as ``du`` counts it, and the cache usable after."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from packer import ShardDataset
from packer.errors import PackerError
from packer.format import INDEX, LABELS, MANIFEST, SOURCES, TARGETS, index_digest, logical_digest, manifest_digest
from packer.format.label_arrays import arrays_digest
from packer.store.published import FILES, FileEntry, files_json, version_id, version_key

from .seaweed import S3Server

#: What an attempt's thread may take at most (a read of 18 small photos takes well under a second):
#: past it, the attempt hung.
ATTEMPT_S = 60.0
ARRAYS = (INDEX, SOURCES, LABELS, TARGETS)


@dataclass
class Copy:
    """A dataset's objects as an attack edits them: its manifest (parsed), its arrays and data files
    (bytes), and for the published layout its ``files.json`` entries (None: a copy synced as it is).
    ``extra``: more objects by key (None deletes the key after the upload)."""

    manifest: dict[str, Any]
    arrays: dict[str, bytes]
    data: dict[str, bytes]
    files: Optional[dict[str, dict[str, Any]]] = None
    parent: str = ""
    extra: dict[str, Optional[bytes]] = field(default_factory=dict)
    text: Optional[bytes] = None  # the manifest's bytes as uploaded, where an attack sets them itself
    files_text: Optional[bytes] = None  # files.json's bytes, likewise

    @classmethod
    def of(cls, local: Path, *, published: bool) -> Copy:
        manifest = json.loads((local / MANIFEST).read_bytes())
        arrays = {n: (local / n).read_bytes() for n in ARRAYS if (local / n).exists()}
        names = [p.name for p in sorted(local.iterdir()) if p.is_file() and p.name not in (MANIFEST, *ARRAYS)]
        names = [n for n in names if not n.endswith((".lock", ".json"))]
        data = {n: (local / n).read_bytes() for n in names}
        copy = cls(manifest, arrays, data)
        if published:
            version = copy.version
            copy.files = {n: {"key": version_key(version, n), "size": len(b)} for n, b in data.items()}
        return copy

    def index(self) -> np.ndarray:
        return np.load(io.BytesIO(self.arrays[INDEX]), allow_pickle=False)

    def set_index(self, rows: np.ndarray) -> None:
        out = io.BytesIO()
        np.save(out, rows, allow_pickle=False)
        self.arrays[INDEX] = out.getvalue()

    def reseal(self) -> None:
        """The manifest's digests recomputed for what the attack changed: a forger's copy, whose
        checks pass up to the records' own bytes."""
        rows = self.index()
        self.manifest["index_digest"] = index_digest(rows)
        labels = self.arrays.get(LABELS)
        label_digest = arrays_digest(
            None if labels is None else np.load(io.BytesIO(labels)),
            None if TARGETS not in self.arrays else np.load(io.BytesIO(self.arrays[TARGETS])),
        )
        if self.manifest.get("format_version", 0) >= 3:
            self.manifest["digest"] = logical_digest(rows, label_digest)
        self.manifest["manifest_digest"] = manifest_digest(self.manifest)

    def manifest_bytes(self) -> bytes:
        return self.text if self.text is not None else json.dumps(self.manifest, indent=1, sort_keys=True).encode()

    @property
    def version(self) -> str:
        return version_id(self.manifest_bytes())

    def objects(self) -> dict[str, tuple[bytes, dict[str, str]]]:
        """Key (relative to the dataset's URL) -> (bytes, user metadata), as the bucket holds them."""
        text = self.manifest_bytes()
        if self.files is None:
            out: dict[str, tuple[bytes, dict[str, str]]] = {MANIFEST: (text, {})}
            out |= {n: (b, {}) for n, b in {**self.arrays, **self.data}.items()}
        else:
            v = version_id(text)
            out = {MANIFEST: (text, {"packer-layout": "versions"}), version_key(v, MANIFEST): (text, {})}
            out |= {version_key(v, n): (b, {}) for n, b in self.arrays.items()}
            for n, b in self.data.items():
                out[version_key(v, n)] = (b, {})
            entries = {n: FileEntry(e["key"], e["size"], e.get("sha256", "")) for n, e in self.files.items()}
            listing = self.files_text if self.files_text is not None else files_json(entries, parent=self.parent)
            out[version_key(v, FILES)] = (listing, {})
        for key, body in self.extra.items():
            if body is not None:
                out[key] = (body, {})
            else:
                out.pop(key, None)
        return out


def upload(server: S3Server, prefix: str, objects: dict[str, tuple[bytes, dict[str, str]]]) -> str:
    """The bucket under ``prefix`` made to hold exactly ``objects``; its URL. Only what differs is
    written: an object whose ETag (its MD5) is the body's already is kept, every object not in
    ``objects`` deleted, so that attacks sharing a prefix (one per layout: a key keeps its user
    metadata) cost the objects they change."""
    listed: dict[str, str] = {}
    token: dict[str, str] = {}
    while True:
        page = server.client.list_objects_v2(Bucket=server.bucket, Prefix=prefix + "/", **token)
        listed |= {o["Key"]: o["ETag"].strip('"') for o in page.get("Contents", [])}
        if not page.get("IsTruncated"):
            break
        token = {"ContinuationToken": page["NextContinuationToken"]}
    wanted = {f"{prefix}/{key}": value for key, value in objects.items()}
    for key in listed.keys() - wanted.keys():
        server.client.delete_object(Bucket=server.bucket, Key=key)
    for key, (body, meta) in wanted.items():
        if listed.get(key) != hashlib.md5(body).hexdigest():
            server.client.put_object(Bucket=server.bucket, Key=key, Body=body, Metadata=meta)
    return f"s3://{server.bucket}/{prefix}"


def samples(ds: ShardDataset) -> list[tuple[torch.Tensor, int]]:
    return [(x, int(y)) for x, y in (ds[i] for i in range(len(ds)))]


def read_local(local: Path) -> list[tuple[torch.Tensor, int]]:
    return samples(ShardDataset(local, crop_size=None, dtype=torch.uint8))


def same(got: list[tuple[torch.Tensor, int]], want: list[tuple[torch.Tensor, int]]) -> bool:
    return len(got) == len(want) and all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(got, want))


def in_time(work: Callable[[], Any], seconds: float = ATTEMPT_S) -> Any:
    """``work()``'s result or exception, in a thread that must end within ``seconds`` (a hang fails)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", work()))
        except BaseException as e:
            out.append(("error", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds:.0f} s"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def outcome(url: str, cache: Path, want: list[tuple[torch.Tensor, int]], **options: Any) -> str:
    """One attempt: "ok" when every sample read from ``url`` equals ``want``, else the one line of
    the packer error it failed with (anything else, a traceback of internals or a wrong byte, fails
    the test)."""

    def read() -> list[tuple[torch.Tensor, int]]:
        return samples(ShardDataset(url, crop_size=None, dtype=torch.uint8, cache_dir=cache, **options))

    try:
        got = in_time(read)
    except PackerError as e:
        message = str(e)
        assert message and "\n" not in message and "Traceback" not in message, message
        return message
    assert same(got, want), "served bytes that are not the dataset's"
    return "ok"


def du(cache: Path) -> int:
    """What ``du -s --block-size=1`` counts under ``cache``: allocated blocks, each inode once."""
    seen: set[int] = set()
    total = 0
    for folder, dirs, names in os.walk(cache):
        for name in [*dirs, *names, "."]:
            st = os.lstat(os.path.join(folder, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total
