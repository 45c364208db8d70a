"""How an encoded picture is referenced in a message's text: ``<__image_KEY__>``.

The media profile writes a marker where a picture given to a vision encoder goes;
the runtime (``engine/runtime/media_prompt.py``) finds the markers again when it
builds a prompt and puts the picture's embedding rows there; the app leaves them
out when it shows a message. KEY is 16 hex digits of sha256(encoder name, NUL,
file bytes), so one picture has one key per encoder.
"""

from __future__ import annotations

import hashlib
import re

MARKER_RE = re.compile(r"<__image_([0-9a-f]{16})__>")


def marker(key: str) -> str:
    """The text that stands for image ``key`` in a message."""
    return f"<__image_{key}__>"


def image_key(data: bytes, encoder: str) -> str:
    """16 hex digits of sha256(encoder name, NUL, file bytes): one key per picture and encoder."""
    return hashlib.sha256(encoder.encode() + b"\0" + data).hexdigest()[:16]
