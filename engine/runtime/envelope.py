"""The resource envelope: what one tick may use. Nothing the scheduler plans runs outside it.

Owns: ``Envelope`` (slots, context tokens per slot, working memory in tokens and
bytes, publication capacity) and ``working_bytes``, the size of one tick's working
buffers that admission counts at start. Built once when the engine starts, from
the flags that admission accepted; the scheduler plans inside it, admission
checks requests against it. Leaves the accounting of the whole budget to
``admission.py`` and the choice of rows to ``scheduler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aotx.engine.model.config import ModelConfig


def working_bytes(cfg: ModelConfig, prefill_chunk: int, n_slots: int, n_ctx: int) -> int:
    """Working buffers of one tick: activations of a prefill chunk plus decode rows
    (x, h, q, k, v, attention out, gate, up: float32), one chunk's attention scores
    (heads x chunk x context float32) and the logits rows (vocab float32 each)."""
    rows = prefill_chunk + n_slots
    act = rows * (3 * cfg.d_model + 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.ffn_dim) * 4
    scores = cfg.n_heads * prefill_chunk * n_ctx * 4
    logits = (n_slots + 1) * cfg.vocab_size * 4
    return act + scores + logits


@dataclass(frozen=True)
class Envelope:
    """One tick's envelope.

    slots: requests that hold a slot (a KV region) at once; context_tokens: KV
    positions of one slot (prompt + reply); prefill_tokens: prompt tokens one tick
    prefills across all requests (the working buffers are sized for them plus one
    decode row per slot); working_bytes: those buffers; publication_bytes: the
    journal's publication buffer (records published and not yet durable; 0 without
    a journal), from which every request reserves credit before it publishes."""

    slots: int
    context_tokens: int
    prefill_tokens: int
    working_bytes: int
    publication_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, n_slots: int, n_ctx: int, prefill_chunk: int, publication_bytes: int) -> Envelope:
        return cls(n_slots, n_ctx, prefill_chunk, working_bytes(cfg, prefill_chunk, n_slots, n_ctx),
                   publication_bytes)
