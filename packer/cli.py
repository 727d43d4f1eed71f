"""The ``packer`` command line: thin wrappers over the Python API, one-line errors for expected failures."""

from __future__ import annotations

import codecs
import functools
import io
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from ._version import DISTRIBUTION, __version__
from .builder.options import BuildOptions, cli_fields, flag, labelling_fields
from .errors import PackerError, is_url
from .format import json_text
from .format.records import FORMATS


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, systemd, a batch scheduler) unwinds a build like Ctrl-C: workers stopped, journal kept."""

    signum = signal.SIGTERM


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


BUILD_INTERRUPTED = "nothing was written at the output (run the same build with --resume to continue)"
#: a build to a URL: interrupted before its pointer PUT, the store still serves the version it had
PUBLISH_INTERRUPTED = (
    "the dataset in the store is at its previous version (run the same build again to finish; "
    "--resume continues a build cut short before its upload)"
)
#: Ctrl-C in a command that only reads the dataset (info, verify, preview, show, bench)
READ_INTERRUPTED = "the dataset was not changed"
#: the parameters naming a file such a command writes (-o, --plot): interrupted, it may be cut short
_WRITTEN = ("dest", "plot_file")


def _read_interrupted() -> str:
    """What is true after Ctrl-C of a reading command: the dataset untouched, its own output file perhaps not."""
    params = click.get_current_context().params
    written = [str(params[name]) for name in _WRITTEN if params.get(name) is not None]
    return READ_INTERRUPTED + "".join(f"; {path} may be missing or incomplete" for path in written)


def _build_interrupted() -> str:
    """What is true after Ctrl-C of a build: OUT untouched, or in a store, at its previous version."""
    out = click.get_current_context().params.get("out")
    return PUBLISH_INTERRUPTED if out is not None and is_url(out) else BUILD_INTERRUPTED


def _end_reader(code: int) -> None:
    """End an interrupted reading command now, its children first, without the interpreter's unwinding.

    Ctrl-C can land between a lock's ``__enter__`` and the ``with`` block in CPython 3.11 (inside a
    torch DataLoader starting up: its index queue's lock), leaving the lock held; the loader's
    ``__del__`` then blocks forever on it as the frames are freed, and the command hangs after saying
    it was interrupted. A reader has nothing left to undo (its ``with`` blocks have exited on the
    way here; the node cache is safe to kill at any point), so it stops its worker processes, as
    multiprocessing would at exit, and leaves."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _friendly(
    fn: Callable[..., Any], *, interrupted: str | Callable[[], str] = _read_interrupted
) -> Callable[..., Any]:
    """Expected failures print one line and exit 1 (2 for usage); --debug shows the traceback.
    Ctrl-C and SIGTERM (where the command turns it into :class:`Terminated`) print "interrupted;"
    and ``interrupted``, what is true of the command's output then (by default: a command that only
    reads the dataset, :func:`_read_interrupted`).

    A reader that stops early (``packer info OUT | head``) ends the command quietly with status 141
    (128 + SIGPIPE), as it ends ``cat`` or ``ls``: no "Broken pipe" message, no traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = click.get_current_context().find_root().params.get("debug", False)
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # here, not at exit, where a closed pipe could no longer be handled
            return result
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's final flush must not fail again
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except KeyboardInterrupt as e:
            if debug:
                raise
            # a packer.Writer's (--coco) says what it left and whether --resume continues it
            why = str(e) or (interrupted if isinstance(interrupted, str) else interrupted())
            click.echo(f"packer: interrupted; {why}", err=True)
            code = 128 + getattr(e, "signum", signal.SIGINT)
            if interrupted is _read_interrupted:
                _end_reader(code)
            sys.exit(code)
        except PackerError as e:
            if debug:
                raise
            click.echo(f"packer: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            if debug:
                raise
            where = f" ({e.filename})" if e.filename else ""
            click.echo(f"packer: error: {e.strerror or e}{where}", err=True)
            sys.exit(1)

    return wrapper


class _PathOrURL(click.Path):
    """A path argument that hands a URL on as typed: ``Path("s3://b/x")`` would collapse it into the
    local folder ``s3:/b/x``; the API refuses it whole, in one line (packer.errors.local_path)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if isinstance(value, str) and is_url(value) else super().convert(value, param, ctx)


