"""Broken GGUF files: every kind of damage is a ModelError naming the file
and the problem, never another exception (and never a crash inside numpy, mmap or a
numba kernel). Files come from ``tests/models/llama.py``; the CLI side of the same
errors is in ``test_cli_errors.py``.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotx.engine.errors import AotxError, ModelError
from aotx.engine.model.gguf_file import GGUFFile
from aotx.engine.model.loader import load_model


@pytest.fixture(scope="module")
def valid(tiny_gguf, tmp_path_factory):
    """A valid tiny Q8_0 llama with an explicit general.alignment (so it can be patched)."""
    return tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("valid") / "tiny.gguf", alignment=32)


@pytest.fixture()
def copy(valid, tmp_path):
    """A fresh copy of ``valid`` to break."""
    p = tmp_path / "broken.gguf"
    shutil.copy(valid, p)
    return p


def expect_model_error(path, *patterns: str, load: bool = True) -> str:
    """Assert GGUFFile.open (or load_model when ``load``) raises ModelError whose one-line
    message names ``path`` and matches every regex in ``patterns``; return the message."""
    with pytest.raises(ModelError) as ei:
        if load:
            load_model(path)
        else:
            GGUFFile.open(path)
    msg = str(ei.value)
    assert str(path) in msg, msg
    assert "\n" not in msg, msg
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in {msg!r}"
    return msg


def test_valid_file_opens_and_loads(valid):
    gf = GGUFFile.open(valid)
    assert gf.architecture == "llama" and gf.version == 3 and gf.alignment == 32
    assert gf.tensors["blk.0.attn_q.weight"].qtype == T.Q8_0
    lm = load_model(valid)
    assert lm.config.n_layers == 2 and lm.tokenizer.vocab_size == lm.config.vocab_size == 300
    # the builder's tokenizer and ChatML template are real: specials parse, merges apply
    text = lm.template.render([{"role": "user", "content": "hello the"}])
    assert text == "<|im_start|>user\nhello the<|im_end|>\n<|im_start|>assistant\n"
    ids = lm.tokenizer.encode(text, add_special=True, parse_special=True)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1 and 272 in ids and 261 in ids
    assert 2 in lm.eog_ids


# ------------------------------------------------------------------ not GGUF

@pytest.mark.parametrize("content", [os.urandom(4096), b"", b"hello, I am a text file\n", b"GGU"],
                         ids=["random-bytes", "empty", "text", "three-bytes-of-magic"])
def test_not_gguf(tmp_path, content):
    p = tmp_path / "model.gguf"
    p.write_bytes(content)
    expect_model_error(p, r"not a GGUF file")


def test_missing_file_and_directory(tmp_path):
    expect_model_error(tmp_path / "nope.gguf", r"no such model file", load=False)
    expect_model_error(tmp_path, r"directory", load=False)


# ------------------------------------------------------------------ truncated

@pytest.mark.parametrize("where", ["header-10", "header-20", "header-30", "metadata-start", "metadata-middle",
                                   "tensor-infos", "before-data", "data-start", "data-middle", "last-byte"])
def test_truncated(tiny_gguf, copy, where):
    lay = tiny_gguf.layout(copy)
    cut = {"header-10": 10, "header-20": 20, "header-30": 30, "metadata-start": 60,
           "metadata-middle": lay["kv_end"] // 2, "tensor-infos": lay["kv_end"] + 40,
           "before-data": lay["data_start"] - 3, "data-start": lay["data_start"],
           "data-middle": (lay["data_start"] + lay["size"]) // 2, "last-byte": lay["size"] - 1}[where]
    tiny_gguf.truncate(copy, cut)
    expect_model_error(copy, r"truncated|past the end")


def test_truncated_data_names_the_tensor(tiny_gguf, copy):
    lay = tiny_gguf.layout(copy)
    last = max(lay["tensors"], key=lambda n: lay["tensors"][n]["data"])
    tiny_gguf.truncate(copy, lay["size"] - 1)
    expect_model_error(copy, re.escape(repr(last)), r"past the end of the file", load=False)


# ------------------------------------------------------------------ header fields

def test_tensor_past_end_of_file(tiny_gguf, copy):
    tiny_gguf.corrupt_tensor_offset(copy, "blk.1.ffn_down.weight", extra=1 << 20)
    expect_model_error(copy, r"'blk\.1\.ffn_down\.weight'", r"past the end of the file", load=False)


def test_misaligned_tensor_offset(tiny_gguf, copy):
    tiny_gguf.corrupt_tensor_offset(copy, "token_embd.weight", extra=4)
    expect_model_error(copy, r"'token_embd\.weight'", r"not a multiple of general\.alignment 32", load=False)


def test_huge_dimension_is_past_end_of_file(tiny_gguf, copy):
    tiny_gguf.corrupt_dim(copy, "blk.0.attn_q.weight", 1, 1 << 40)
    expect_model_error(copy, r"'blk\.0\.attn_q\.weight'", r"past the end of the file", load=False)


@pytest.mark.parametrize("value", [0, 3, 48])
def test_bad_alignment(tiny_gguf, copy, value):
    tiny_gguf.corrupt_alignment(copy, value)
    expect_model_error(copy, rf"general\.alignment is {value}", r"power of two", load=False)


@pytest.mark.parametrize("name,axis", [("blk.0.attn_q.weight", 0), ("blk.0.attn_q.weight", 1),
                                       ("output_norm.weight", 0)])
def test_zero_dimension(tiny_gguf, copy, name, axis):
    tiny_gguf.corrupt_dim(copy, name, axis, 0)
    expect_model_error(copy, re.escape(repr(name)), r"zero dimension", load=False)


@pytest.mark.parametrize("version", [99, 1, 0])
def test_unsupported_version(tiny_gguf, copy, version):
    tiny_gguf.corrupt_version(copy, version)
    expect_model_error(copy, rf"GGUF version {version} is not supported", load=False)


def test_unknown_tensor_type_id(tiny_gguf, copy):
    tiny_gguf.corrupt_tensor_type(copy, "blk.0.attn_q.weight", 200)
    expect_model_error(copy, r"'blk\.0\.attn_q\.weight'", r"unknown tensor type id 200", load=False)


def test_block_size_does_not_divide_row(tiny_gguf, copy):
    # Q4_K blocks hold 256 elements; the rows of this file have 64.
    tiny_gguf.corrupt_tensor_type(copy, "blk.0.attn_q.weight", int(T.Q4_K))
    expect_model_error(copy, r"'blk\.0\.attn_q\.weight'", r"Q4_K", r"block size 256", load=False)


# ------------------------------------------------------------------ model-level defects

@pytest.mark.parametrize("how", ["writer-arch", "metadata-only"])
def test_unsupported_architecture(tiny_gguf, tmp_path, how):
    # "metadata-only" keeps llama.* keys: the message must still be about the
    # architecture, not about a missing 'mamba9.*' key.
    p = tmp_path / "m.gguf"
    if how == "writer-arch":
        tiny_gguf.write_tiny_llama(p, arch="mamba9")
    else:
        tiny_gguf.write_tiny_llama(p, metadata={"general.architecture": "mamba9"})
    expect_model_error(p, r"architecture 'mamba9' is not supported", r"llama")


@pytest.mark.parametrize("qtype,tensor", [(T.IQ2_XXS, "blk.0.ffn_up.weight"), (T.I8, "blk.1.attn_k.weight"),
                                          (T.I8, "blk.0.attn_norm.weight"), (T.TQ2_0, "token_embd.weight")],
                         ids=["IQ2_XXS-matrix", "I8-matrix", "I8-norm", "TQ2_0-embedding"])
def test_unsupported_tensor_type(tiny_gguf, tmp_path, qtype, tensor):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", d_model=256, ffn=256, tensor_types={tensor: qtype})
    assert GGUFFile.open(p).tensors[tensor].qtype == qtype  # the container itself is fine
    expect_model_error(p, re.escape(repr(tensor)), qtype.name, r"not supported|does not support")


@pytest.mark.parametrize("tensor", ["token_embd.weight", "blk.1.ffn_down.weight", "output_norm.weight",
                                    "blk.0.attn_norm.weight"])
def test_missing_tensor(tiny_gguf, tmp_path, tensor):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", skip_tensors=[tensor])
    expect_model_error(p, re.escape(repr(tensor)), r"is missing")


@pytest.mark.parametrize("tensor,shape", [("blk.0.attn_k.weight", (64, 64)), ("blk.1.ffn_gate.weight", (96, 64)),
                                          ("blk.0.attn_norm.weight", (32,)), ("output_norm.weight", (2, 64)),
                                          ("token_embd.weight", (299, 64))])
def test_misshaped_tensor(tiny_gguf, tmp_path, tensor, shape):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", shapes={tensor: shape})
    expect_model_error(p, re.escape(repr(tensor)), r"has shape .* expected")


def test_untied_output_is_checked(tiny_gguf, tmp_path):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", tied=False, shapes={"output.weight": (200, 64)})
    expect_model_error(p, r"'output\.weight'", r"has shape")


@pytest.mark.parametrize("meta,pattern", [
    ({"llama.attention.head_count": 0}, r"head_count is 0"),
    ({"llama.attention.head_count_kv": 3}, r"not a multiple of head_count_kv 3"),
    ({"llama.embedding_length": None}, r"'llama\.embedding_length' is missing"),
    # bug guard: a rope dimension above the head dimension wrote past the RoPE
    # tables inside the numba kernel (heap corruption, "double free" abort)
    ({"llama.rope.dimension_count": 64}, r"rope\.dimension_count is 64"),
    ({"llama.rope.dimension_count": 0}, r"rope\.dimension_count is 0"),
    ({"llama.context_length": 0}, r"context_length is 0"),
    ({"llama.rope.freq_base": -1.0}, r"freq_base"),
    ({"llama.vocab_size": 500}, r"'token_embd\.weight' has shape"),
], ids=["heads-0", "kv-heads-3", "no-d-model", "rope-dim-64", "rope-dim-0", "ctx-0", "rope-base", "vocab"])
def test_bad_hyperparameters(tiny_gguf, tmp_path, meta, pattern):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", metadata=meta)
    expect_model_error(p, pattern)


# ------------------------------------------------------------------ fuzz

@pytest.fixture(scope="module")
def fuzz_base(tiny_gguf, tmp_path_factory):
    p = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("fuzz") / "base.gguf", n_layers=1, alignment=32)
    return p, p.read_bytes(), tiny_gguf.layout(p)["data_start"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_load_or_raise_model_error(fuzz_base, tmp_path, data):
    """Flip, overwrite or cut random bytes (mostly in the header, where they matter):
    opening and loading either succeeds or raises ModelError (a broken chat template
    may also raise TemplateError, another AotxError); never anything else."""
    base_path, blob, header_end = fuzz_base
    buf = bytearray(blob)
    pos = st.one_of(st.integers(0, header_end - 1), st.integers(0, header_end - 1),
                    st.integers(0, len(buf) - 1))
    for _ in range(data.draw(st.integers(1, 4), label="n_edits")):
        i = data.draw(pos, label="pos")
        kind = data.draw(st.sampled_from(["xor", "ff", "zero", "small"]), label="kind")
        if kind == "xor":
            buf[i] ^= data.draw(st.integers(1, 255), label="mask")
        else:
            buf[i] = {"ff": 0xFF, "zero": 0, "small": data.draw(st.integers(1, 8), label="val")}[kind]
    if data.draw(st.booleans(), label="truncate"):
        buf = buf[:data.draw(st.integers(0, len(buf) - 1), label="cut")]
    p = tmp_path / f"fuzz-{os.getpid()}.gguf"
    p.write_bytes(bytes(buf))
    try:
        GGUFFile.open(p)
        load_model(p)
    except ModelError as e:
        assert str(p) in str(e) or "tokenizer" in str(e) or "GGUF metadata" in str(e), str(e)
    except AotxError as e:
        assert type(e).__name__ == "TemplateError", repr(e)


def test_a_block_count_past_the_files_blocks_is_refused_before_the_tensor_list(tiny_gguf, tmp_path):
    """Regression (the README's test run was killed for memory at
    23 GB): a fuzzed byte made llama.block_count 83,886,129; the architecture's list of
    expected tensors for that many layers took gigabytes before any tensor was looked up.
    Found again by this file's fuzz test under a memory limit."""
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", metadata={"llama.block_count": 83_886_129})
    expect_model_error(p, r"block_count is 83,886,129 but the file holds tensors for \d+ blocks \(blk\.0 \.\. blk\.")


