"""BuildOptions: one place for every build setting; the CLI generated from it; what builds record unchanged."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from PIL import Image

from packer import BuildError, Labelling, build
from packer.builder.options import SHARD_SIZE, BuildOptions, cli_fields, flag
from packer.builder.scan import identify, scan
from packer.cli import build as build_command
from packer.codec import codec_name
from packer.format import Manifest
from packer.tools.verify import verify

from .test_labels import v1_pixels

V2 = Path(__file__).resolve().parents[1] / "data" / "v2-memmap"
# packer build's parameters that are not BuildOptions fields: the call's own (--staging: where a URL OUT
# is staged), and the four flags that make BuildOptions.labelling (Labelling's fields)
NOT_FIELDS = {"raw_dir", "out", "quiet", "dask_address", "staging"} | {f.name for f in dataclasses.fields(Labelling)}


def test_every_build_option_is_a_field_with_its_default_and_help() -> None:
    params = {p.name: p for p in build_command.params}
    fields = {f.name: f for f in cli_fields()}
    assert set(params) - NOT_FIELDS == set(fields)
    assert {f.name for f in dataclasses.fields(BuildOptions)} == set(fields) | {"labelling"}
    for name, f in fields.items():
        p = params[name]
        assert isinstance(p, click.Option) and p.opts == [flag(name)] and p.help == f.metadata["help"]
        assert p.default == f.default, name


def test_cli_defaults_make_the_default_options() -> None:
    """What click passes for an empty command line is BuildOptions() exactly (no second set of defaults)."""
    ctx = build_command.make_context("build", ["raw", "out"])
    seen = {k: v for k, v in ctx.params.items() if k not in NOT_FIELDS}
    assert BuildOptions(**seen) == BuildOptions()
    assert Labelling(**{f.name: ctx.params[f.name] for f in dataclasses.fields(Labelling)}) == Labelling()


def test_the_labelling_flags_are_labellings_fields() -> None:
    """--classes, --unlabeled, --multi-label, --targets: one per Labelling field, help from its metadata,
    and the command line's values make that Labelling."""
    params = {p.name: p for p in build_command.params}
    for f in dataclasses.fields(Labelling):
        p = params[f.name]
        assert isinstance(p, click.Option) and p.opts == [flag(f.name)] and p.help == f.metadata["help"]
    args = ["raw", "out", "--classes", __file__, "--unlabeled", "--multi-label", "--targets", " a, b"]
    ctx = build_command.make_context("build", args)
    got = Labelling(**{f.name: ctx.params[f.name] for f in dataclasses.fields(Labelling)})
    assert got == Labelling(classes=__file__, unlabeled=True, multi_label=True, targets=("a", "b"))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quality": 0}, "--quality 0: must be 1..100"),
        ({"short_edge": 0}, "--short-edge 0: must be >= 1"),
        ({"max_pixels": 0}, "--max-pixels 0: must be >= 1"),
        ({"min_size": 0}, "--min-size 0: must be >= 1"),
        ({"max_aspect": 0.5}, "--max-aspect 0.5: must be >= 1"),
        ({"workers": -1}, "--workers -1: must be >= 0"),
        ({"checkpoint_seconds": -1.0}, "--checkpoint-seconds -1.0: must be >= 0"),
        ({"shard_size": 0}, "--shard-size 0: must be >= 1"),
        ({"format": "png"}, "--format 'png': must be one of jpeg, raw"),
        ({"backend": "zip"}, "--backend 'zip': must be one of lmdb, memmap"),
        ({"on_error": "ignore"}, "--on-error 'ignore': must be one of skip, fail"),
        ({"split": {"train": 0.1}}, "--split name 'train' must be a plain name other than 'train'"),
    ],
)
def test_each_bad_value_is_one_line_naming_it(change: dict[str, Any], message: str) -> None:
    with pytest.raises(BuildError) as e:
        BuildOptions(**change)
    assert str(e.value) == message or str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_several_bad_values_are_reported_together(raw_photos: Path, tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"^--max-pixels 0: must be >= 1; --workers -1: must be >= 0$"):
        build(raw_photos, tmp_path / "out", max_pixels=0, workers=-1)
    assert not (tmp_path / "out").exists()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "packer.cli",
            "build",
            str(raw_photos),
            str(tmp_path / "out"),
            "--checkpoint-seconds",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == "packer: error: --checkpoint-seconds -1.0: must be >= 0"


def test_settings_are_what_builds_always_recorded(raw_photos: Path) -> None:
    """build.json and the manifest's ``inputs`` digest cover exactly these keys and values: a change
    here would make every existing dataset out of date for --update and refuse every --resume."""
    found = scan(raw_photos)
    options = BuildOptions(quality=80).resolved("out.lmdb", SHARD_SIZE)
    assert options.settings(found) == {
        "options": {
            "format": "jpeg",
            "short_edge": 320,
            "quality": 80,
            "max_pixels": 256_000_000,
            "min_size": 16,
            "max_aspect": 10.0,
        },
        "backend": "lmdb",
        "shard_size": 10_000,
        "inputs": found.fingerprint(),
        "codec": codec_name(),
        "checksum": False,
        "labels": {"kind": "class", "targets": []},
    }
    assert options.manifest_options() == options.settings(found)["options"] | {"shard_size": 10_000, "checksum": False}


def v2_raw(raw: Path) -> Path:
    """tests/data/v2-memmap's raw/ (see its README.md): same bytes, same mtimes."""
    for k, (rel, w, h) in enumerate([("cat/0.bmp", 40, 24), ("cat/1.bmp", 24, 32), ("dog/2.bmp", 32, 32)]):
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(v1_pixels(k, w, h)).save(raw / rel)
        os.utime(raw / rel, ns=(1_700_000_000_000_000_000 + k,) * 2)
    (raw / "notes.txt").write_text("not an image\n")
    return raw


def test_dataset_built_before_the_change_verifies_and_is_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "v2"
    shutil.copytree(V2, out)
    assert verify(out).ok
    raw = v2_raw(tmp_path / "raw")
    found = scan(raw)
    found.identity = identify(raw, found.sources, False)
    recorded = np.load(out / "index.npy")
    assert (recorded["src_size"] == found.identity["src_size"]).all()  # the same raw/ as when it was built
    if Manifest.load(out).codec != codec_name():
        pytest.skip(f"the fixture was built with {Manifest.load(out).codec}, this machine has {codec_name()}")
    report = build(raw, out, backend="memmap", format="raw", workers=1, update=True, quiet=True)
    assert report.up_to_date and report.digest == Manifest.load(V2).digest
    assert build(raw, out, backend="memmap", format="raw", workers=0, resume=True, quiet=True).up_to_date


def test_workers_zero_decodes_in_this_process(raw_photos: Path, built, tmp_path: Path) -> None:
    """--workers 0 decodes in this process, like DataLoader's num_workers=0 (and `packer bench`'s 0);
    it used to mean "all cores". The same dataset either way."""
    report = build(raw_photos, tmp_path / "out.lmdb", workers=0, quiet=True)
    assert report.digest == Manifest.load(built("lmdb", "jpeg")).digest
