"""The model interface the runtime calls, as types.

Every loaded model (``loader.LoadedModel.model``) has this shape, whatever its
architecture or backend; the runtime calls nothing else. ``device_path`` says which
path its tokens take:

* ``HOST`` ("host"): ``forward`` returns logits and the runtime samples on the host
  (the CPU backend);
* ``DEVICE_SAMPLING`` ("device-sampling"): the model is also a ``DeviceSamplingModel``:
  ``sample`` / ``greedy`` pick ids on the device (the CUDA backend), for the rows whose
  sampler ``samples_exactly`` accepts; a constrained row's token bitmasks go to the device
  through ``load_masks``. The runtime asks the model, never a backend module.

The KV cache is the backend's (``aotx.engine.backend.KVCache``). Types only: nothing here
runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from aotx.engine.backend import KVCache

HOST = "host"
DEVICE_SAMPLING = "device-sampling"
DEVICE_PATHS = (HOST, DEVICE_SAMPLING)

__all__ = ["DEVICE_PATHS", "DEVICE_SAMPLING", "HOST", "DeviceSamplingModel", "KVCache", "Model"]


class Model(Protocol):
    """One model on one backend. ``forward(tokens (N,) int32, segments, kv, embeds=None)``
    returns (R, vocab) float32 host logits, R = the segments' logits rows in order.
    ``numerics``: the arithmetic behind its logits ("cpu-int8", "cuda-f32", ...), named in
    every reply and capsule."""

    cfg: Any
    device_path: str
    numerics: str

    @property
    def weight_bytes(self) -> int: ...

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int: ...
    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> KVCache: ...
    def forward(self, tokens: np.ndarray, segments: list, kv: KVCache, embeds: Any = None) -> np.ndarray: ...


class DeviceSamplingModel(Model, Protocol):
    """A model whose ``device_path`` is ``DEVICE_SAMPLING``. ``rows``: one ``(SamplerConfig,
    SamplerState, extra_history)`` per logits row, each accepted by ``samples_exactly``
    (None: greedy everywhere); the states are not advanced (the runtime mirrors the draws)."""

    def sample(self, tokens: np.ndarray, segments: list, kv: KVCache, rows: list | None,
               tick: int = 0) -> np.ndarray:
        """(R,) int32 ids picked on the device."""
        ...

    def greedy(self, tokens: np.ndarray, segments: list, kv: KVCache) -> np.ndarray:
        """(R,) int32 argmax ids."""
        ...

    def last_logits(self) -> Any: ...

    def samples_exactly(self, cfg: Any, state: Any, n_drafts: int = 0) -> bool:
        """Whether the device chain picks exactly what the host's sampler would for this row."""
        ...

    def load_masks(self, masks: np.ndarray) -> list[int]:
        """The device address of each row of a tick's (n, words) int32 token bitmasks."""
        ...
