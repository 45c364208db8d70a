"""The batch layout every forward pass takes: segments of consecutive tokens per slot.

Owns: ``Segment`` (what the runtime schedules into a tick and the drafter into its own
slots) and ``BatchLayout`` (the per-row arrays both backends derive from a list of
segments: position, slot, which rows want logits). The runtime builds segments; the
model's backends read layouts; nothing here knows about requests or sampling.

Batch invariance (DESIGN.md): a row's logits depend only on its token, its
position and the KV it attends to, never on how the rows were grouped into segments or
batches. The layout carries no information a kernel could use to treat a row
differently because of its neighbours, except which rows need logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Segments of at most this many tokens are "short" (decode steps, speculative verify
# windows). The drafter sizes its catch-up chunks with it.
SMALL_SEGMENT = 16


@dataclass(frozen=True)
class Segment:
    """A run of ``n`` consecutive tokens of one slot starting at position ``pos``.

    A batch is a list of segments; their tokens are concatenated in order. With
    ``all_logits`` every row's logits are returned, otherwise only the last row's,
    and none when ``logits`` is false (a prefill chunk that does not end the prompt)."""

    slot: int
    pos: int
    n: int
    all_logits: bool = False
    logits: bool = True


@dataclass(frozen=True)
class BatchLayout:
    """Per-row facts of one batch, in row order (rows = the segments' tokens concatenated).

    positions, slots: (N,) int32; out_rows: (R,) int64, the rows whose logits are
    returned, in order; segments: the segments themselves (attention over a slot's KV
    reads ``slot``, ``pos`` and ``n``); row0: (S,) int64 first row of each segment."""

    n_rows: int
    positions: np.ndarray
    slots: np.ndarray
    out_rows: np.ndarray
    segments: tuple[Segment, ...]
    row0: np.ndarray

    @classmethod
    def of(cls, segments: list[Segment] | tuple[Segment, ...]) -> "BatchLayout":
        n = sum(s.n for s in segments)
        positions = np.empty(n, np.int32)
        slots = np.empty(n, np.int32)
        row0 = np.empty(len(segments), np.int64)
        out: list[int] = []
        row = 0
        for i, s in enumerate(segments):
            row0[i] = row
            positions[row:row + s.n] = np.arange(s.pos, s.pos + s.n, dtype=np.int32)
            slots[row:row + s.n] = s.slot
            if s.all_logits:
                out.extend(range(row, row + s.n))
            elif s.logits:
                out.append(row + s.n - 1)
            row += s.n
        return cls(n, positions, slots, np.asarray(out, np.int64), tuple(segments), row0)
