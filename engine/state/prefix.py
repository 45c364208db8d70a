"""Prefix reuse: how many leading token ids two id lists share.

The KV of a slot, a capsule or a draft model's slot holds the ids at positions
0..n-1; a new prompt reuses the longest prefix it shares with one of them. Used by
the runtime's slot table and drafter and by the capsule cache.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
