"""The CLI's words for people: no JSON blob from ``aotx journal compact``, no raw
``degraded=  checkpointing=False`` ending ``aotx status``, and ``aotx tokenize`` says whose
tokenizer made the ids (ids mean nothing without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_compact_says_what_it_did_in_a_sentence():
    from aotx.engine.cli.local import compact_summary

    rep = {"segment": 7, "covers_seq": 912, "conversations": 3, "dropped": 2, "removed": [1, 2, 3, 4],
           "bytes_before": 5 << 20, "bytes_after": 1 << 20, "recovery": "...", "parts": 3, "end_seq": 916}
    s = compact_summary(rep)
    assert s == ("compacted the journal into one checkpoint of 3 live conversations (segment 7, up to seq 912): "
                 "5.0 MiB -> 1.0 MiB (4.0 MiB freed), 4 old segments removed; the text of 2 deleted conversations "
                 "left the disk")
    assert "{" not in s
    assert compact_summary({"segment": None, "conversations": 1, "bytes_before": 2048}).startswith(
        "nothing to compact: 1 live conversation")


def test_the_status_journal_line_is_words():
    from aotx.engine.cli.status import journal_line

    j = {"fsyncs": 1234, "blocks": 9, "receipts": 9, "bytes_written": 4096, "segments_created": 1,
         "capacity": 8 << 20, "used": 0, "reserved": 0, "free": 8 << 20, "last_seq": 41, "durable_seq": 41,
         "segment": 1, "segment_bytes": 4096, "pending_blocks": 0, "failed": None, "degraded": "",
         "checkpointing": False, "enabled": True}
    line = journal_line(j)
    assert line == "segment 1 (4.0 KiB), durable up to seq 41 of 41, buffer 0 B of 8.0 MiB in use, 1,234 fsyncs"
    assert "=" not in line and "False" not in line
    assert "DEGRADED: disk full" in journal_line({**j, "degraded": "disk full"})


@pytest.mark.realmodel
def test_tokenize_names_its_tokenizer(tmp_path, default_model_path):
    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "tokenize", "Hello world"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() and all(t.isdigit() for t in r.stdout.split())
    assert r.stderr.startswith(f"aotx: 2 tokens with {default_model_path.stem}'s tokenizer (gpt2, 49,152 tokens)")
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "tokenize", "--json", "Hi"], env=env,
                       capture_output=True, text=True, timeout=120)
    d = json.loads(r.stdout)
    assert d["model"] == default_model_path.stem and d["vocab_size"] == 49152 and d["tokenizer"] == "gpt2"
