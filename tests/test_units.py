"""``engine/units.py``: a conversation's short title cuts at a word and drops the
punctuation left at the cut."""

from __future__ import annotations

import pytest

from aotx.engine.units import short_title


@pytest.mark.parametrize("text,want", [
    # the cut fell after "string," : the word cut off and the comma both go
    ("Write a Python function that reverses a very long string, test it",
     "Write a Python function that reverses a very long string"),
    ("Write a Python function that reverses a string, and then test it well",
     "Write a Python function that reverses a string, and then"),
    ("Write a Python function that reverses a long string, ok? please",
     "Write a Python function that reverses a long string, ok?"),
    ("  many   spaces\n here ", "many spaces here"),
    ("x" * 70, "x" * 60),                      # one long word: cut inside it
])
def test_short_title_cuts_at_a_word_and_drops_trailing_punctuation(text, want):
    got = short_title(text)
    assert got == want and len(got) <= 60 and not got.endswith((",", " "))