def _string_array_file(strings: list[bytes], cut: int = 0) -> bytes:
    """A GGUF v3 header with one key, tokenizer.ggml.tokens, an array of these strings (and
    no tensors), its last ``cut`` bytes removed."""
    import struct

    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b
    body = s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(strings)) + b"".join(s(x) for x in strings)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body
    return data[:len(data) - cut] if cut else data


def test_a_string_array_reads_its_elements_and_names_the_bad_one():
    """The vocabulary's string arrays are read by a fast loop (_string_array) that formats
    its messages only for the element that fails; they name that element as before."""
    from aotx.engine.model.gguf_file import parse

    good = [b"a", "\u00e9t\u00e9".encode(), b"", b"<|im_end|>"]
    assert parse(_string_array_file(good)).metadata["tokenizer.ggml.tokens"] == ["a", "\u00e9t\u00e9", "", "<|im_end|>"]
    with pytest.raises(ModelError, match=r"element 2 of metadata key 'tokenizer.ggml.tokens' is not valid UTF-8"):
        parse(_string_array_file([b"a", b"b", b"\xff\xfe", b"c"]))
    with pytest.raises(ModelError, match=r"element 3 of metadata key 'tokenizer.ggml.tokens' declares a string of 10"):
        parse(_string_array_file([b"a", b"b", b"c", b"0123456789"], cut=4))
    with pytest.raises(ModelError, match=r"truncated GGUF file: the length of element 3 of metadata key"):
        parse(_string_array_file([b"x" * 40, b"b", b"c", b"0123456789"], cut=14))
