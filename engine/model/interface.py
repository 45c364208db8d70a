"""The model interface the runtime calls (engine/model/interface.py), as types.

Every loaded model (``loader.LoadedModel.model``) has this shape, whatever its
architecture or backend; the runtime calls nothing else and asks no ``hasattr``:
``device_sampling`` says whether ``sample``/``greedy`` exist (the CUDA backend
picks ids on the device; the CPU returns logits and the host samples). Types
only: nothing here runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class KVCache(Protocol):
    """K and V of every layer for ``n_slots`` slots of ``n_ctx`` positions."""

    n_slots: int
    n_ctx: int

    def clear(self, slot: int, start: int, stop: int) -> None: ...
    def snapshot_slot(self, slot: int, n: int, device: bool = False) -> tuple[Any, Any]: ...
    def restore_slot(self, slot: int, k: Any, v: Any, n: int) -> None: ...


class Model(Protocol):
    """One model on one backend. ``forward(tokens (N,) int32, segments, kv, embeds=None)``
    returns (R, vocab) float32 host logits, R = the segments' logits rows in order;
    with ``device_sampling``, ``sample(tokens, segments, kv, rows, tick)`` and
    ``greedy(tokens, segments, kv)`` return (R,) int32 ids instead."""

    cfg: Any
    device_sampling: bool
    weight_bytes: int

    def kv_cache_bytes(self, n_slots: int, n_ctx: int) -> int: ...
    def new_kv_cache(self, n_slots: int, n_ctx: int) -> KVCache: ...
    def forward(self, tokens: np.ndarray, segments: list, kv: KVCache, embeds: Any = None) -> np.ndarray: ...
