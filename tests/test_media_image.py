"""Image decoding and normalization (media/image.py): every conversion on files
generated here with Pillow, and the bad images people have (bombs, truncated,
not an image)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from aotx.engine.errors import MediaError  # noqa: E402
from aotx.media import image as img  # noqa: E402

RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)


def halves(w: int = 40, h: int = 20) -> Image.Image:
    """Left half red, right half blue."""
    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 2] = RED
    a[:, w // 2:] = BLUE
    return Image.fromarray(a)


def px(im: Image.Image, x: int, y: int) -> tuple[int, ...]:
    return tuple(int(v) for v in im.getpixel((x, y)))


def close(a, b, tol: int = 8) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b))


# --------------------------------------------------------------------------- EXIF orientation

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("orientation, size, probe, colour", [
    (1, (40, 20), (2, 10), RED),     # as stored: red on the left
    (3, (40, 20), (37, 10), RED),    # rotated 180: red on the right
    (6, (20, 40), (10, 2), RED),     # rotate 90 CW to view: the stored left side is the top
    (8, (20, 40), (10, 37), RED),    # rotate 90 CCW to view: the stored left side is the bottom
    (2, (40, 20), (37, 10), RED),    # mirrored
])
def test_exif_orientation_applied(tmp_path, fmt, orientation, size, probe, colour):
    src = halves()
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"o{orientation}.{fmt.lower()}"
    extra = {"quality": 95} if fmt == "JPEG" else ({"lossless": True} if fmt == "WEBP" else {})
    src.save(path, fmt, exif=exif.tobytes(), **extra)
    out = img.load_image(path)
    assert out.mode == "RGB" and out.size == size
    assert close(px(out, *probe), colour, 40)
    assert out.getexif().get(0x0112, 1) == 1


# --------------------------------------------------------------------------- modes

def test_palette_with_transparency_flattens_onto_white(tmp_path):
    p = Image.new("P", (8, 8), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    for x in range(4):
        for y in range(8):
            p.putpixel((x, y), 1)
    for fmt in ("PNG", "GIF"):
        path = tmp_path / f"pal.{fmt.lower()}"
        p.save(path, fmt, transparency=0)
        reopened = Image.open(path)
        assert reopened.mode == "P" and "transparency" in reopened.info
        out = img.load_image(path)
        assert out.mode == "RGB"
        assert px(out, 1, 1) == RED
        assert px(out, 6, 6) == WHITE, f"{fmt}: the transparent index must become the background, not black"


def test_palette_without_transparency(tmp_path):
    p = halves().convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    path = tmp_path / "pal.png"
    p.save(path)
    out = img.load_image(path)
    assert out.mode == "RGB" and px(out, 1, 1) == RED and px(out, 38, 1) == BLUE


def test_cmyk_to_rgb(tmp_path):
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # full magenta + yellow = red
    tif = tmp_path / "c.tif"
    cmyk.save(tif)
    assert Image.open(tif).mode == "CMYK"
    assert px(img.load_image(tif), 3, 3) == RED
    jpg = tmp_path / "c.jpg"
    cmyk.save(jpg, quality=95)
    assert Image.open(jpg).mode == "CMYK"
    assert close(px(img.load_image(jpg), 3, 3), RED, 12)


def test_16bit_grayscale_scaled_not_clipped(tmp_path):
    a = np.array([[0, 1000, 32896, 65535]], np.uint16)
    path = tmp_path / "g16.png"
    Image.fromarray(a).save(path)
    assert Image.open(path).mode in ("I;16", "I")
    out = np.asarray(img.load_image(path))
    assert out.shape == (1, 4, 3)
    assert out[0, :, 0].tolist() == [0, 4, 128, 255], "16-bit values must be scaled by 1/257, not clipped at 255"


def test_16bit_rgb_png(tmp_path):
    # Pillow reads 16-bit-per-channel RGB PNG as 8-bit RGB; make one by hand and check the high bytes win.
    w, h = 2, 1
    raw = b"\x00" + struct.pack(">6H", 65535, 0, 0, 0, 0, 32896)
    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    path = tmp_path / "rgb16.png"
    path.write_bytes(png_bytes(ihdr, zlib.compress(raw)))
    out = img.load_image(path)
    assert px(out, 0, 0) == RED and px(out, 1, 0) == (0, 0, 128)


def test_grayscale_with_alpha(tmp_path):
    la = Image.new("LA", (3, 1))
    la.putdata([(100, 255), (100, 0), (0, 128)])
    path = tmp_path / "la.png"
    la.save(path)
    assert Image.open(path).mode == "LA"
    out = img.load_image(path)
    assert px(out, 0, 0) == (100, 100, 100)
    assert px(out, 1, 0) == WHITE
    assert close(px(out, 2, 0), (127, 127, 127), 2)


def test_rgba_flattened(tmp_path):
    im = Image.new("RGBA", (2, 1))
    im.putdata([(255, 0, 0, 255), (0, 0, 255, 0)])
    path = tmp_path / "rgba.png"
    im.save(path)
    out = img.load_image(path)
    assert px(out, 0, 0) == RED and px(out, 1, 0) == WHITE


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_first_frame(tmp_path, fmt):
    frames = [Image.new("RGB", (16, 16), c) for c in (RED, GREEN, BLUE)]
    path = tmp_path / f"anim.{fmt.lower()}"
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(path, fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **extra)
    opened = Image.open(path)
    assert getattr(opened, "n_frames", 1) == 3
    opened.seek(2)  # a caller may have moved on: first_frame goes back
    assert close(px(img.first_frame(opened).convert("RGB"), 8, 8), RED, 4)
    out = img.load_image(path)
    assert out.mode == "RGB" and close(px(out, 8, 8), RED, 4)


@pytest.mark.parametrize("mode, values, expected", [
    ("I;16", np.array([[0, 257, 65535]], np.uint16), [0, 1, 255]),
    ("I", np.array([[0, 257, 65535]], np.int32), [0, 1, 255]),                  # fits 16 bits: /257
    ("I", np.array([[-100, 0, 155]], np.int32), [0, 100, 255]),                 # signed: stretched min..max
    ("F", np.array([[0.0, 0.5, 1.0]], np.float32), [0, 128, 255]),              # [0, 1]: scaled
    ("F", np.array([[0.0, 100.0, 300.0]], np.float32), [0, 100, 255]),          # else clipped
])
def test_high_depth_to_8bit(mode, values, expected):
    im = Image.fromarray(values)
    assert im.mode == mode or (mode == "I;16" and im.mode.startswith("I;16"))
    out = img.high_depth_to_8bit(im)
    assert out.mode == "L" and list(np.asarray(out)[0]) == expected


@pytest.mark.parametrize("mode, colour, expected", [
    ("1", 1, WHITE), ("L", 77, (77, 77, 77)), ("YCbCr", (76, 85, 255), RED), ("RGB", RED, RED),
])
def test_to_rgb_plain_modes(mode, colour, expected):
    out = img.to_rgb(Image.new(mode, (2, 2), colour))
    assert out.mode == "RGB" and close(px(out, 0, 0), expected, 3)


def test_unsupported_mode_refused():
    with pytest.raises(MediaError, match="mode LAB"):
        img.to_rgb(Image.new("LAB", (2, 2)))


def test_load_image_bytes():
    import io

    buf = io.BytesIO()
    halves().save(buf, "PNG")
    assert img.load_image_bytes(buf.getvalue()).size == (40, 20)
    with pytest.raises(MediaError, match="not an image"):
        img.load_image_bytes(b"hello world" * 10, "paste")
    with pytest.raises(MediaError, match="empty"):
        img.load_image_bytes(b"", "paste")


# --------------------------------------------------------------------------- bad images

def png_bytes(ihdr: bytes, idat: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_header(tmp_path):
    """A 100,000 x 100,000 PNG in a few hundred bytes: refused before any pixel is decoded."""
    path = tmp_path / "bomb.png"
    path.write_bytes(png_bytes(struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0), zlib.compress(b"\0" * 1000)))
    assert path.stat().st_size < 200
    with pytest.raises(MediaError, match="bomb.png.*(too large|over the limit)") as e:
        img.load_image(path)
    assert "10,000,000,000" in str(e.value) or "limit" in str(e.value)


def test_pixel_limit_is_a_parameter(tmp_path):
    path = tmp_path / "small.png"
    halves().save(path)
    with pytest.raises(MediaError, match=r"40 x 20 = 800 pixels, over the limit of 500"):
        img.load_image(path, max_pixels=500)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_truncated_image(tmp_path, fmt):
    rng = np.random.default_rng(1)
    noise = Image.fromarray(rng.integers(0, 255, (200, 200, 3), dtype=np.uint8))
    path = tmp_path / f"t.{fmt.lower()}"
    noise.save(path, fmt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match=f"t.{fmt.lower()}: (truncated|corrupt)"):
        img.load_image(path)


@pytest.mark.parametrize("content, match", [
    (b"", "empty"),
    (b"this is a text file, not a picture\n" * 4, "not an image"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 10, "corrupt|truncated|not an image"),
])
def test_not_an_image(tmp_path, content, match):
    path = tmp_path / "x.png"
    path.write_bytes(content)
    with pytest.raises(MediaError, match=match):
        img.load_image(path)


def test_missing_file(tmp_path):
    with pytest.raises(MediaError, match="no such image file"):
        img.load_image(tmp_path / "nope.png")
