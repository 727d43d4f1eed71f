"""Every kind of input a camera folder throws at `packer build`, generated here, and what becomes of it.

One messy raw/ tree is built once (CLI, raw pixels, so conversions can be checked exactly); each test
then looks at one aspect: stored pixels, the report, the counts, the summary line, the info keys.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from PIL import Image

from packer import BuildError, build
from packer.builder.options import BuildOptions
from packer.builder.preprocess import HEIF_AVAILABLE, HEIF_MISSING, Record, Skip, process
from packer.format import Manifest, load_index, source_path
from packer.read.reader import open_reader

PACKER = [sys.executable, "-m", "packer.cli"]
MAX_PIXELS = 1_000_000  # the build's --max-pixels: bomb.png (2000 x 2000) is above it
W, H = 64, 48


def gradient(w: int = W, h: int = H, seed: int = 0) -> np.ndarray:
    """Smooth RGB content (JPEG-friendly, so lossy formats stay close to the original)."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y + seed * 40) % 256], -1)
    return rgb.astype(np.uint8)


def save(path: Path, im: Image.Image, fmt: Optional[str] = None, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, fmt, **kw)
    return path


def png_header_only(path: Path, width: int, height: int) -> None:
    """A tiny PNG whose IHDR claims ``width`` x ``height``: a decompression bomb's header, no real pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def ycck_jpeg(cmyk: np.ndarray) -> Optional[bytes]:
    """A YCCK JPEG (Adobe transform 2) through libjpeg-turbo; Pillow cannot write one. Adobe CMYK is inverted."""
    try:
        from turbojpeg import TJPF_CMYK, TJSAMP_444, TurboJPEG

        return TurboJPEG().encode(255 - cmyk, quality=95, pixel_format=TJPF_CMYK, jpeg_subsample=TJSAMP_444)
    except Exception:  # libturbojpeg missing
        return None


# What each generated file must become: ("packed", pixel check or None) | ("skipped"|"ignored", reason part).
Expect = tuple[str, object]


def make_raw(root: Path) -> dict[str, Expect]:
    """Write the messy tree under ``root`` and return the expected fate of every entry the scan sees."""
    g = root / "good"
    rgb = gradient()
    expect: dict[str, Expect] = {}

    def near(ref: np.ndarray, tol: float) -> Callable[[np.ndarray], None]:
        def check(img: np.ndarray) -> None:
            assert img.shape == ref.shape
            assert np.abs(img.astype(int) - ref.astype(int)).mean() <= tol

        return check

    save(g / "baseline.jpg", Image.fromarray(rgb), quality=95)
    expect["good/baseline.jpg"] = ("packed", near(rgb, 3))
    save(g / "progressive.jpg", Image.fromarray(rgb), quality=95, progressive=True)
    expect["good/progressive.jpg"] = ("packed", near(rgb, 3))
    save(g / "UPPER CASE.JPEG", Image.fromarray(rgb), quality=95)
    expect["good/UPPER CASE.JPEG"] = ("packed", near(rgb, 3))
    save(g / "ñandú 写真 é.jpg", Image.fromarray(rgb), quality=95)
    expect["good/ñandú 写真 é.jpg"] = ("packed", near(rgb, 3))

    cmyk = np.zeros((H, W, 4), np.uint8)
    cmyk[:, W // 2 :, 0] = 255  # left half no ink (white), right half full cyan

    def white_then_cyan(img: np.ndarray) -> None:
        left, right = img[:, : W // 2 - 4].reshape(-1, 3).mean(0), img[:, W // 2 + 4 :].reshape(-1, 3).mean(0)
        assert (left > 245).all(), left
        assert right[0] < 10 and (right[1:] > 245).all(), right

    save(g / "cmyk.jpg", Image.fromarray(cmyk, "CMYK"), quality=95)
    expect["good/cmyk.jpg"] = ("packed", white_then_cyan)
    ycck = ycck_jpeg(cmyk)
    if ycck is not None:
        (g / "ycck.jpg").write_bytes(ycck)
        expect["good/ycck.jpg"] = ("packed", white_then_cyan)

    gray = rgb[..., 0]
    save(g / "gray.jpg", Image.fromarray(gray, "L"), quality=95)
    expect["good/gray.jpg"] = ("packed", near(np.repeat(gray[..., None], 3, -1), 3))

    rgba = np.zeros((H, W, 4), np.uint8)
    rgba[:, :20] = (255, 0, 0, 255)  # opaque red
    rgba[:, 20:40] = (0, 0, 0, 128)  # half-transparent black: grey on white
    rgba[:, 40:] = (0, 0, 255, 0)  # fully transparent blue: white
    save(g / "alpha.png", Image.fromarray(rgba, "RGBA"))

    def composited(img: np.ndarray) -> None:
        assert (img[:, :20] == (255, 0, 0)).all()
        assert (np.abs(img[:, 20:40].astype(int) - 127) <= 1).all()
        assert (img[:, 40:] == 255).all(), "transparent pixels must become white, not their hidden colour"

    expect["good/alpha.png"] = ("packed", composited)

    pal = Image.fromarray(np.where(np.arange(W)[None, :].repeat(H, 0) < W // 2, 0, 1).astype(np.uint8), "P")
    pal.putpalette([0, 200, 0, 0, 0, 0] + [0] * 762)
    save(g / "palette.png", pal, transparency=1)

    def green_then_white(img: np.ndarray) -> None:
        assert (img[:, : W // 2] == (0, 200, 0)).all() and (img[:, W // 2 :] == 255).all()

    expect["good/palette.png"] = ("packed", green_then_white)

    levels = np.array([0, 257 * 100, 32896, 65535], np.uint16)  # -> 0, 100, 128, 255 when scaled by 257
    deep = np.repeat(levels, W // 4)[None, :].repeat(H, 0)

    def scaled_16bit(img: np.ndarray) -> None:
        assert img[0, :: W // 4, 0].tolist() == [0, 100, 128, 255], "16-bit must be scaled, not clipped"
        assert (img[..., 0] == img[..., 1]).all() and (img[..., 1] == img[..., 2]).all()

    save(g / "deep16.png", Image.fromarray(deep))  # uint16 -> mode I;16
    expect["good/deep16.png"] = ("packed", scaled_16bit)
    save(g / "deep16.tif", Image.fromarray(deep))
    expect["good/deep16.tif"] = ("packed", scaled_16bit)
    assert Image.open(g / "deep16.png").mode.startswith("I") and Image.open(g / "deep16.tif").mode.startswith("I;16")

    exact = lambda img: np.testing.assert_array_equal(img, rgb)  # noqa: E731 - lossless formats
    save(g / "lossless.webp", Image.fromarray(rgb), lossless=True)
    expect["good/lossless.webp"] = ("packed", exact)
    save(g / "plain.tiff", Image.fromarray(rgb))
    expect["good/plain.tiff"] = ("packed", exact)
    save(g / "plain.bmp", Image.fromarray(rgb))
    expect["good/plain.bmp"] = ("packed", exact)
    save(g / "My Photo.PNG", Image.fromarray(rgb))
    expect["good/My Photo.PNG"] = ("packed", exact)
    save(g / "nested" / "deeper" / "inner.png", Image.fromarray(rgb))
    expect["good/nested/deeper/inner.png"] = ("packed", exact)

    frames = [Image.new("RGB", (W, H), c) for c in ((255, 0, 0), (0, 0, 255))]
    save(g / "anim.gif", frames[0], save_all=True, append_images=frames[1:], duration=100, loop=0)
    # n_frames is the GIF plugin's; Pillow's stub types Image.open's result as the base ImageFile
    assert Image.open(g / "anim.gif").n_frames == 2  # type: ignore[attr-defined]
    expect["good/anim.gif"] = ("packed", lambda img: np.testing.assert_array_equal(img[0, 0], (255, 0, 0)))

    outside = root.parent / f"{root.name}-outside"
    save(outside / "target.png", Image.fromarray(rgb))
    (g / "linked.png").symlink_to(outside / "target.png")
    expect["good/linked.png"] = ("packed", exact)
    (g / "nested" / "loop").symlink_to("..", target_is_directory=True)  # good/nested/loop -> good
    expect["good/nested/loop/"] = ("ignored", "already visited")
    (g / "dangling.jpg").symlink_to(root / "no-such-file.jpg")
    expect["good/dangling.jpg"] = ("skipped", "unreadable")

    if HEIF_AVAILABLE:
        import pillow_heif

        pillow_heif.from_pillow(Image.fromarray(rgb)).save(g / "phone.heic", quality=95)
        expect["good/phone.heic"] = ("packed", near(rgb, 6))
    else:
        (g / "phone.heic").write_bytes(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00heicmif1")
        expect["good/phone.heic"] = ("skipped", HEIF_MISSING)

    save(g / "edge-aspect.png", Image.fromarray(gradient(160, 16)))  # exactly --max-aspect 10: kept
    expect["good/edge-aspect.png"] = ("packed", lambda img: np.testing.assert_array_equal(img, gradient(160, 16)))

    # ignored: hidden, not an image, not in a class folder, not a regular file
    (g / "notes.txt").write_text("not an image")
    expect["good/notes.txt"] = ("ignored", "not an image extension")
    save(g / ".hidden.jpg", Image.fromarray(rgb))
    expect["good/.hidden.jpg"] = ("ignored", "hidden")
    save(root / ".thumbnails" / "x.jpg", Image.fromarray(rgb))
    expect[".thumbnails/"] = ("ignored", "hidden")
    save(root / "stray.jpg", Image.fromarray(rgb))
    expect["stray.jpg"] = ("ignored", "not inside a class folder")
    os.mkfifo(g / "pipe.jpg")  # opening a FIFO would block the build forever
    expect["good/pipe.jpg"] = ("ignored", "not a regular file")

    b = root / "bad"
    b.mkdir()
    (b / "empty.jpg").write_bytes(b"")
    expect["bad/empty.jpg"] = ("skipped", "not a recognised image")
    (b / "text.jpg").write_text("this is a text file with an image extension\n" * 20)
    expect["bad/text.jpg"] = ("skipped", "not a recognised image")
    big = gradient(200, 160)
    for name, fmt, kw in (
        ("truncated.jpg", "JPEG", {}),
        ("truncated-progressive.jpg", "JPEG", {"progressive": True}),
        ("truncated-cmyk.jpg", "JPEG", {}),
        ("truncated.png", "PNG", {}),
    ):
        data = io.BytesIO()
        (Image.fromarray(big).convert("CMYK") if "cmyk" in name else Image.fromarray(big)).save(data, fmt, **kw)
        (b / name).write_bytes(data.getvalue()[: len(data.getvalue()) * 2 // 3])
        expect[f"bad/{name}"] = ("skipped", "truncated|corrupt")
    save(b / "bomb.png", Image.new("L", (2000, 2000)))
    expect["bad/bomb.png"] = ("skipped", "decompression bomb")
    png_header_only(b / "header-bomb.png", 100_000, 100_000)
    expect["bad/header-bomb.png"] = ("skipped", "decompression bomb")
    save(b / "one-pixel.png", Image.new("RGB", (1, 1), (9, 9, 9)))
    expect["bad/one-pixel.png"] = ("skipped", "too small")
    save(b / "sliver.png", Image.fromarray(gradient(400, 20)))
    expect["bad/sliver.png"] = ("skipped", "extreme aspect ratio")
    return expect


@pytest.fixture(scope="module")
def messy(tmp_path_factory: pytest.TempPathFactory):
    """(raw, out, expectations, CLI result) for one build of the messy tree, memmap + raw pixels."""
    base = tmp_path_factory.mktemp("messy")
    raw, out = base / "raw", base / "out"
    expect = make_raw(raw)
    run = subprocess.run(
        PACKER
        + [
            "build",
            str(raw),
            str(out),
            "--format",
            "raw",
            "--workers",
            "2",
            "--max-pixels",
            str(MAX_PIXELS),
            "--shard-size",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return raw, out, expect, run


def read_back(out: Path) -> dict[str, np.ndarray]:
    manifest = Manifest.load(out)
    index, sources = load_index(out, manifest)
    reader = open_reader(out, manifest, index)
    return {
        source_path(sources, row): np.frombuffer(reader.get(i), np.uint8).reshape(row["height"], row["width"], 3)
        for i, row in enumerate(index)
    }


def report_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "report.jsonl").read_text(encoding="utf-8").splitlines()]


def test_every_decodable_kind_is_packed_as_correct_rgb(messy) -> None:
    _, out, expect, _ = messy
    packed = read_back(out)
    wanted = {rel: check for rel, (fate, check) in expect.items() if fate == "packed"}
    assert sorted(packed) == sorted(wanted)
    for rel, check in wanted.items():
        try:
            check(packed[rel])
        except AssertionError as e:
            raise AssertionError(f"{rel}: {e}") from None
    assert Manifest.load(out).classes == ["bad", "good"]


def test_report_names_every_skipped_and_ignored_file_with_its_reason(messy) -> None:
    _, out, expect, _ = messy
    report = {r["path"]: r for r in report_lines(out)}
    unpacked = {rel: v for rel, v in expect.items() if v[0] != "packed"}
    assert sorted(report) == sorted(unpacked), "report.jsonl must list exactly the files not packed"
    for rel, (status, reason) in unpacked.items():
        assert report[rel]["status"] == status, (rel, report[rel])
        assert any(part in report[rel]["reason"] for part in str(reason).split("|")), (rel, report[rel])
    assert "--max-pixels" in report["bad/bomb.png"]["reason"], "the bomb message must name the option"
    if not HEIF_AVAILABLE:
        assert "packer-datasets[heif]" in report["good/phone.heic"]["reason"]


def test_counts_add_up_in_manifest_info_and_summary(messy) -> None:
    _, out, expect, run = messy
    m = Manifest.load(out)
    fates = [fate for fate, _ in expect.values()]
    assert (m.count, m.skipped, m.ignored) == (fates.count("packed"), fates.count("skipped"), fates.count("ignored"))
    assert m.scanned == m.count + m.skipped + m.ignored == len(expect)
    info = subprocess.run(PACKER + ["info", str(out), "--json"], capture_output=True, text=True, check=True)
    facts = json.loads(info.stdout)
    assert (facts["scanned"], facts["skipped"], facts["ignored"]) == (m.scanned, m.skipped, m.ignored)
    summary = [line for line in run.stderr.splitlines() if " packed " in line]
    assert len(summary) == 1 and summary[0].startswith(
        f"packer: {out}: packed {m.count} of {m.scanned} scanned ({m.skipped} skipped, {m.ignored} ignored; "
        f"see report.jsonl)"
    )
    assert "Traceback" not in run.stderr
    verify = subprocess.run(PACKER + ["verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr


def test_default_pixel_limit_refuses_a_header_only_bomb(messy) -> None:
    raw, _, _, _ = messy
    result = process(str(raw / "bad" / "header-bomb.png"), BuildOptions().preprocess)
    assert isinstance(result, Skip) and "decompression bomb" in result.reason and "10000000000" in result.reason


def test_degenerate_sizes_pack_when_the_rule_allows(tmp_path: Path) -> None:
    """The rule is --min-size (short edge) and --max-aspect (long/short); relaxed, the same files pack exactly."""
    raw = tmp_path / "raw"
    save(raw / "c" / "one-pixel.png", Image.new("RGB", (1, 1), (9, 8, 7)))
    save(raw / "c" / "sliver.png", Image.fromarray(gradient(400, 20)))
    build(raw, tmp_path / "strict", workers=1, quiet=True, format="raw", allow_empty=True)
    assert Manifest.load(tmp_path / "strict").skipped == 2
    build(raw, tmp_path / "loose", workers=1, quiet=True, format="raw", min_size=1, max_aspect=400)
    packed = read_back(tmp_path / "loose")
    assert packed["c/one-pixel.png"].tolist() == [[[9, 8, 7]]]
    np.testing.assert_array_equal(packed["c/sliver.png"], gradient(400, 20))  # short edge 20 < 320: kept


def test_on_error_fail_names_the_file_and_leaves_no_output(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out.lmdb"
    save(raw / "c" / "a.jpg", Image.fromarray(gradient()))
    (raw / "c" / "b.jpg").write_text("not a jpeg")
    run = subprocess.run(
        PACKER + ["build", str(raw), str(out), "--on-error", "fail", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert str(raw / "c" / "b.jpg") in run.stderr and "not a recognised image" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not out.exists()


def _drop_file_read_override() -> None:
    """In the child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so
    that root's exec'd process obeys file permissions like any user (prctl PR_CAPBSET_DROP)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_unreadable_file_is_skipped(tmp_path: Path) -> None:
    """chmod 000 stops everyone but root; as root the build runs without the capabilities that bypass it."""
    raw = tmp_path / "raw"
    save(raw / "c" / "ok.png", Image.fromarray(gradient()))
    save(raw / "c" / "secret.png", Image.fromarray(gradient()))
    (raw / "c" / "secret.png").chmod(0o000)
    try:
        run = subprocess.run(
            PACKER + ["build", str(raw), str(tmp_path / "out"), "--workers", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=_drop_file_read_override if os.geteuid() == 0 else None,
        )
    except subprocess.SubprocessError as e:  # no CAP_SETPCAP: cannot give up the override here
        pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE, so chmod 000 does not bite ({e})")
    assert run.returncode == 0, run.stderr
    report = report_lines(tmp_path / "out")
    assert report == [{"path": "c/secret.png", "status": "skipped", "reason": "unreadable: Permission denied"}]
    assert Manifest.load(tmp_path / "out").count == 1


def test_labels_csv_naming_ignored_files_counts_each_file_once(tmp_path: Path) -> None:
    """A CSV row for a hidden or non-image file: the file is reported once, as ignored, not also as missing."""
    raw = tmp_path / "raw"
    save(raw / "c" / "a.jpg", Image.fromarray(gradient()))
    (raw / "c" / ".hidden.jpg").write_bytes(b"x")
    (raw / "c" / "notes.txt").write_text("x")
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\nc/a.jpg,x\nc/.hidden.jpg,x\nc/notes.txt,x\nc/gone.jpg,x\n", encoding="utf-8")
    build(raw, tmp_path / "out", labels=str(labels), workers=1, quiet=True)
    m = Manifest.load(tmp_path / "out")
    assert (m.scanned, m.count, m.skipped, m.ignored) == (4, 1, 1, 2)
    report = {r["path"]: r["status"] for r in report_lines(tmp_path / "out")}
    assert report == {"c/.hidden.jpg": "ignored", "c/notes.txt": "ignored", "c/gone.jpg": "skipped"}


@pytest.mark.parametrize(
    "row,message",
    [
        ("../outside.jpg,x", "escapes raw/"),
        ("c/../../etc/passwd,x", "escapes raw/"),
        ("/etc/passwd,x", "escapes raw/"),
        ("C:\\\\Windows\\\\x.jpg,x", "escapes raw/"),
        ("./,x", "names raw/ itself"),
        ("c/a.jpg,", "empty label"),
        ("c/a.jpg,x\nc/a.jpg,y", "duplicate path"),
        ("c/a.jpg,x\n./c/a.jpg,y", "duplicate path"),
    ],
)
def test_labels_csv_refusals(tmp_path: Path, row: str, message: str) -> None:
    raw = tmp_path / "raw"
    save(raw / "c" / "a.jpg", Image.fromarray(gradient()))
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\n" + row + "\n", encoding="utf-8")
    with pytest.raises(BuildError, match=message):
        build(raw, tmp_path / "out", labels=str(labels), workers=1, quiet=True)
    run = subprocess.run(
        PACKER + ["build", str(raw), str(tmp_path / "out"), "--labels", str(labels)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr
    assert str(labels) in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_builds_shrink_like_pillows_lanczos(tmp_path: Path, monkeypatch) -> None:
    """Where packer's Lanczos kernel shrinks decoded JPEGs (packer.codec.native_shrink), records are
    within 2 levels of Pillow's LANCZOS resize of the same decode, orientation included; the codec
    name recorded in the manifest says which resize made them."""
    from packer import codec
    from packer.builder import preprocess

    if not codec.native_shrink():
        pytest.skip("packer's resize kernel is not used here (not built, no AVX2, or no libjpeg-turbo)")
    assert codec.codec_name() == "turbojpeg, resize packer"
    rng = np.random.default_rng(3)
    for k, (size, orientation) in enumerate((((1000, 750), 1), ((999, 641), 6), ((641, 999), 3), ((2600, 1700), 8))):
        pixels = np.clip(gradient(*size, seed=k).astype(int) + rng.integers(-40, 40, (size[1], size[0], 3)), 0, 255)
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = save(tmp_path / f"{k}.jpg", Image.fromarray(pixels.astype(np.uint8)), quality=95, exif=exif)
        ours = process(str(path), BuildOptions(format="raw").preprocess)
        with monkeypatch.context() as m:
            m.setattr(preprocess, "native_shrink", lambda: False)
            theirs = process(str(path), BuildOptions(format="raw").preprocess)
            m.setattr(codec, "native_shrink", lambda: False)
            assert codec.codec_name().startswith("turbojpeg, resize pillow-")
        assert isinstance(ours, Record) and isinstance(theirs, Record)
        assert (ours.height, ours.width) == (theirs.height, theirs.width) and min(ours.height, ours.width) == 320
        diff = np.abs(np.frombuffer(ours.data, np.uint8).astype(int) - np.frombuffer(theirs.data, np.uint8))
        assert diff.max() <= 2 and diff.mean() < 0.1, (size, orientation)
