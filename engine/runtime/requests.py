"""A request in flight: one submitted message and the reply being generated.

Owns the per-request state the tick loop advances: prompt, slot lease,
positions, sampler state, stop checking, streaming detokenization, timings and
the sequence numbers still waiting for a durable receipt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aotx.engine.runtime.sampling import SamplerConfig, SamplerState


@dataclass(eq=False)
class Request:
    """State: durable_wait -> queued -> prefill -> decode -> done."""

    rid: int
    sink: Any
    conv_id: str
    msg_id: str
    reply_id: str
    prompt: list[int]
    sampler: SamplerConfig
    sampler_state: SamplerState
    max_tokens: int
    stop: Any  # termination.StopChecker
    decoder: Any  # tokenizer.StreamDecoder
    state: str = "durable_wait"
    slot: Any = None
    pos: int = 0  # tokens of prompt + completion whose K/V are in the slot
    completion: list[int] = field(default_factory=list)
    text: str = ""
    cancelled: bool = False
    finish_reason: str | None = None
    accepted_seq: int = 0
    final_seq: int = 0
    queued_position: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    n_reused: int = 0
    drafter: Any = None  # speculative.PromptLookup or None
    n_drafted: int = 0
    n_draft_accepted: int = 0

    @property
    def next_input(self) -> int:
        """The token to feed in decode: the last sampled one."""
        return self.completion[-1]

    def timings(self) -> dict[str, float]:
        prefill_s = max(1e-9, (self.t_first or self.t_end) - (self.t_start or self.t_submit))
        decode_s = max(1e-9, self.t_end - self.t_first) if self.t_first else 0.0
        n_pref = max(0, len(self.prompt) - self.n_reused)
        n_dec = max(0, len(self.completion) - 1)
        return {
            "prompt_tokens": float(len(self.prompt)),
            "prompt_tokens_reused": float(self.n_reused),
            "prompt_tokens_per_s": round(n_pref / prefill_s, 2),
            "ttft_s": round((self.t_first or self.t_end) - self.t_submit, 4),
            "completion_tokens": float(len(self.completion)),
            "decode_tokens_per_s": round(n_dec / decode_s, 2) if decode_s else 0.0,
            "queue_s": round((self.t_start or self.t_end) - self.t_submit, 4),
            "draft_tokens": float(self.n_drafted),
            "draft_accepted": float(self.n_draft_accepted),
        }
