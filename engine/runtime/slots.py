"""Slots: execution capacity on the device, leased by conversations with work.

A slot is a contiguous KV region (one row of every per-layer cache) plus its
row in the slot table. A conversation leases one while it has work and gives it
back after; the slot keeps the tokens its KV holds, so the same conversation's
next turn (or any prompt sharing a prefix) reuses them instead of prefilling
again. Leasing prefers the free slot holding the longest matching prefix, then
the least recently used one.

A hybrid model's slot (recurrent state beside its KV: ``whole_prefix``) can be reused
only where it has a state: at the end of its tokens, or at a checkpoint (the state copied
at the end of each prompt it prefilled, ``Slot.checkpoints``); elsewhere it is reused
from position 0 (the state restarts there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aotx.engine.state.prefix import common_prefix


@dataclass
class Slot:
    """One slot. ``tokens`` are the ids whose K/V the cache holds at positions 0..len-1.
    state: free | prefill | decode."""

    index: int
    tokens: list[int] = field(default_factory=list)
    conv_id: str | None = None
    state: str = "free"
    last_used: int = 0
    # a hybrid model's recurrent buffers at earlier positions of ``tokens`` ({n: buffers})
    checkpoints: dict[int, Any] = field(default_factory=dict)


class SlotTable:
    """The fixed set of ``n_slots`` slots."""

    def __init__(self, n_slots: int, whole_prefix: bool = False):
        self.slots = [Slot(i) for i in range(n_slots)]
        self.whole_prefix = whole_prefix
        self._clock = 0

    def reusable(self, slot: Slot, prompt: list[int]) -> int:
        """Positions of ``prompt`` that ``slot``'s state can keep (at most len(prompt) - 1)."""
        n = common_prefix(slot.tokens, prompt)
        cap = max(0, len(prompt) - 1)
        if self.whole_prefix and (n != len(slot.tokens) or n > cap):
            return max((p for p in slot.checkpoints if p <= min(n, cap)), default=0)
        return min(n, cap)

    def free_count(self) -> int:
        return sum(1 for s in self.slots if s.state == "free")

    def choose(self, conv_id: str, prompt: list[int], exclude: set[int] = frozenset()) -> tuple[Slot, int] | None:
        """The free slot to lease for ``prompt`` and its reusable prefix length, without
        leasing it; None when every slot is busy (or in ``exclude``: slot indices already
        planned for others this tick). Prefers the longest shared prefix, then the
        conversation's own slot, then the least recently used.

        The reusable prefix is capped at len(prompt) - 1 so the last prompt token always
        runs through the model (its logits give the first reply token)."""
        free = [s for s in self.slots if s.state == "free" and s.index not in exclude]
        if not free:
            return None
        best = max(free, key=lambda s: (self.reusable(s, prompt), s.conv_id == conv_id, -s.last_used))
        return best, self.reusable(best, prompt)

    def take(self, slot: Slot, conv_id: str, keep: int) -> None:
        """Lease ``slot`` to ``conv_id``, keeping its first ``keep`` KV positions."""
        del slot.tokens[keep:]
        for p in [p for p in slot.checkpoints if p > keep]:
            del slot.checkpoints[p]
        slot.conv_id = conv_id
        slot.state = "prefill"
        self._clock += 1
        slot.last_used = self._clock

    def release(self, slot: Slot) -> None:
        """Give the slot back; its KV tokens stay for prefix reuse."""
        slot.state = "free"
        self._clock += 1
        slot.last_used = self._clock

    def forget(self, conv_id: str) -> None:
        """Drop prefix-reuse knowledge of a conversation (deleted or truncated)."""
        for s in self.slots:
            if s.conv_id == conv_id and s.state == "free":
                s.tokens.clear()
                s.checkpoints.clear()
                s.conv_id = None
