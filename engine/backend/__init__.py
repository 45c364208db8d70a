"""The backend contract: what a model asks of a backend, as types (IR.md section 6 in prose).

Owns the Protocols every backend meets (``cpu.backend.CpuBackend`` /
``cpu.program.CpuProgram``, ``cuda.backend.CudaBackend`` / ``cuda.program.CudaProgram``):

* ``Backend``: turns GGUF tensors into weights of its own (``matrix``, ``vector``,
  ``experts``, ``expert_vectors``) and compiles a traced ``ops.Program`` once, at load
  (``compile``), into a ``CompiledProgram``.
* ``CompiledProgram``: runs a forward over a ``Layout`` of rows into its ``KVCache``
  (``new_kv_cache``, ``kv_cache_bytes``, ``forward``); ``device_sampling`` says whether it
  is also a ``DeviceSampler``.
* ``DeviceSampler``: a program that picks each row's id on the device (CUDA): ``sample``,
  ``greedy``, ``last_logits``, and the two questions a runtime asks before choosing that
  path: ``samples_exactly`` (does the device chain compute exactly what the host's
  sampler would for this row?) and ``load_masks`` (the device addresses of a tick's token
  bitmasks).
* ``ExpertTiers``: a program with mixture-of-experts layers (``measure_experts``,
  ``place_experts``, ``expert_stats``; the CUDA program adds ``attach_expert_cache`` and
  ``moe_device_layers``, which engine/model/experts.py asks for by name).
* ``KVCache``, ``Layout``, ``WeightMatrix``: what those calls take and give.

Rooms beside this file: ``ops.py`` (the op set and the Program: the one description of an
architecture every backend runs), ``quants.py`` (GGUF block layouts), ``kernel_choice.py``
(the kernel-choice artifact), ``device.py``, ``cpu/`` and ``cuda/`` (the two backends,
which meet only through ``cpu.experts``). Leaves to engine/model the model interface the
runtime calls (``model/interface.py``), built on these. Types only: nothing here runs, and
importing it loads no backend (no numba, no CuPy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from aotx.engine.backend.ops import Program

KV_TYPES = ("f16", "f32")   # a KV cache's element type (``new_kv_cache(..., kv_type)``)


class Layout(Protocol):
    """One forward's rows (``engine/model/batch.BatchLayout``; backends read it by these
    attributes and never import engine/model): ``n_rows`` N, ``positions`` (N,) int32,
    ``slots`` (N,) int32, ``out_rows`` (R,) int64 (the logits rows, in order),
    ``segments`` and ``row0`` (each segment's first row)."""

    n_rows: int
    positions: np.ndarray
    slots: np.ndarray
    out_rows: np.ndarray
    segments: tuple[Any, ...]
    row0: Any


class WeightMatrix(Protocol):
    """A weight of shape (m, k) in the backend's own form (``Backend.matrix``)."""

    m: int
    k: int
    name: str
    qtype: Any


class RecurrentState(Protocol):
    """A hybrid program's recurrent buffers of every slot (IR.md section 9; CPU:
    ``cpu.recurrent.RecurrentState``), ``KVCache.state``. Each slot's state stands at one
    position: ``position(slot)``; ``snapshot(slot, n)`` (n must be that position) and
    ``restore(slot, buffers, n)``, byte-exact, by ``names``; ``rollback(slot, n)`` back into
    the slot's last segment of 2..16 rows (a verify window's rejected drafts)."""

    names: tuple[str, ...]

    def position(self, slot: int) -> int: ...
    def snapshot(self, slot: int, n: int) -> dict[str, np.ndarray]: ...
    def restore(self, slot: int, buffers: dict[str, np.ndarray], n: int) -> None: ...
    def rollback(self, slot: int, n: int) -> None: ...


@runtime_checkable
class KVCache(Protocol):
    """K and V of every layer for ``n_slots`` slots of ``n_ctx`` positions (IR.md section 5).
    A program with recurrent layers gives its cache a ``state`` (``RecurrentState``; None
    or absent otherwise)."""

    kv_type: str
    n_slots: int
    n_ctx: int

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """One slot's layout: (n_layers, n_kv_heads, n_ctx, head_dim)."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """What ``snapshot_slot`` returns: float16 for an f16 cache, float32 for f32."""
        ...

    def clear(self, slot: int, start: int, stop: int) -> None:
        """Zero positions [start, stop) of ``slot`` in every layer."""
        ...

    def snapshot_slot(self, slot: int, n: int, device: bool = False) -> tuple[Any, Any]:
        """Copies of positions [0, n) of ``slot``: (n_layers, n_kv_heads, n, head_dim) each
        (numpy; CUDA's ``device=True`` keeps device arrays)."""
        ...

    def restore_slot(self, slot: int, k: Any, v: Any, n: int) -> None:
        """The byte-exact inverse of ``snapshot_slot`` (the same dtype)."""
        ...


@runtime_checkable
class CompiledProgram(Protocol):
    """A Program compiled by a backend, once, at load. ``forward(tokens (N,) int32, layout,
    kv, embeds=None)`` writes every row's K/V into its slot and returns (R, vocab) float32
    host logits (R = 0: an empty array); ``embeds``: None or ``(rows (k,) int64, values (k,
    d_model) float32)``, rows that take those values instead of their token's embedding.
    A program with ``input`` ops takes their rows as ``inputs`` (a dict by name), and one
    that marks a hidden value keeps it after each forward (``last_hidden``, IR.md section 9)."""

    device_sampling: bool

    @property
    def prefill_weight_bytes(self) -> int:
        """Bytes of extra weight copies kept for prefill (CUDA's dense copies; 0 on the CPU)."""
        ...

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> KVCache: ...
    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int: ...
    def forward(self, tokens: np.ndarray, layout: Layout, kv: KVCache, embeds: Any = None) -> np.ndarray: ...


@runtime_checkable
class DeviceSampler(CompiledProgram, Protocol):
    """A program that picks ids on the device (``device_sampling`` True). ``rows``: one
    ``(SamplerConfig, SamplerState, extra_history)`` per logits row (the runtime's objects,
    read by attribute), each one ``samples_exactly`` accepted; the states are not advanced
    (the runtime mirrors the draws)."""

    def sample(self, tokens: np.ndarray, layout: Layout, kv: KVCache, rows: list | None,
               tick: int = 0) -> np.ndarray:
        """(R,) int32 ids, each row's sampler chain run on the device."""
        ...

    def greedy(self, tokens: np.ndarray, layout: Layout, kv: KVCache) -> np.ndarray:
        """(R,) int32 argmax ids."""
        ...

    def last_logits(self) -> Any:
        """The device (R, vocab) float32 logits of the last call."""
        ...

    def samples_exactly(self, cfg: Any, state: Any, n_drafts: int = 0) -> bool:
        """Whether the device chain picks exactly what the host's sampler would for a row
        with sampler ``cfg`` and state ``state`` (a verify window of ``n_drafts`` drafts)."""
        ...

    def load_masks(self, masks: np.ndarray) -> list[int]:
        """Copy a tick's token bitmasks ((n, ceil(vocab / 32)) int32) to the device; each
        row's device address, for its sampler row's ``mask_ptr``."""
        ...


@runtime_checkable
class ExpertTiers(Protocol):
    """A program with mixture-of-experts layers: the expert tiers' calibration and placement
    (engine/model/experts.py)."""

    def measure_experts(self, layer: int, rows: tuple[int, ...]) -> dict: ...
    def place_experts(self, plan: Any) -> dict: ...
    def expert_stats(self) -> dict: ...


@runtime_checkable
class Backend(Protocol):
    """An op set on one device. ``name``: "cpu" | "cuda"; ``numerics``: the arithmetic its
    programs run ("cpu-int8", "cpu-f32", "cuda-int8", "cuda-f32"), named in every reply and
    capsule; ``supported_types``: the GGUF tensor types ``matrix`` takes; ``weight_bytes``:
    bytes of every weight loaded so far."""

    name: str
    numerics: str
    supported_types: frozenset
    weight_bytes: int

    def matrix(self, t: Any) -> WeightMatrix:
        """A 2-D GGUF tensor (ggml shape ``[k, m]``) as an (m, k) weight."""
        ...

    def vector(self, t: Any) -> Any:
        """A 1-D tensor as an (n,) float32 array of the backend (numpy / CuPy)."""
        ...

    def experts(self, t: Any) -> Any:
        """A 3-D GGUF expert tensor (ggml ``[k, m, E]``) as E (m, k) matrices."""
        ...

    def expert_vectors(self, t: Any) -> np.ndarray:
        """One bias per expert (ggml ``[n, E]``) as float32 (E, n)."""
        ...

    def compile(self, program: Program) -> CompiledProgram:
        """The executor of a traced program (once, at load)."""
        ...
