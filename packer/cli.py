"""The ``packer`` command line: thin wrappers over the Python API, one-line errors for expected failures."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import click


def _expected_errors() -> tuple[type[BaseException], ...]:
    from .format import DatasetError
    from .pipeline import BuildError
    from .scan import ScanError

    return (BuildError, DatasetError, ScanError)


def _friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures print one line and exit 1 (2 for usage); --debug shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = click.get_current_context().find_root().params.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            if debug:
                raise
            click.echo("packer: interrupted; nothing was written at the output "
                       "(run the same build with --resume to continue)", err=True)
            sys.exit(130)
        except _expected_errors() as e:
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for expected errors.")
@click.version_option(package_name="packer")
def main(debug: bool) -> None:
    """Preprocess an image folder once; pack it into LMDB or memmap shards for fast training."""


@main.command()
@click.argument("raw_dir", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(["lmdb", "memmap"]), default=None,
              help="Default: lmdb when OUT ends in .lmdb, else memmap.")
@click.option("--format", "format_", type=click.Choice(["jpeg", "raw"]), default="jpeg", show_default=True,
              help="jpeg: re-encoded JPEG; raw: decoded uint8 H x W x 3 pixels (bigger, no decode at read).")
@click.option("--short-edge", type=int, default=320, show_default=True, help="Target short edge; never upscales.")
@click.option("--quality", type=int, default=90, show_default=True, help="JPEG quality.")
@click.option("--workers", type=int, default=None, help="Worker processes [default: all cores].")
@click.option("--shard-size", type=int, default=10_000, show_default=True, help="Records per memmap shard.")
@click.option("--labels", type=click.Path(exists=True, dir_okay=False), default=None,
              help="CSV with columns path,label (path relative to RAW_DIR) instead of folder labels.")
@click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="skip: report bad files and go on; fail: stop at the first one.")
@click.option("--max-pixels", type=int, default=256_000_000, show_default=True,
              help="Refuse images with more pixels (decompression bombs).")
@click.option("--min-size", type=int, default=16, show_default=True, help="Skip images with a shorter edge.")
@click.option("--max-aspect", type=float, default=10.0, show_default=True,
              help="Skip images whose long/short edge ratio exceeds this.")
@click.option("--force", is_flag=True, help="Replace an existing OUT (only once the new one is complete).")
@click.option("--resume", is_flag=True, help="Continue an interrupted build of the same inputs and options.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@_friendly
def build(raw_dir: Path, out: Path, format_: str, **options: Any) -> None:
    """Pack RAW_DIR (class sub-folders = labels) into OUT."""
    from .pipeline import build as run_build

    report = run_build(raw_dir, out, format=format_, **options)
    click.echo(report.summary(), err=True)


def dataset_info(out: str | os.PathLike) -> dict[str, Any]:
    """The facts `packer info` shows, as a dict (its --json form)."""
    from .format import Manifest, load_index

    manifest = Manifest.load(out)
    index, _ = load_index(out, manifest)
    on_disk = sum(p.stat().st_size for p in Path(out).iterdir() if p.is_file())
    record_bytes = int(index["length"].sum()) if len(index) else 0
    return {
        "path": str(out), "count": manifest.count, "classes": manifest.classes,
        "class_counts": dict(zip(manifest.classes, manifest.class_counts)),
        "format": manifest.format, "backend": manifest.backend, "short_edge": manifest.short_edge,
        "quality": manifest.quality, "bytes": on_disk, "record_bytes": record_bytes,
        "mean_bytes": record_bytes / manifest.count if manifest.count else 0.0,
        "digest": manifest.digest, "scanned": manifest.scanned, "skipped": manifest.skipped,
        "ignored": manifest.ignored, "codec": manifest.codec, "shards": len(manifest.shards),
        "packer_version": manifest.packer_version,
    }


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_friendly
def info(out: Path, as_json: bool) -> None:
    """Summarise the dataset at OUT."""
    facts = dataset_info(out)
    if as_json:
        click.echo(json.dumps(facts, indent=1, ensure_ascii=False))
        return
    width = max((len(c) for c in facts["classes"]), default=0)
    click.echo(f"{facts['path']}: {facts['count']} images, {len(facts['classes'])} classes, "
               f"{facts['format']} in {facts['backend']}, short edge {facts['short_edge']}"
               + (f", quality {facts['quality']}" if facts["format"] == "jpeg" else ""))
    click.echo(f"  bytes on disk {facts['bytes']:,}; mean {facts['mean_bytes']:,.0f} bytes/image")
    click.echo(f"  scanned {facts['scanned']}, skipped {facts['skipped']}, ignored {facts['ignored']}")
    click.echo(f"  digest {facts['digest']}")
    for name, n in facts["class_counts"].items():
        click.echo(f"  {name:<{width}}  {n}")


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--limit", type=int, default=10, show_default=True, help="Problems to list at most.")
@_friendly
def verify(out: Path, limit: int) -> None:
    """Re-read every record of OUT: checksums, digest, index/manifest consistency (exit 1 if bad)."""
    from .verify import verify as run_verify

    result = run_verify(out, limit=limit)
    if result.ok:
        click.echo(f"packer: {out}: ok, {result.count} records, {result.digest}")
        return
    for problem in result.problems:
        click.echo(f"packer: {out}: {problem}", err=True)
    click.echo(f"packer: {out}: FAILED verification ({result.bad_records} bad records)", err=True)
    sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
