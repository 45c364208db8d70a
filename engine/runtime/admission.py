"""Resource admission: does a configuration fit the device budget, and what is free.

Owns: the budget table (bytes per term: weights, KV cache, working buffers,
runtime tables, journal buffers, media) and the refusal message listing every
term against the budget. The engine asks ``check`` once at start and reports
the table in ``status``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aotx.engine.errors import AdmissionError
from aotx.engine.units import fmt_bytes, parse_size  # noqa: F401 (re-exported)


def machine_memory_bytes() -> int:
    """Physical RAM in bytes (sysconf), or 8 GiB when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_cpu_budget() -> int:
    """Default RAM budget on the CPU: half the machine's memory."""
    return machine_memory_bytes() // 2


def default_cuda_budget(device: int = 0) -> int:
    """Default budget on CUDA: the GPU's total memory less 1 GiB for the CUDA context,
    CuPy's pools and cuBLAS workspaces (bytes)."""
    import cupy  # only reached with --device cuda

    _free, total = cupy.cuda.Device(device).mem_info
    return max(1 << 30, int(total) - (1 << 30))


@dataclass(frozen=True)
class Budget:
    """The accounted terms (bytes) against ``total`` bytes of budget."""

    total: int
    terms: tuple[tuple[str, int], ...]

    @property
    def used(self) -> int:
        return sum(v for _, v in self.terms)

    @property
    def free(self) -> int:
        return self.total - self.used

    def table(self) -> str:
        lines = [f"  {name:<16} {fmt_bytes(v):>10}  ({v:,} bytes)" for name, v in self.terms]
        lines.append(f"  {'total':<16} {fmt_bytes(self.used):>10}  ({self.used:,} bytes)")
        lines.append(f"  {'budget':<16} {fmt_bytes(self.total):>10}  ({self.total:,} bytes)")
        return "\n".join(lines)


def working_bytes(cfg, prefill_chunk: int, n_slots: int, n_ctx: int) -> int:
    """Working buffers of one tick: activations of a prefill chunk plus decode rows
    (x, h, q, k, v, attention out, gate, up: float32), one chunk's attention scores
    (heads x chunk x context float32) and the logits rows (vocab float32 each)."""
    rows = prefill_chunk + n_slots
    act = rows * (3 * cfg.d_model + 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.ffn_dim) * 4
    scores = cfg.n_heads * prefill_chunk * n_ctx * 4
    logits = (n_slots + 1) * cfg.vocab_size * 4
    return act + scores + logits


def plan(cfg, weight_bytes: int, kv_bytes: int, n_slots: int, n_ctx: int, prefill_chunk: int,
         journal_bytes: int, total: int, media_bytes: int = 0, capsule_bytes: int = 0,
         capsule_device_bytes: int = 0, prefill_weight_bytes: int = 0,
         draft_terms: tuple[tuple[str, int], ...] = ()) -> Budget:
    """The budget of a configuration (bytes; on CUDA ``total`` is GPU memory and the
    capsule share is their device home). ``draft_terms``: a draft model's (name, bytes)
    terms (``DraftModel.budget_terms``: its weights, its KV for every slot, its working
    buffers). Raises AdmissionError with every term when it does not fit."""
    tables = n_slots * (n_ctx * 8 + 256)  # slot token lists and table rows
    terms = (("weights", weight_bytes), ("prefill weights", prefill_weight_bytes), ("kv cache", kv_bytes),
             ("working buffers", working_bytes(cfg, prefill_chunk, n_slots, n_ctx)),
             ("runtime tables", tables), ("journal buffers", journal_bytes),
             ("capsules (host)", capsule_bytes), ("capsules (device)", capsule_device_bytes), ("media", media_bytes))
    optional = {"prefill weights", "capsules (device)", "capsules (host)"}  # shown where the backend has them
    b = Budget(total, tuple((n, v) for n, v in terms if v or n not in optional) + tuple(draft_terms))
    if b.used > b.total:
        raise AdmissionError(f"the configuration does not fit: {n_slots} slots x {n_ctx} tokens of context "
                             f"needs {fmt_bytes(b.used)} ({b.used:,} bytes), the budget is {fmt_bytes(total)} "
                             f"({total:,} bytes):\n{b.table()}\nlower --slots or --context, or raise --memory-budget")
    return b
