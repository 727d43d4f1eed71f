"""Red-team of the remote path, part 1: a hostile bucket. A dataset's manifest, index, label arrays,
files.json and data objects edited as an adversary would (huge sizes, ``../`` names and keys, wrong
CRC-32s, digests forged to match, objects missing, cut or swapped), each attack one attempt against
the real S3 server (SeaweedFS on 127.0.0.1): the read returns the dataset's own bytes or fails in one
line of a packer error naming the object; never hangs; never takes the cache past its limit as
``du`` counts it; and once the bucket is repaired, the same cache reads the dataset right."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from packer.format import INDEX, MANIFEST, SOURCES, manifest_digest
from packer.store import base
from packer.store.published import FILES, version_key

from .redteam import Copy, du, outcome, read_local, upload
from .seaweed import S3Server

LIMIT = 6 << 20  # the cache limit of every attempt: a few times the dataset


@dataclass(frozen=True)
class Attack:
    name: str
    edit: Callable[[Copy], None]
    #: "ok" (the dataset's bytes), or the one-line error, a regex matched from its start, which names
    #: the object: {u} the dataset's URL, {m} its manifest, {ix}/{sx} its index/sources, {f}/{l} the
    #: first/last data file's object, {fj} the version's files.json, {v0} its folder, {v} its version
    expect: str
    published: bool = False
    backends: tuple[str, ...] = ("memmap", "lmdb")


def _shard(c: Copy, k: int = 0) -> dict:
    return c.manifest["shards"][k]


def _first(c: Copy) -> str:
    return str(_shard(c)["file"])


def _sealed(edit: Callable[[Copy], None]) -> Callable[[Copy], None]:
    """``edit``, then the manifest's digests forged to match (a forger's attack goes past them)."""

    def run(c: Copy) -> None:
        edit(c)
        c.reseal()

    return run


def _rows(change: Callable[[np.ndarray], None]) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        rows = c.index().copy()
        change(rows)
        c.set_index(rows)

    return edit


def _row(name: str, i: int, value: Callable[[int], int]) -> Callable[[Copy], None]:
    """Index row ``i``'s field ``name`` set to ``value(old)``, the digests forged to match."""

    def change(rows: np.ndarray) -> None:
        rows[name][i] = value(int(rows[name][i]))

    return _sealed(_rows(change))


def _set(path: str, value: object) -> Callable[[Copy], None]:
    """Manifest field ``path`` ("a.0.b") set to ``value``."""

    def edit(c: Copy) -> None:
        *parents, last = path.split(".")
        node: object = c.manifest
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value  # type: ignore[index]

    return edit


def _data(change: Callable[[bytes], bytes], k: int = 0) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        name = str(_shard(c, k)["file"])
        c.data[name] = change(c.data[name])

    return edit


def _flip(at: float) -> Callable[[bytes], bytes]:
    def change(b: bytes) -> bytes:
        i = min(len(b) - 1, int(len(b) * at))
        return b[:i] + bytes([b[i] ^ 0x5A]) + b[i + 1 :]

    return change


