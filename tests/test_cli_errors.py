"""A bad model file at the command line: exactly one line on stderr starting with
``aotx:``, naming the file and the problem, exit code 2, never a traceback.

Runs the real CLI in a subprocess (``python -m aotx.engine.cli.commands``) with ``AOTX_HOME``
in a temp dir; the broken files come from ``tests/models/llama.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T


def aotx(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("aotx: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.stdout == "", r.stdout
    return lines[0]


@pytest.fixture(scope="module")
def valid(tiny_gguf, tmp_path_factory):
    return tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny.gguf", alignment=32)


def broken(tiny_gguf, valid, tmp_path, how: str):
    p = tmp_path / f"{how}.gguf"
    if how == "not-gguf":
        p.write_bytes(b"this is a text file, not a model\n")
    elif how == "truncated":
        shutil.copy(valid, p)
        tiny_gguf.truncate(p, tiny_gguf.layout(p)["data_start"] + 100)
    elif how == "alignment-0":
        shutil.copy(valid, p)
        tiny_gguf.corrupt_alignment(p, 0)
    elif how == "version-99":
        shutil.copy(valid, p)
        tiny_gguf.corrupt_version(p, 99)
    elif how == "missing-tensor":
        tiny_gguf.write_tiny_llama(p, skip_tensors=["blk.1.attn_v.weight"])
    elif how == "unsupported-type":
        tiny_gguf.write_tiny_llama(p, d_model=256, ffn=256, tensor_types={"blk.0.attn_q.weight": T.IQ2_XXS})
    elif how == "mamba9":
        tiny_gguf.write_tiny_llama(p, arch="mamba9")
    return p


@pytest.mark.parametrize("how,needle", [("not-gguf", "not a GGUF file"), ("truncated", "past the end of the file"),
                                        ("missing-tensor", "'blk.1.attn_v.weight' is missing"),
                                        ("unsupported-type", "IQ2_XXS"),
                                        ("mamba9", "architecture 'mamba9' is not supported")])
def test_logits_bad_model(tiny_gguf, valid, tmp_path, how, needle):
    p = broken(tiny_gguf, valid, tmp_path, how)
    assert_one_line_error(aotx(tmp_path, "logits", "--model", str(p), "--ids", "1,2,3"), str(p), needle)


@pytest.mark.parametrize("how,needle", [("not-gguf", "not a GGUF file"), ("alignment-0", "general.alignment is 0"),
                                        ("version-99", "GGUF version 99")])
def test_tokenize_bad_model(tiny_gguf, valid, tmp_path, how, needle):
    p = broken(tiny_gguf, valid, tmp_path, how)
    assert_one_line_error(aotx(tmp_path, "tokenize", "--model", str(p), "x"), str(p), needle)


def test_missing_model_file(tmp_path):
    assert_one_line_error(aotx(tmp_path, "logits", "--model", str(tmp_path / "nope.gguf"), "hi"), "nope.gguf")


def test_valid_tiny_model_works(valid, tmp_path):
    """The same commands succeed on the valid file (the errors above are about the file)."""
    r = aotx(tmp_path, "tokenize", "--model", str(valid), "--special", "hello the<|im_end|>")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["272", "261", "2"]
    r = aotx(tmp_path, "logits", "--model", str(valid), "--top", "2", "--json", "--ids", "1,2,3")
    assert r.returncode == 0, r.stderr


def test_an_engine_refusal_that_lists_items_keeps_them(tmp_path):
    """Regression: `aotx run --memory-budget 10M hi` ended with a dangling colon: "...the
    budget is 10.0 MiB (10,485,760 bytes): (details in ...)"; the items the engine listed
    under its refusal now follow it on the one line."""
    from aotx.engine.ipc.client import _tail

    log = tmp_path / "engine.log"
    log.write_text("starting\naotx: the model does not fit: the budget is 10.0 MiB (10,485,760 bytes):\n"
                   "  weights 98.4 MiB\n  KV cache 96.0 MiB\n")
    assert _tail(log) == ("the model does not fit: the budget is 10.0 MiB (10,485,760 bytes): weights 98.4 MiB; "
                          "KV cache 96.0 MiB")
    log.write_text("aotx: plain refusal\n")
    assert _tail(log) == "plain refusal"
