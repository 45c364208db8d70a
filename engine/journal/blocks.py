"""A block: the unit the journal's producers hand to its drain thread.

Owns: ``Block``, the records of one flush (a range of the publication ring) or a
side block of checkpoint parts (its frames), with what the drain must do around
it. Leaves to others: making blocks (``writer.py``, ``checkpoint_stream.py``) and
writing them (``writer.py``'s drain, ``appender.py``).
"""

from __future__ import annotations

from typing import NamedTuple


class Block(NamedTuple):
    start: int  # absolute ring offset (bytes published before it); side blocks: 0
    end: int
    first_seq: int
    last_seq: int
    checkpoint: bool  # opens a checkpoint segment (rotate, flag it)
    frames: tuple = ()  # a side block: its frames, written instead of ring bytes
    ends_checkpoint: bool = False  # once durable, the segments before the checkpoint's go
    aborts_checkpoint: bool = False  # an empty block: the open checkpoint will not end

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames) if self.frames else self.end - self.start