def _npy(header: str, body: bytes = b"") -> bytes:
    """A .npy file with this header dict text (an adversary's: any shape, any dtype)."""
    text = header.encode() + b" " * (118 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + body


def _pickled_index(c: Copy) -> None:
    rows = np.empty(3, object)
    rows[:] = [{"os.system": "echo owned"}] * 3
    out = io.BytesIO()
    np.save(out, rows, allow_pickle=True)
    c.arrays[INDEX] = out.getvalue()


def _swap_files(c: Copy) -> None:
    a, b = _shard(c, 0), _shard(c, 1)
    c.data[a["file"]], c.data[b["file"]] = c.data[b["file"]], c.data[a["file"]]


def _same_size_noise(c: Copy) -> None:
    name = _first(c)
    c.data[name] = bytes(np.random.default_rng(3).integers(0, 256, len(c.data[name]), dtype=np.uint8))


def _files_key(key: object) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        assert c.files is not None
        c.files[_first(c)]["key"] = key

    return edit


def _files_field(name: str, value: object) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        assert c.files is not None
        c.files[_first(c)][name] = value

    return edit


def _files_text(text: bytes) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        c.files_text = text

    return edit


def _files_doc(change: Callable[[dict], None]) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        assert c.files is not None
        doc = json.loads(json.dumps({"format": 1, "parent": "", "files": c.files}))
        change(doc)
        c.files_text = json.dumps(doc).encode()

    return edit


def _other_data_key(c: Copy) -> None:
    assert c.files is not None
    c.files[_first(c)]["key"] = c.files[str(_shard(c, 1)["file"])]["key"]


def _drop_version_object(name: str) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        c.extra[version_key(c.version, name)] = None

    return edit


def _index_digest_wrong(c: Copy) -> None:
    c.reseal()
    c.manifest["index_digest"] = "sha256:" + "0" * 64
    c.manifest["manifest_digest"] = manifest_digest(c.manifest)


def _index_bytes(body: bytes) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        c.arrays[INDEX] = body

    return edit


def _text(body: bytes) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        c.text = body

    return edit


def _delete(name: str) -> Callable[[Copy], None]:
    def edit(c: Copy) -> None:
        c.arrays.pop(name, None)
        c.data.pop(name, None)

    return edit


def _delete_first(c: Copy) -> None:
    del c.data[_first(c)]


def _phantom_shard(c: Copy) -> None:
    shards = c.manifest["shards"]
    k = len(shards)
    name = f"shard-{k:05}.bin" if c.manifest["backend"] == "memmap" else f"data-{k:05}.mdb"
    shards.append({**shards[-1], "file": name, "count": 1, "bytes": 4096})


MANIFEST_ERRORS = r"manifest"  # a manifest field refused, or a digest that does not match
ATTACKS = [
    # --- the manifest: tampered fields, digests kept (caught by manifest_digest) or forged to match
    Attack("manifest-not-json", _text(b"{not json"), r"{m}: unreadable manifest \(Expecting"),
    Attack("manifest-empty", _text(b""), r"{m}: unreadable manifest \(Expecting value"),
    Attack("manifest-a-list", _text(b"[1, 2, 3]"), r"{m}: manifest is not a JSON object$"),
    Attack(
        "manifest-deep-nesting",
        _text(b"[" * 100_000 + b"]" * 100_000),
        r"{m}: unreadable manifest \(maximum recursion depth",
    ),
    Attack(
        "manifest-over-the-size-limit", _text(b" " * (65 << 20)), r"{m}: manifest is over 64 MiB", backends=("memmap",)
    ),
    Attack("manifest-bad-utf8", _text(b'{"a": "\xff\xfe"}'), r"{m}: unreadable manifest \('utf-8' codec"),
    Attack("manifest-format-version-99", _set("format_version", 99), r"{m}: format_version 99 is not supported"),
    Attack(
        "manifest-digest-unforged",
        _set("count", 17),
        r"{u}: manifest.json: its content does not match its manifest_digest",
    ),
    Attack(
        "manifest-shard-bytes-huge",
        _sealed(_set("shards.0.bytes", 2**62)),
        r"({f}: \d+ bytes, the manifest says 4611686018427387904"
        r"|cache_limit \d+ bytes is too small for {u}: .*{f} takes)",
    ),
    Attack(
        "manifest-shard-bytes-2-63", _sealed(_set("shards.0.bytes", 2**63)), r"{m}: manifest field shards is invalid$"
    ),
    Attack(
        "manifest-shard-bytes-negative", _sealed(_set("shards.0.bytes", -1)), r"{m}: manifest field shards is invalid$"
    ),
    Attack(
        "manifest-shard-bytes-float", _sealed(_set("shards.0.bytes", 1e3)), r"{m}: manifest field shards is invalid$"
    ),
    Attack(
        "manifest-shard-bytes-one-less",
        _sealed(lambda c: _set("shards.0.bytes", _shard(c)["bytes"] - 1)(c)),
        r"({v}\): record \d+ points outside its shard|{f}: \d+ bytes, the manifest says \d+)",
    ),
    Attack(
        "manifest-shard-bytes-one-more",
        _sealed(lambda c: _set("shards.0.bytes", _shard(c)["bytes"] + 1)(c)),
        r"{f}: \d+ bytes, the manifest says \d+ \(the dataset was replaced",
    ),
    Attack(
        "manifest-shard-file-dotdot",
        _sealed(_set("shards.0.file", "../../../../tmp/owned.bin")),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack(
        "manifest-shard-file-absolute",
        _sealed(_set("shards.0.file", "/etc/passwd")),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack(
        "manifest-shard-file-subfolder",
        _sealed(_set("shards.0.file", "a/shard-00000.bin")),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack(
        "manifest-shard-file-hidden",
        _sealed(_set("shards.0.file", ".shard")),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack(
        "manifest-shard-file-index", _sealed(_set("shards.0.file", INDEX)), r"{m}: manifest field shards is invalid$"
    ),
    Attack(
        "manifest-shard-file-manifest",
        _sealed(_set("shards.0.file", MANIFEST)),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack(
        "manifest-shard-file-nul",
        _sealed(_set("shards.0.file", "shard-00000.bin\0x")),
        r"{m}: manifest field shards is invalid$",
    ),
    Attack("manifest-shard-file-number", _sealed(_set("shards.0.file", 7)), r"{m}: manifest field shards is invalid$"),
    Attack(
        "manifest-shards-empty",
        _sealed(_set("shards", [])),
        r"({v}\): index names data files beyond the 0 listed|{m}: manifest field shards is invalid)$",
    ),
    Attack(
        "manifest-shards-not-a-list",
        _sealed(_set("shards", {"a": 1})),
        r"{m}: manifest field digest/shards is invalid$",
    ),
    Attack("manifest-phantom-shard", _sealed(_phantom_shard), r"ok"),
    Attack(
        "manifest-count-huge",
        _sealed(_set("count", 2**62)),
        r"{v}\): index has 18 rows, manifest says 4611686018427387904$",
    ),
    Attack("manifest-count-negative", _sealed(_set("count", -1)), r"{m}: manifest field count is invalid$"),
    Attack(
        "manifest-count-one-more",
        _sealed(lambda c: _set("count", c.manifest["count"] + 1)(c)),
        r"{v}\): index has 18 rows, manifest says 19$",
    ),
    Attack("manifest-backend-unknown", _sealed(_set("backend", "pickle")), r"{m}: manifest field backend is invalid$"),
    Attack("manifest-format-unknown", _sealed(_set("format", "exe")), r"{m}: manifest field format is invalid$"),
    Attack(
        "manifest-classes-mismatch", _sealed(_set("classes", ["a"])), r"{m}: manifest field class_counts is invalid$"
    ),
    Attack(
        "manifest-index-digest-wrong",
        _index_digest_wrong,
        r"{u}: index.npy does not match the manifest's index_digest after 3 downloads$",
    ),
    Attack(
        "manifest-labels-digest-wrong",
        _sealed(_set("labels_digest", "sha256:" + "1" * 64)),
        r"{u}: .*do not match the manifest's labels_digest after 3 downloads$",
    ),
    # --- the index: rows tampered, the manifest's digests forged to match (past every digest)
    Attack(
        "index-crc-first-record",
        _row("crc32", 0, lambda v: v ^ 1),
        r"{f}: record 0: CRC-32 differs from the index's \(damaged bytes\) after 3 (downloads|reads)$",
    ),
    Attack(
        "index-crc-last-record",
        _row("crc32", -1, lambda v: v ^ 1),
        r"{l}: record 17: CRC-32 differs from the index's \(damaged bytes\) after 3 (downloads|reads)$",
    ),
    Attack(
        "index-crc-every-record",
        _sealed(_rows(lambda r: r.__setitem__("crc32", r["crc32"] ^ 7))),
        r"{f}: record 0: CRC-32 differs from the index's \(damaged bytes\) after 3 (downloads|reads)$",
    ),
    Attack(
        "index-length-one-more",
        _row("length", 0, lambda v: v + 1),
        r"({f}: record 0 is \d+ bytes, the index says \d+|{f}: record 0: CRC-32 differs).* after 3 (downloads|reads)$",
    ),
    Attack(
        "index-length-huge",
        _row("length", 0, lambda v: 2**62),
        r"({v}\): record 0 points outside its shard"
        r"|{f}: record 0 is \d+ bytes, the index says 4611686018427387904 after 3 downloads)$",
    ),
    Attack(
        "index-length-max",
        _row("length", 0, lambda v: 2**64 - 1),
        r"({v}\): record 0 points outside its shard"
        r"|{f}: record 0 is \d+ bytes, the index says 18446744073709551615 after 3 downloads)$",
    ),
    Attack(
        "index-offset-beyond",
        _row("offset", 0, lambda v: 2**40),
        r"{v}\): record 0(?: points outside its shard|: key beyond what its segment can hold)$",
    ),
    Attack(
        "index-offset-max",
        _row("offset", 0, lambda v: 2**64 - 2),
        r"{v}\): record 0(?: points outside its shard|: key beyond what its segment can hold)$",
    ),
    Attack(
        "index-shard-beyond", _row("shard", 0, lambda v: 999), r"{v}\): index names data files beyond the \d listed$"
    ),
    Attack(
        "index-rows-fewer",
        _sealed(lambda c: c.set_index(c.index()[:-1])),
        r"{v}\): index has 17 rows, manifest says 18$",
    ),
    Attack(
        "index-rows-empty", _sealed(lambda c: c.set_index(c.index()[:0])), r"{v}\): index has 0 rows, manifest says 18$"
    ),
    Attack(
        "index-rows-doubled",
        _sealed(lambda c: c.set_index(np.concatenate([c.index(), c.index()]))),
        r"{v}\): index has 36 rows, manifest says 18$",
    ),
    Attack(
        "index-pickled-objects",
        _pickled_index,
        r"{ix}: unreadable \(ValueError: dtype object .* is not a plain array\)$",
    ),
    Attack(
        "index-header-huge-shape",
        _index_bytes(_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776,), }")),
        r"{ix}: unreadable \(ValueError: 1099511627776 items of 1 bytes do not fit",
    ),
    Attack(
        "index-header-wrong-dtype",
        _index_bytes(_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", bytes(16))),
        r"{u}: index.npy does not match the manifest's index_digest after 3 downloads$",
    ),
    Attack(
        "index-header-garbage",
        _index_bytes(b"\x93NUMPY\x01\x00\xff\xffgarbage"),
        r"{ix}: unreadable \(ValueError: EOF: reading array header",
    ),
    Attack(
        "index-not-npy",
        _index_bytes(b"PK\x03\x04 not an npy"),
        r"{ix}: unreadable \(ValueError: the magic string is not correct",
    ),
    Attack(
        "index-truncated",
        lambda c: c.arrays.__setitem__(INDEX, c.arrays[INDEX][:-7]),
        r"{ix}: unreadable \(ValueError: 18 items of 72 bytes do not fit",
    ),
    Attack("index-missing", _delete(INDEX), r"{ix}: missing \(the manifest names it\)$"),
    Attack("sources-missing", _delete(SOURCES), r"{sx}: missing \(the manifest names it\)$"),
    Attack(
        "sources-one-byte-flipped",
        lambda c: c.arrays.__setitem__(SOURCES, _flip(0.9)(c.arrays[SOURCES])),
        r"{u}: sources.npy does not match the manifest's sources_digest after 3 downloads$",
    ),
    # --- the data objects: cut, grown, flipped, swapped, missing (the manifest and index untouched)
    Attack("data-missing", _delete_first, r"{f}: missing \(the manifest names it\)$"),
    Attack(
        "data-empty",
        _data(lambda b: b""),
        r"{f}: (shorter than the bytes asked \(bytes=0-\d+, HTTP 416\)|0 bytes, the manifest says \d+)",
    ),
    Attack(
        "data-one-byte-short",
        _data(lambda b: b[:-1]),
        r"{f}: \d+ bytes, the manifest says \d+ \(the dataset was replaced",
    ),
    Attack(
        "data-one-byte-more",
        _data(lambda b: b + b"\0"),
        r"{f}: \d+ bytes, the manifest says \d+ \(the dataset was replaced",
    ),
    Attack("data-doubled", _data(lambda b: b + b), r"{f}: \d+ bytes, the manifest says \d+ \(the dataset was replaced"),
    Attack(
        "data-flipped-in-the-middle",
        _data(_flip(0.5)),
        r"{f}: record \d+: CRC-32 differs from the index's \(damaged bytes\) after 3 downloads$",
    ),
    Attack(
        "data-flipped-near-the-end",
        _data(_flip(0.97)),
        r"{f}: record \d+: CRC-32 differs from the index's \(damaged bytes\) after 3 downloads$",
    ),
    Attack(
        "data-flipped-last-file",
        lambda c: _data(_flip(0.5), len(c.manifest["shards"]) - 1)(c),
        r"{l}: record \d+: CRC-32 differs from the index's \(damaged bytes\) after 3 downloads$",
    ),
    Attack(
        "data-same-size-noise",
        _same_size_noise,
        r"{f}: (record 0: CRC-32 differs from the index's \(damaged bytes\)"
        r"|damaged LMDB structure .*) after 3 downloads$",
    ),
    Attack(
        "data-files-swapped",
        _swap_files,
        r"{f}: \d+ bytes, the manifest says \d+ \(the dataset was replaced",
        backends=("memmap",),
    ),
]
PUBLISHED = [
    # --- files.json of a published version: keys outside the dataset, sizes, hashes, formats
    Attack(
        "files-key-dotdot",
        _files_key("../other/shard-00000.bin"),
        r"{fj}: not a files.json packer wrote \(\S+: key '../other/shard-00000.bin' is not inside the dataset\)$",
    ),
    Attack(
        "files-key-dotdot-inside",
        _files_key("versions/../../x"),
        r"{fj}: not a files.json packer wrote \(\S+: key 'versions/../../x' is not inside the dataset\)$",
    ),
    Attack(
        "files-key-absolute",
        _files_key("/etc/passwd"),
        r"{fj}: not a files.json packer wrote \(\S+: key '/etc/passwd' is not inside the dataset\)$",
    ),
    Attack(
        "files-key-empty",
        _files_key(""),
        r"{fj}: not a files.json packer wrote \(\S+: key '' is not inside the dataset\)$",
    ),
    Attack(
        "files-key-number",
        _files_key(7),
        r"{fj}: not a files.json packer wrote \(\S+: key 7 is not inside the dataset\)$",
    ),
    Attack("files-key-query", _files_key("shard?x=1"), r"{u}/shard\?x=1: missing \(the manifest names it\)$"),
    Attack(
        "files-key-missing-object",
        _files_key("versions/nowhere/shard-00000.bin"),
        r"{u}/versions/nowhere/shard-00000.bin: missing \(the manifest names it\)$",
    ),
    Attack(
        "files-key-other-data-file",
        _other_data_key,
        r"({v0}/shard-00001.bin: \d+ bytes, the manifest says \d+|{f}: record 0: CRC-32 differs.*)",
        backends=("memmap",),
    ),
    Attack(
        "files-key-index",
        lambda c: _files_key(version_key(c.version, INDEX))(c),
        r"{v0}/index.npy: 1680 bytes, the manifest says \d+ \(the dataset was replaced",
    ),
    Attack(
        "files-key-pointer", _files_key(MANIFEST), r"{m}: \d+ bytes, the manifest says \d+ \(the dataset was replaced"
    ),
    Attack("files-size-huge", _files_field("size", 2**70), r"ok"),
    Attack("files-size-negative", _files_field("size", -1), r"{fj}: not a files.json packer wrote \(\S+: size -1\)$"),
    Attack("files-size-bool", _files_field("size", True), r"{fj}: not a files.json packer wrote \(\S+: size True\)$"),
    Attack(
        "files-sha256-bad", _files_field("sha256", r"zz"), r"{fj}: not a files.json packer wrote \(\S+: sha256 'zz'\)$"
    ),
    Attack("files-sha256-wrong", _files_field("sha256", "0" * 64), r"ok"),
    Attack("files-not-json", _files_text(b"{oops"), r"{fj}: not a files.json packer wrote \(Expecting"),
    Attack(
        "files-a-list",
        _files_text(b"[]"),
        r"{fj}: not a files.json packer wrote \('list' object has no attribute 'get'\)$",
    ),
    Attack(
        "files-format-2",
        _files_doc(lambda d: d.__setitem__("format", 2)),
        r"{fj}: not a files.json packer wrote \(format 2, this packer reads 1\)$",
    ),
    Attack(
        "files-parent-dotdot",
        _files_doc(lambda d: d.__setitem__("parent", "../..")),
        r"{fj}: not a files.json packer wrote \(parent '../..'\)$",
    ),
    Attack(
        "files-files-a-list",
        _files_doc(lambda d: d.__setitem__("files", [])),
        r"{fj}: not a files.json packer wrote \('list' object has no attribute 'items'\)$",
    ),
    Attack(
        "files-entry-without-key",
        _files_doc(lambda d: d["files"][next(iter(d["files"]))].pop("key")),
        r"{fj}: not a files.json packer wrote \('key'\)$",
    ),
    Attack(
        "files-missing",
        _drop_version_object(FILES),
        r"{u}: versions/[0-9a-f]{{32}}/files.json is missing \(the pointer says it was published\) after 3 downloads$",
    ),
    Attack(
        "files-version-index-missing",
        _drop_version_object(INDEX),
        r"{v0}/index.npy: missing \(the manifest names it\)$",
    ),
]
CASES = [pytest.param(a, b, id=f"{b}-{a.name}") for a in ATTACKS for b in a.backends] + [
    pytest.param(Attack(a.name, a.edit, a.expect, True), b, id=f"{b}-{a.name}") for a in PUBLISHED for b in a.backends
]


@pytest.fixture(scope="module")
def want(built) -> dict[str, list]:
    return {b: read_local(built(b, "jpeg")) for b in ("memmap", "lmdb")}


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "BACKOFF_S", 0.001)


def _expected(attack: Attack, url: str, pristine: Copy) -> str:
    """The attack's regex, its placeholders filled in for this copy's objects."""
    shards = [str(s["file"]) for s in pristine.manifest["shards"]]
    v0 = f"{url}/{version_key(pristine.version, '')}".rstrip("/")
    keys = {n: e["key"] for n, e in (pristine.files or {}).items()}

    def where(name: str) -> str:
        return f"{url}/{keys.get(name, name)}"

    fill = {
        "u": re.escape(url),
        "m": re.escape(f"{url}/{MANIFEST}"),
        "ix": rf"{re.escape(url)}/(versions/[0-9a-f]{{32}}/)?{re.escape(INDEX)}",
        "sx": rf"{re.escape(url)}/(versions/[0-9a-f]{{32}}/)?{re.escape(SOURCES)}",
        "f": re.escape(where(shards[0])),
        "l": re.escape(where(shards[-1])),
        "fj": rf"{re.escape(url)}/versions/[0-9a-f]{{32}}/{re.escape(FILES)}",
        "v0": re.escape(v0),
        "v": rf"{re.escape(url)} \(version [0-9a-f]{{32}}",
    }
    return attack.expect.format(**fill)


@pytest.mark.parametrize("attack,backend", CASES)
def test_hostile_bucket(
    attack: Attack, backend: str, built, want: dict[str, list], s3_server: S3Server, tmp_path: Path
) -> None:
    local = built(backend, "jpeg")
    pristine = Copy.of(local, published=attack.published)
    hostile = Copy.of(local, published=attack.published)
    attack.edit(hostile)
    prefix = f"redteam/{backend}-{'published' if attack.published else 'synced'}"  # one bucket state after another
    url = upload(s3_server, prefix, hostile.objects())
    cache = tmp_path / "cache"
    got = outcome(url, cache, want[backend], cache_limit=LIMIT)
    assert du(cache) <= LIMIT
    if attack.expect == "ok":
        assert got == "ok"
    else:
        assert re.match(_expected(attack, url, pristine), got), got
    # the bucket repaired: the same cache reads the dataset right
    upload(s3_server, prefix, pristine.objects())
    repaired = outcome(url, cache, want[backend], cache_limit=LIMIT)
    assert repaired == "ok"  # a files.json that named a wrong key is read again (versions.suspect_files)
    assert du(cache) <= LIMIT