def _undecodable_as_escapes(error: UnicodeError) -> tuple[str, int]:
    """A codec error handler for the CLI's strict output streams: a file or class name's undecodable
    bytes (lone surrogates from os.fsdecode) as ``\\xNN``, as ``ls -b`` shows them; anything else the
    output's encoding lacks as a backslash escape. Printing such a name must not end the command."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    bad = error.object[error.start : error.end]
    return "".join(
        f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else c.encode("ascii", "backslashreplace").decode()
        for c in bad
    ), error.end


codecs.register_error("packer-escape", _undecodable_as_escapes)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for expected errors.")
@click.version_option(__version__, prog_name="packer", message=f"%(prog)s %(version)s ({DISTRIBUTION})")
def main(debug: bool) -> None:
    """Preprocess an image folder once; pack it into LMDB or memmap shards for fast training."""
    for stream in (sys.stdout, sys.stderr):
        # a strict stream (PYTHONIOENCODING=utf-8) only: where the locale gave surrogateescape, a name
        # is printed as its very bytes, a path the shell can use, as ls prints it
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="packer-escape")


_STAGING_HELP = (
    "With a URL OUT: where the dataset is staged before it is uploaded, and kept for the next "
    "--update (default: publish/ in the cache directory, $PACKER_CACHE_DIR or ~/.cache/packer)."
)

#: OUT of the commands that read a dataset (info, verify, preview, show, bench): a local path, or a URL
#: (``s3://...``, ``https://...``) read through the node cache (packer.read.remote).
DATASET = _PathOrURL(path_type=Path)


def _click_type(kind: Any) -> Any:
    """A BuildOptions field's ``type`` metadata as click's: a tuple is a choice, "file" an existing file."""
    if isinstance(kind, tuple):
        return click.Choice(kind)
    if kind == "file":
        return click.Path(exists=True, dir_okay=False)
    return kind


def _converted(convert: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback from a BuildOptions field's ``convert`` (its ValueError: a usage error)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return convert(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return callback


def build_option_decorators() -> list[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """``packer build``'s click options, one per BuildOptions field that has a ``help``, then one per
    Labelling field: flag, type, default and --help text all come from the field, so an option is
    written once (in BuildOptions, or Labelling)."""
    decorators: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = []
    for f in [*cli_fields(), *labelling_fields()]:
        meta = f.metadata
        # a field with ``convert`` gets its default from it: click passes None (or () if multiple)
        default = None if "convert" in meta else f.default
        kwargs: dict[str, Any] = {"help": meta["help"], "default": default}
        if meta["type"] is bool:
            kwargs["is_flag"] = True
        else:
            kwargs |= {"type": _click_type(meta["type"]), "show_default": default is not None}
        if "convert" in meta:
            kwargs["callback"] = _converted(meta["convert"])
        kwargs |= {k: meta[k] for k in ("metavar", "multiple") if k in meta}
        decorators.append(click.option(flag(f.name), f.name, **kwargs))
    return decorators


def _with_build_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for decorate in reversed(build_option_decorators()):
        fn = decorate(fn)
    return fn


@main.command()
@click.argument("raw_dir", type=_PathOrURL(path_type=Path))
@click.argument("out", type=_PathOrURL(path_type=Path))
@_with_build_options
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.option(
    "--dask",
    "dask_address",
    metavar="ADDRESS",
    default=None,
    help="Preprocess on Dask distributed: 'local' (a LocalCluster of --workers processes) or a "
    "scheduler address like tcp://host:8786. See docs/DISTRIBUTED.md.",
)
@click.option("--staging", "staging", metavar="DIR", default=None, help=_STAGING_HELP)
@functools.partial(_friendly, interrupted=_build_interrupted)
def build(raw_dir: Path, out: Path, dask_address: str | None, staging: str | None, quiet: bool, **fields: Any) -> None:
    """Pack RAW_DIR into OUT. Labels: each sub-folder of RAW_DIR is a class, numbered in sorted order
    of the folder names (torchvision ImageFolder's order), unless --labels, --classes or --unlabeled.

    One build per OUT at a time: a second one fails at once with "OUT is being built by pid N" (or
    waits, with --wait). OUT may be a symlink: the dataset it points to is built or replaced (staged
    beside it, on its disk) and the link kept. Exit status: 0 when OUT is complete (skipped files do
    not change that: see OUT/report.jsonl, or use --on-error fail; unless every file was skipped:
    see --allow-empty), 1 on an error, 130/143 when interrupted (Ctrl-C/SIGTERM; OUT untouched,
    continue with --resume).

    OUT may be an s3:// URL: the dataset is staged on this machine (see --staging), then published,
    the store's current version replaced last, in one step; interrupted or failed, the store keeps its
    previous version and the same command finishes the job (docs/OBJECT-STORAGE.md, "Publishing").
    """
    from .builder.labels import Labelling

    labelling = Labelling(**{f.name: fields.pop(f.name) for f in labelling_fields()})
    options = BuildOptions(labelling=labelling, **fields)
    if options.coco is not None and (is_url(out) or dask_address is not None):
        raise click.UsageError("--coco packs on this machine into a local OUT (not --dask, not a URL) for now")
    signal.signal(signal.SIGTERM, _raise_terminated)
    if is_url(out):
        from .builder.staging import CLI_OPTIONS
        from .tools.publish import publish_build

        report, published = publish_build(
            raw_dir, str(out), options, quiet=quiet, staging=staging, dask_address=dask_address, names=CLI_OPTIONS
        )
        if not report.up_to_date or all(done.up_to_date for done in published):
            click.echo(report.summary(), err=True)  # (up to date, published: the copy an interrupted publish left)
        for done in published:
            click.echo(done.summary(), err=True)
        return
    if staging is not None:
        raise click.UsageError("--staging is for an OUT in object storage (a URL); a local OUT is staged beside it")
    if dask_address is not None:
        from .builder.dask import build_dask

        report = build_dask(raw_dir, out, options, address=dask_address, quiet=quiet)
    else:
        from .builder.pipeline import build as build_here
        from .builder.staging import CLI_OPTIONS

        report = build_here(raw_dir, out, options, quiet=quiet, names=CLI_OPTIONS)
    click.echo(report.summary(), err=True)


def dataset_info(out: str | os.PathLike) -> dict[str, Any]:
    """The facts `packer info` shows, as a dict (its --json form). A URL's are read from its current
    version's manifest and index, cached, and held while they are read (no eviction takes them)."""
    from .read.remote import local_version

    if not is_url(out):
        return _facts(out, out)
    with local_version(str(out)) as cached:
        return _facts(out, cached)


def _facts(shown: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """:func:`dataset_info` of the dataset named ``shown``, read at ``out`` (``shown`` itself where it is
    local, else its cached version)."""
    from .format import MANIFEST, Manifest, disk_bytes, load_index, load_label_arrays
    from .store.published import version_id

    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    multi, targets = load_label_arrays(out, manifest)
    on_disk = disk_bytes(out) if shown is out else _stored_bytes(Path(out), manifest)
    record_bytes = int(index["length"].sum()) if len(index) else 0
    return {
        "path": str(shown),
        # the id the version has (would have) in object storage: its manifest's sha256, 32 hex digits
        "version": version_id((Path(out) / MANIFEST).read_bytes()),
        # a published dataset (URL): the versions kept in the store (packer gc); else None
        "versions": _kept_versions(str(shown)) if shown is not out else None,
        "count": manifest.count,
        "label_kind": manifest.label_kind,
        "classes": manifest.classes,
        "class_counts": dict(zip(manifest.classes, manifest.class_counts)),
        # multi-label: packed rows with no bit set (bits past the last class are checked to be 0)
        "records_without_labels": int((np.asarray(multi) == 0).all(axis=1).sum()) if multi is not None else None,
        "targets": {
            name: {"min": float(col.min()), "mean": float(col.mean(dtype=np.float64)), "max": float(col.max())}
            for name, col in zip(manifest.targets, np.asarray(targets).T)
        }
        if targets is not None and len(targets)
        else {},
        "format": manifest.format,
        "backend": manifest.backend,
        "short_edge": manifest.short_edge,
        "quality": manifest.quality,
        "bytes": on_disk,
        "record_bytes": record_bytes,
        "mean_bytes": record_bytes / manifest.count if manifest.count else 0.0,
        "digest": manifest.digest,
        "scanned": manifest.scanned,
        "skipped": manifest.skipped,
        "ignored": manifest.ignored,
        "codec": manifest.codec,
        "shards": len(manifest.shards),
        # format 3: writes whose data files the dataset still uses, and the bytes of records no row
        # points to any more (packer compact drops them)
        "segments": manifest.segments,
        "dead_bytes": manifest.dead_bytes,
        "packer_version": manifest.packer_version,
        "long_edge_histogram": _histogram(np.maximum(index["height"], index["width"])),
        "short_edge_histogram": _histogram(np.minimum(index["height"], index["width"])),
        # a dataset with fields (format 4): each field with its counts from the manifest
        **({"fields": _field_facts(manifest)} if manifest.fields else {}),
    }


def _field_facts(manifest: Any) -> list[dict[str, Any]]:
    """Each declared field (name, kind, dtype) with the counts its writer recorded: records with a
    value, items in all (boxes, bytes of text or arrays), for boxes a boxes-per-image histogram, and
    for box labels (a ``--coco`` dataset's categories) each id's name and boxes."""
    facts = []
    for f in manifest.declared:
        entry: dict[str, Any] = f.to_json()
        counts = manifest.field_counts.get(f.name, {})
        if f.kind == "label":
            entry["records"] = manifest.count
        elif counts:
            entry["records"], entry["items"] = counts["records"], counts["items"]
            if "per_record" in counts:  # drawn from its (boxes, records) pairs, never expanded
                per = counts["per_record"]
                boxes = np.array([int(k) for k in per], np.int64)
                entry["per_record_histogram"] = _histogram(boxes, weights=np.array(list(per.values()), np.int64))
        if f.kind == "box_labels":
            entry["categories"] = _categories(f.classes, counts.get("per_class"))
        facts.append(entry)
    return facts


def _categories(names: tuple[str, ...], per_class: dict[str, int] | None) -> list[dict[str, Any]]:
    """Box label ids with a name or boxes, in id order: ``{"id", "name", "boxes"}`` (boxes None where
    the manifest has no count of them: a dataset packed before packer counted them)."""
    boxes = {int(k): n for k, n in (per_class or {}).items()}
    ids = sorted({i for i, name in enumerate(names) if name} | set(boxes))
    return [
        {
            "id": i,
            "name": names[i] if 0 <= i < len(names) else "",
            "boxes": boxes.get(i, 0) if per_class is not None else None,
        }
        for i in ids
    ]


def _kept_versions(url: str) -> int | None:
    """How many published versions the store at ``url`` keeps; None for a copy synced as it is, or
    a store that cannot be listed (a web server)."""
    from .store import open_store
    from .store.published import published_versions

    store = open_store(url)
    return (len(published_versions(store)) or None) if store.writable else None


def _stored_bytes(root: Path, manifest: Any) -> int:
    """Bytes of a remote dataset: its cached metadata files and its data files as the manifest lists them."""
    from .backends import BACKENDS

    data = sum(int(s["bytes"]) for s in manifest.shards) if BACKENDS[manifest.backend].lists_files(manifest) else 0
    return data + sum(p.stat().st_size for p in root.iterdir() if p.is_file() and p.suffix in (".json", ".npy"))


def _histogram(values: np.ndarray, bins: int = 8, weights: np.ndarray | None = None) -> list[dict[str, int]]:
    """Counts over at most ``bins`` integer ranges [lo, hi] (one bin when all values are equal);
    ``weights``: how many times each value counts (a histogram given as its pairs)."""
    if len(values) == 0:
        return []
    lo, hi = int(values.min()), int(values.max())
    edges = np.unique(np.linspace(lo, hi + 1, min(bins, hi - lo + 1) + 1).astype(np.int64))
    counts, _ = np.histogram(values, bins=edges, weights=weights)
    return [{"lo": int(a), "hi": int(b) - 1, "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts)]


def _bar(n: int, total: int, width: int = 40) -> str:
    return "#" * max(1 if n else 0, round(width * n / total)) if total else ""


@main.command()
@click.argument("out", type=DATASET)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_friendly
def info(out: Path, as_json: bool) -> None:
    """Summarise the dataset at OUT."""
    facts = dataset_info(out)
    if as_json:
        click.echo(json_text(facts, indent=1))
        return
    width = max((len(c) for c in facts["classes"]), default=0)
    kind = {"class": "", "multi": " (multi-label)", "none": " (unlabeled)"}[facts["label_kind"]]
    categories = next((f["categories"] for f in facts.get("fields", []) if "categories" in f), None)
    labels = f"{len(facts['classes'])} classes{kind}"
    if categories and facts["label_kind"] == "none":  # a --coco dataset: its labels are its boxes'
        labels = f"{len(categories)} box categories (no image label)"
    click.echo(
        f"{facts['path']}: {facts['count']} images, {labels}, "
        f"{facts['format']} in {facts['backend']}, short edge {facts['short_edge']}"
        + (f", quality {facts['quality']}" if FORMATS[facts["format"]].lossy else "")
    )
    click.echo(f"  bytes on disk {facts['bytes']:,}; mean {facts['mean_bytes']:,.0f} bytes/image")
    click.echo(f"  scanned {facts['scanned']}, skipped {facts['skipped']}, ignored {facts['ignored']}")
    if facts["segments"] > 1 or facts["dead_bytes"]:
        click.echo(
            f"  {facts['segments']} segments, {facts['dead_bytes']:,} bytes of replaced or deleted records "
            f"(packer compact rewrites them away)"
        )
    click.echo(f"  digest {facts['digest']}")
    if facts["versions"] is not None:
        click.echo(
            f"  version {facts['version']}; {facts['versions']} versions kept in the store (packer gc drops old ones)"
        )
    total = facts["count"]
    if facts["label_kind"] != "none":
        multi = facts["label_kind"] == "multi"
        click.echo("  per label (an image counts once per label):" if multi else "  per class:")
        for name, n in facts["class_counts"].items():
            click.echo(f"    {name:<{width}}  {n:>8}  {_bar(n, total)}")
    if facts["records_without_labels"] is not None:
        click.echo(f"    images without any label: {facts['records_without_labels']}")
    for name, t in facts["targets"].items():
        click.echo(f"  target {name}: min {t['min']:.6g}, mean {t['mean']:.6g}, max {t['max']:.6g}")
    for f in facts.get("fields", []):
        counts = (
            f" in {f['records']} records" + (f", {f['items']} items" if "items" in f else "") if "records" in f else ""
        )
        click.echo(f"  field {f['name']}: {f['kind']} ({f['dtype']}){counts}")
        for b in f.get("per_record_histogram", []):
            span = f"{b['lo']}" if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}"
            click.echo(f"    {span:>7} boxes  {b['count']:>8}  {_bar(b['count'], total)}")
        if f.get("categories"):
            counted = f["categories"][0]["boxes"] is not None
            click.echo("    boxes per category:" if counted else "    categories (boxes not counted by its packer):")
            named = max(len(f"{c['id']} {c['name']}") for c in f["categories"])
            most = max((c["boxes"] or 0 for c in f["categories"]), default=0)
            for c in f["categories"]:
                line = f"      {c['id']} {c['name']}".ljust(6 + named)
                click.echo(f"{line}  {c['boxes']:>8}  {_bar(c['boxes'], most)}" if counted else line)
    for edge in ("short", "long"):
        click.echo(f"  stored {edge} edge (px):")
        for b in facts[f"{edge}_edge_histogram"]:
            span = f"{b['lo']}" if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}"
            click.echo(f"    {span:>11}  {b['count']:>8}  {_bar(b['count'], total)}")


@main.command()
@click.argument("out", type=DATASET)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Problems to list at most (all are counted).",
)
@click.option(
    "--all-versions",
    is_flag=True,
    help="A published dataset (URL): every version kept in the store, not only the current one.",
)
@_friendly
def verify(out: Path, limit: int, all_versions: bool) -> None:
    """Re-read every record of OUT: checksums, digest, index/manifest consistency (exit 1 if bad).

    A URL is checked in the store, streaming (nothing is kept in the node cache): each object against
    the manifest and the version's files.json (size, sha256), each record against the index; every
    missing or damaged object is named.
    """
    from .tools.verify import verify as run_verify

    versions = [""]  # the current one
    if all_versions:
        if not is_url(out):
            raise click.BadParameter("a local dataset has one version; --all-versions is for a URL")
        from .store import ObjectNotFound, open_store
        from .store.published import POINTER, published_versions, version_id

        store = open_store(str(out))
        try:
            current = version_id(store.get(POINTER))
        except ObjectNotFound:
            current = ""  # verify says there is no dataset there
        versions += [v for v in published_versions(store) if v != current]
    failed = False
    for version in versions:
        result = run_verify(out, limit=limit, version=version)
        where = result.root
        for note in result.notes:
            click.echo(f"packer: {where}: note: {note}", err=True)
        if result.ok:
            click.echo(f"packer: {where}: ok, {result.count} records, {result.digest}")
            continue
        for problem in result.problems:
            click.echo(f"packer: {where}: {problem}", err=True)
        click.echo(f"packer: {where}: FAILED verification ({result.bad_records} bad records)", err=True)
        failed = True
    if failed:
        sys.exit(1)


@main.command()
@click.argument("out", type=_PathOrURL(path_type=Path))
@click.option("--staging", "staging", metavar="DIR", default=None, help=_STAGING_HELP)
@functools.partial(
    _friendly, interrupted="the dataset is whole, compacted or as it was (run the same packer compact again)"
)
def compact(out: Path, staging: str | None) -> None:
    """Rewrite OUT into one segment, dropping the records that refreshes replaced or deleted.

    `build --update` keeps the old records where they are and adds the new ones in a segment of their
    own; it rewrites everything by itself once too much of the data is dead or there are too many
    segments (docs/FORMAT.md, "Segments"). Records are copied as they are (each checked against its
    CRC-32) and the digest stays the same. Readers of the old version keep reading it. Interrupted
    (Ctrl-C, SIGTERM, kill -9), OUT stays whole; `packer compact` or `packer clean` then takes what is left.
    OUT may be an s3:// URL: its data files are fetched through the read cache, compacted here, and
    published as a new version (the old one's objects stay for its readers).
    """
    signal.signal(signal.SIGTERM, _raise_terminated)
    if is_url(out):
        from .tools.publish import publish_compact

        click.echo(publish_compact(str(out), staging=staging)[2].summary(), err=True)
        return
    if staging is not None:
        raise click.UsageError("--staging is for an OUT in object storage (a URL)")
    from .tools.compact import compact as run_compact

    run_compact(out)


@main.command()
@click.argument("out", type=_PathOrURL(path_type=Path))
@functools.partial(
    _friendly, interrupted="some of what was being deleted may be gone (run the same packer clean again)"
)
def clean(out: Path) -> None:
    """Delete the dataset OUT and any interrupted build of it; refuse what is not packer's.

    Deletes OUT (a packer dataset, or a --split folder of them), .OUT.packer-tmp and .OUT.packer-old
    beside it, and nothing else. For a symlink OUT: the dataset it points to, then the link.
    Refuses while a build of OUT runs.

    A URL (a published dataset): what interrupted publishes left there, under its lease (a dead
    writer's expired lease is taken over): unfinished multipart uploads are aborted and version
    folders no pointer named are deleted. Its published versions stay (see packer gc).
    """
    from .tools.clean import clean as run_clean
    from .tools.clean import clean_url

    if is_url(out):
        gone = clean_url(str(out))
        for what in gone:
            click.echo(f"packer: deleted {what}", err=True)
        click.echo(f"packer: {out}: {len(gone) or 'nothing'} left by interrupted publishes deleted", err=True)
        return
    deleted = run_clean(out)
    click.echo(
        f"packer: deleted {', '.join(map(str, deleted))}" if deleted else f"packer: {out}: nothing to delete", err=True
    )


def _age(ctx: click.Context, param: click.Parameter, value: str) -> float:
    from .tools.gc import parse_age

    try:
        return parse_age(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command()
@click.argument("url", type=_PathOrURL(path_type=Path))
@click.option(
    "--keep-versions",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Versions kept by count, the current one included.",
)
@click.option(
    "--keep-age",
    "keep_age_s",
    metavar="AGE",
    callback=_age,
    default="3d",
    show_default=True,
    help="Also keep every version younger than this (3d, 12h, 30m, 90s): readers that opened it keep reading.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted, and its bytes; delete nothing.")
@click.option("--wait", is_flag=True, help="Wait for a build of URL that holds its lease, instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@functools.partial(_friendly, interrupted="some old objects may be gone, never a kept version's (run gc again)")
def gc(url: str, keep_versions: int, keep_age_s: float, dry_run: bool, wait: bool, as_json: bool) -> None:
    """Delete the objects of URL's old versions that no kept version uses (a published dataset).

    Kept: the current version, the --keep-versions newest, every version younger than --keep-age,
    and every file one of them uses (a refresh reuses its predecessors' data files). Also deletes the
    objects of publishes that failed, once older than --keep-age. Holds URL's lease, as a build does.
    See docs/OBJECT-STORAGE.md.
    """
    from .tools.gc import collect

    signal.signal(signal.SIGTERM, _raise_terminated)
    report = collect(str(url), keep_versions=keep_versions, keep_age_s=keep_age_s, dry_run=dry_run, wait=wait)
    if as_json:
        facts = {
            "url": report.url,
            "current": report.current,
            "kept": report.kept,
            "dropped": report.dropped,
            "deleted": [{"key": o.key, "size": o.size} for o in report.deleted],
            "bytes": report.bytes,
            "dry_run": report.dry_run,
        }
        click.echo(json_text(facts, indent=1))
        return
    verb = "would delete" if dry_run else "deleted"
    for o in report.deleted:
        click.echo(f"packer: {verb} {report.url}/{o.key} ({o.size:,} bytes)", err=True)
    click.echo(f"packer: {report.summary()}", err=True)


@main.command()
@click.argument("out", type=DATASET)
@click.option(
    "-o",
    "--output",
    "dest",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Image file to write (.jpg or .png).",
)
@click.option("--n", "count", type=click.IntRange(min=1), default=64, show_default=True, help="Records on the sheet.")
@click.option("--augment", is_flag=True, help="Show the training crops exactly as ShardDataset yields them.")
@click.option("--seed", type=int, default=0, show_default=True, help="Picks the records (and the crops).")
@click.option("--epoch", type=int, default=0, show_default=True, help="Epoch of the crops, with --augment.")
@click.option(
    "--crop-size", type=click.IntRange(min=1), default=224, show_default=True, help="Crop size, with --augment."
)
@_friendly
def preview(out: Path, dest: Path, count: int, augment: bool, seed: int, epoch: int, crop_size: int) -> None:
    """Write a contact sheet of records captioned with index and class."""
    from .tools.preview import contact_sheet

    cols, rows = contact_sheet(out, dest, n=count, augment=augment, seed=seed, crop_size=crop_size, epoch=epoch)
    click.echo(f"packer: wrote {dest} ({cols} x {rows} grid)", err=True)


@main.command()
@click.argument("out", type=DATASET)
@click.argument("index", type=int)
@click.option(
    "-o",
    "--output",
    "dest",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the stored image here.",
)
@_friendly
def show(out: Path, index: int, dest: Path | None) -> None:
    """Print record INDEX's source path, class and size; write its image with -o."""
    from .tools.preview import show as show_record

    try:
        source, cls, (w, h) = show_record(out, index, dest)
    except IndexError as e:
        raise click.BadParameter(str(e), param_hint="INDEX") from None
    click.echo(f"{index}: {source}  class {cls}  {w}x{h}" + (f"  -> {dest}" if dest else ""))


def _worker_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """'0,2,4' -> [0, 2, 4]; None means the default sweep (0 .. cores)."""
    if value is None:
        return None
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise click.BadParameter("expected worker counts like 0,2,4")
    return counts


@main.command()
@click.argument("out", type=DATASET)
@click.option(
    "--workers",
    callback=_worker_list,
    default=None,
    metavar="N,N,...",
    help="num_workers values to sweep [default: 0, 1, ... up to the core count].",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--crop-size", type=click.IntRange(min=1), default=224, show_default=True)
@click.option("--eval", "eval_", is_flag=True, help="Eval transform (resize + center crop) instead of train.")
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=None,
    help="Full passes per measurement [default: one pass, at least 4 batches and at most 3,000 samples].",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed runs per num_workers value (back to back, after one warm-up): the spread shows the noise, "
    "and more workers are advised only for a difference larger than it.",
)
@click.option(
    "--dtype",
    type=click.Choice(["uint8", "float32"]),
    default="uint8",
    show_default=True,
    help="Output dtype (uint8: normalize on the GPU with packer.transform.to_device).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write a PNG of samples/s vs num_workers (needs matplotlib: the [plot] extra).",
)
@_friendly
def bench(
    out: Path,
    workers: list[int] | None,
    batch_size: int,
    crop_size: int,
    eval_: bool,
    epochs: int | None,
    repeats: int,
    dtype: str,
    as_json: bool,
    plot_file: Path | None,
) -> None:
    """Measure OUT's input pipeline without a model: samples/s per num_workers, where time goes."""
    import importlib.util

    from .tools.bench import plot, run_bench

    if plot_file is not None and importlib.util.find_spec("matplotlib") is None:
        click.echo(f"packer: error: --plot needs matplotlib: pip install '{DISTRIBUTION}[plot]'", err=True)
        sys.exit(1)
    result = run_bench(
        out,
        workers=workers,
        batch_size=batch_size,
        crop_size=crop_size,
        train=not eval_,
        epochs=epochs,
        dtype=dtype,
        repeats=repeats,
        progress=lambda line: click.echo(f"packer bench: {line}", err=True),
    )
    if plot_file is not None:
        plot(result, plot_file)
    click.echo(json_text(result.to_json(), indent=1) if as_json else result.summary())


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool) -> None:
    """What this install and machine give packer's fast paths, and the fix for each one missing."""
    from .tools.doctor import as_dicts, diagnose

    findings = diagnose()
    if as_json:
        click.echo(json_text(as_dicts(findings), indent=1))
        return
    width = max(len(f.name) for f in findings)
    for f in findings:
        click.echo(f"{ {True: 'ok', False: '!!', None: '--'}[f.ok] }  {f.name:<{width}}  {f.value}")
        if f.fix:
            click.echo(f"    {'':<{width}}  -> {f.fix}")
    slow = sum(f.ok is False for f in findings)
    click.echo(f"{slow} finding(s) to act on" if slow else "every fast path packer has is in use")


if __name__ == "__main__":  # pragma: no cover
    main()
