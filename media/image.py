"""Image decoding and normalization: any file people have -> an upright RGB picture.

Owns: opening an image with Pillow under a pixel limit (before any pixel is
decoded), taking the first frame of animated files, applying the EXIF
orientation, and converting every mode Pillow produces to 8-bit RGB: palette
(with or without transparency), grayscale, grayscale with alpha, RGBA (alpha
flattened onto white), CMYK, 16-bit and 32-bit integer and float grayscale.
Leaves to others: what the picture says (``ocr.py``) and deciding which
attachment is an image (``profile.py``).

Every problem becomes a ``MediaError`` naming the file; nothing from Pillow
reaches a user. Limits said plainly: CMYK goes through Pillow's plain
conversion, embedded ICC profiles are not applied; LAB and HSV images are refused.
"""

from __future__ import annotations

import io
import os
import struct
import warnings
from pathlib import Path

import numpy as np

from aotx.engine.errors import MediaError

MAX_PIXELS = 64_000_000
"""Default largest image (width x height) decoded: 8000 x 8000. Above it the file
is refused from its header alone (a decompression bomb declares 10^10 pixels in a
few hundred bytes)."""

BACKGROUND = (255, 255, 255)
"""Colour transparent pixels are flattened onto (white, as a viewer shows a screenshot)."""


def open_image(path: str | os.PathLike[str], *, max_pixels: int = MAX_PIXELS):
    """Open ``path`` with Pillow and check its declared size; no pixels are decoded yet.

    Returns the lazily loaded ``PIL.Image.Image`` positioned on its first frame.
    Raises MediaError for a missing, empty or unrecognised file, and for one whose
    header declares more than ``max_pixels`` pixels."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise MediaError(f"{p}: no such image file")
    if p.stat().st_size == 0:
        raise MediaError(f"{p}: the file is empty (0 bytes), not an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(p)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(_too_many_pixels(p, e, max_pixels)) from None
    except UnidentifiedImageError:
        raise MediaError(f"{p}: not an image Pillow can read (unknown or corrupt format)") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"{p}: corrupt or truncated image header ({e})") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        im.close()
        raise MediaError(f"{p}: image header declares an empty size {w} x {h}")
    if w * h > max_pixels:
        im.close()
        raise MediaError(f"{p}: image is {w:,} x {h:,} = {w * h:,} pixels, over the limit of {max_pixels:,}; "
                         "scale it down or crop it")
    return im


def _too_many_pixels(name, e: Exception, max_pixels: int) -> str:
    """The refusal of an image past Pillow's own decompression-bomb guard, naming only
    AOTX's limit (Pillow's message names its own, larger one: two numbers confuse)."""
    import re

    m = re.search(r"\((\d+) pixels\)", str(e))
    size = f"{int(m.group(1)):,} pixels" if m else "more pixels than Pillow will open"
    return f"{name}: image is {size}, over the limit of {max_pixels:,}; scale it down or crop it"


def first_frame(im):
    """The first frame of an animated GIF/APNG/WebP/TIFF (the image itself otherwise)."""
    if getattr(im, "n_frames", 1) > 1:
        im.seek(0)
    return im


def apply_orientation(im):
    """Rotate/flip by the EXIF Orientation tag (1-8), so the picture is upright.

    Returns a new image without the tag; an image without one is returned as is."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(im)


def flatten_alpha(im, background: tuple[int, int, int] = BACKGROUND):
    """An image with transparency (RGBA, LA, PA, P with a transparency entry) ->
    RGB composited onto ``background``. Premultiplied modes (RGBa, La) are
    unpremultiplied first by Pillow's conversion."""
    from PIL import Image

    rgba = im.convert("RGBA")
    base = Image.new("RGBA", rgba.size, background + (255,))
    return Image.alpha_composite(base, rgba).convert("RGB")


def high_depth_to_8bit(im):
    """A 16-bit (``I;16``, ``I;16B``, ``I;16L``, ``I;16N``), 32-bit integer (``I``)
    or float (``F``) grayscale image -> 8-bit ``L``, scaled, not clipped.

    Pillow's own ``convert("L")`` clips these at 255 (a 16-bit value of 1000
    becomes white), so the scale is chosen here: 16-bit values by 1/257; ``I``
    values by 1/257 when they fit in 16 bits, else by the image's maximum; ``F``
    values as [0, 1] when they lie there, else clipped to [0, 255]."""
    from PIL import Image

    a = np.asarray(im)
    if im.mode.startswith("I;16"):
        out = a.astype(np.float32) / 257.0
    elif im.mode == "I":
        top = float(a.max()) if a.size else 0.0
        lo = float(a.min()) if a.size else 0.0
        if lo >= 0 and top <= 65535:
            out = a.astype(np.float32) / 257.0
        else:
            span = max(top - lo, 1.0)
            out = (a.astype(np.float64) - lo) * (255.0 / span)
    elif im.mode == "F":
        a = np.nan_to_num(a.astype(np.float32))
        out = a * 255.0 if (a.size and a.min() >= 0.0 and a.max() <= 1.0) else a
    else:
        raise ValueError(f"not a high-depth grayscale mode: {im.mode}")
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), mode="L")


def to_rgb(im):
    """Any Pillow image -> mode ``RGB`` (8 bits per channel).

    Transparency is flattened onto white (``flatten_alpha``), high-depth
    grayscale is scaled (``high_depth_to_8bit``), CMYK/YCbCr/1/L go through
    Pillow's conversion. Raises MediaError for modes with no sound RGB form."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("RGBA", "RGBa", "LA", "La", "PA") or (mode == "P" and "transparency" in im.info) \
            or (mode in ("L", "RGB") and "transparency" in im.info):
        return flatten_alpha(im)
    if mode.startswith("I;16") or mode in ("I", "F"):
        return high_depth_to_8bit(im).convert("RGB")
    if mode in ("P", "L", "1", "CMYK", "YCbCr", "RGBX"):
        return im.convert("RGB")
    raise MediaError(f"image mode {mode} cannot be converted to RGB; save the image as PNG or JPEG")


def load_image(path: str | os.PathLike[str], *, max_pixels: int = MAX_PIXELS):
    """Decode ``path`` to an upright ``RGB`` ``PIL.Image.Image`` (first frame, EXIF applied).

    Raises MediaError for a missing, empty, unrecognised, truncated or corrupt
    file and for one over ``max_pixels`` pixels."""
    p = Path(path)
    im = open_image(p, max_pixels=max_pixels)
    try:
        im = first_frame(im)
        im.load()
        im = apply_orientation(im)
        out = to_rgb(im)
        out.load()
    except MediaError as e:
        raise MediaError(f"{p}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise MediaError(f"{p}: truncated or corrupt {im.format or 'image'} data ({e})") from None
    return out


def load_image_bytes(data: bytes, name: str = "<bytes>", *, max_pixels: int = MAX_PIXELS):
    """``load_image`` for bytes in memory (a pasted image); ``name`` is used in errors."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise MediaError(f"{name}: empty image data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
        w, h = im.size
        if w * h > max_pixels:
            raise MediaError(f"{name}: image is {w:,} x {h:,} = {w * h:,} pixels, over the limit of {max_pixels:,}")
        im = first_frame(im)
        im.load()
        return to_rgb(apply_orientation(im))
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(_too_many_pixels(name, e, max_pixels)) from None
    except UnidentifiedImageError:
        raise MediaError(f"{name}: not an image Pillow can read") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise MediaError(f"{name}: truncated or corrupt image data ({e})") from None

