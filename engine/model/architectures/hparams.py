"""Metadata keys that only one architecture reads, read with the key's name in every error.

Owns: ``key`` (one ``<arch>.<name>`` value: an int, a float or a bool, with an optional
default) and ``array`` (an array of ints or bools, of an expected length), both raising one
ModelError line naming the file, the key and what is wrong. ``ModelConfig.meta`` holds the
file's metadata; ``config.py`` reads the keys every architecture shares. Leaves what a
value means to the architecture module.
"""

from __future__ import annotations

from typing import Any

from aotx.engine.errors import ModelError
from aotx.engine.model.config import ModelConfig

_MISSING = object()


def key(cfg: ModelConfig, path: str, name: str, default: Any = _MISSING, kind: type = int) -> Any:
    """``<arch>.<name>`` as ``kind`` (int, float or bool); ``default`` when absent (required
    when no default is given). A per-layer array is accepted when all its values agree."""
    full = f"{cfg.arch}.{name}"
    v = cfg.meta.get(full, default)
    if v is _MISSING:
        raise ModelError(f"{path}: metadata key {full!r} is missing")
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise ModelError(f"{path}: metadata key {full!r} has different values per layer ({v[:8]}); AOTX needs "
                             f"one value for every layer")
        v = v[0]
    if kind is bool:
        if not isinstance(v, (bool, int)):
            raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}")
        return bool(v)
    if isinstance(v, (bool, str)):
        raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}")
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}") from None


def array(cfg: ModelConfig, path: str, name: str, length: int | None = None, kind: type = int) -> tuple | None:
    """``<arch>.<name>`` as a tuple of ``kind`` (int or bool), None when absent; a wrong
    type or a length other than ``length`` (when given) is a ModelError."""
    full = f"{cfg.arch}.{name}"
    v = cfg.meta.get(full)
    if v is None:
        return None
    if not isinstance(v, list) or any(isinstance(x, str) for x in v):
        raise ModelError(f"{path}: metadata key {full!r} should be an array of {kind.__name__}s, has {v!r}")
    if length is not None and len(v) != length:
        raise ModelError(f"{path}: metadata key {full!r} has {len(v)} entries, expected {length}")
    return tuple(kind(x) for x in v)


def positive(cfg: ModelConfig, path: str, name: str, value: float) -> None:
    if not value > 0:
        raise ModelError(f"{path}: {cfg.arch}.{name} is {value}; it must be positive")
