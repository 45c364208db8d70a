"""Sizes as people write and read them: ``parse_size('1.5G')`` and ``fmt_bytes(1536)``.

A base module (like ``errors`` and ``paths``): every layer may import it, it imports
nothing of AOTX. Binary units throughout (1 KiB = 1024 bytes).
"""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'512M', '8G', '1.5GiB', '1000000' -> bytes. Raises ValueError on bad text."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            mult, t = m, t[:-1]
            break
    v = float(t)
    if v <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(v * mult)


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB (negative sizes keep their sign)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def parse_duration(text: str) -> float:
    """'5m', '30s', '1h', '1h30m', '90', '0' -> seconds (a bare number is seconds).
    Raises ValueError on bad or negative text."""
    import re

    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", t)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", "", t).strip():
        raise ValueError(f"not a duration: {text!r} (e.g. 5m, 30s, 1h, 0)")
    mult = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    return sum(float(v) * mult[u] for v, u in parts)


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an s unless n is 1: "1 message", "3 messages"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def short_title(text: str, limit: int = 60) -> str:
    """A conversation title from a prompt: whitespace collapsed, at most ``limit``
    characters, cut at a word boundary when the cut falls inside a word (unless that leaves
    less than half), with no trailing space or punctuation left by the cut (never a title
    such as "... reverses a string," ending in a comma)."""
    t = " ".join(text.split())
    if len(t) <= limit:
        return t
    cut = t[:limit]
    if t[limit] != " " and " " in cut and cut.rfind(" ") >= limit // 2:
        cut = cut[:cut.rfind(" ")]
    return cut.rstrip(" ,;:-–—")
