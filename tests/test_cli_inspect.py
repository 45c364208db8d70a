"""``aotx logits``: each position shows its token's text beside its id, in text and JSON,
on the default model."""

from __future__ import annotations

import json

import pytest

from tests import cli_support

pytestmark = pytest.mark.realmodel


def test_logits_show_each_tokens_text_beside_its_id(tmp_path, default_model_path):
    """Regression: `aotx logits` printed ids only."""
    r = cli_support.aotx(tmp_path, "logits", "--top", "3", "The capital of France is", timeout=120)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert "' is' -> 7042 ' Paris':" in last, last
    r = cli_support.aotx(tmp_path, "logits", "--top", "3", "--json", "The capital of France is", timeout=120)
    row = json.loads(r.stdout)["positions"][-1]
    assert row["input_text"] == " is" and row["top_texts"][0] == " Paris" and row["top"][0][0] == 7042
