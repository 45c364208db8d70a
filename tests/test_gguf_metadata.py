"""Hostile GGUF containers, in the style of gguf-py's validation tests: deliberately
corrupted files, one defect each, every one refused with a ModelError that names
the file, the key (or tensor) and the problem.

Files are built byte by byte here (``gguf_bytes``) so each case states exactly what
is wrong; the nested array and the big-endian file come from gguf's own writer,
as a user would meet them. The parser itself is ``gguf_file.parse`` (a pure
function over bytes); ``GGUFFile.open`` adds the path.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFWriter

from aotx.engine.errors import ModelError
from aotx.engine.model.gguf_file import GGUFFile, parse

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


def s(b: bytes | str) -> bytes:
    """A GGUF string: u64 length then the bytes."""
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def arr(etype: int, n: int, payload: bytes) -> bytes:
    return struct.pack("<IQ", etype, n) + payload


def tinfo(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return s(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", type_id, offset)


ARCH = kv("general.architecture", STR, s("llama"))


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", version: int = 3,
               n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A little-endian GGUF: header, ``kvs``, ``tensors`` infos, padding to 32, ``data``."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    if tensors:
        body += b"\0" * (-len(body) % 32) + data
    return body


def test_builder_makes_a_valid_file():
    """The hand builder itself is right: a file with every scalar type, a string
    array and one F32 tensor parses to the values written."""
    kvs = [ARCH, kv("a.u8", U8, b"\xff"), kv("a.i8", I8, b"\xff"), kv("a.u16", U16, struct.pack("<H", 65535)),
           kv("a.i16", I16, struct.pack("<h", -2)), kv("a.u32", U32, struct.pack("<I", 7)),
           kv("a.i32", I32, struct.pack("<i", -7)), kv("a.f32", F32, struct.pack("<f", 0.5)),
           kv("a.bool", BOOL, b"\x01"), kv("a.u64", U64, struct.pack("<Q", 1 << 40)),
           kv("a.i64", I64, struct.pack("<q", -(1 << 40))), kv("a.f64", F64, struct.pack("<d", 0.25)),
           kv("a.strs", ARR, arr(STR, 2, s("x") + s("héllo"))),
           kv("a.ints", ARR, arr(I32, 3, struct.pack("<3i", 1, -2, 3))),
           kv("a.bools", ARR, arr(BOOL, 2, b"\x00\x01"))]
    data = np.arange(32, dtype=np.float32).tobytes()
    p = parse(gguf_bytes(kvs, [tinfo("t", (8, 4))], data))
    assert p.metadata == {"general.architecture": "llama", "a.u8": 255, "a.i8": -1, "a.u16": 65535, "a.i16": -2,
                          "a.u32": 7, "a.i32": -7, "a.f32": 0.5, "a.bool": True, "a.u64": 1 << 40,
                          "a.i64": -(1 << 40), "a.f64": 0.25, "a.strs": ["x", "héllo"], "a.ints": [1, -2, 3],
                          "a.bools": [False, True]}
    assert type(p.metadata["a.bool"]) is bool and p.metadata["a.bools"][1] is True
    assert [(t.name, t.shape, t.type_id, t.offset) for t in p.tensors] == [("t", (8, 4), 0, 0)]


BIG = 1 << 62

# id -> (file bytes, regexes the message must match). Each row is one defect.
CASES = {
    # --- the damage as reported
    "empty-key": (gguf_bytes([ARCH, kv("", U32, struct.pack("<I", 1))]),
                  [r"metadata key #1 \(at byte \d+\) is empty"]),
    "string-2^62-bytes": (gguf_bytes([ARCH, kv("general.name", STR, struct.pack("<Q", BIG) + b"\0" * 14)]),
                          [r"'general\.name'", r"declares a string of 4611686018427387904 bytes",
                           r"only 14 bytes remain"]),
    "unknown-value-type": (gguf_bytes([ARCH, kv("evil.key", 13, b"\0" * 16)]),
                           [r"'evil\.key'", r"unknown value type 13"]),
    "hand-nested-array": (gguf_bytes([ARCH, kv("x.nested", ARR, arr(ARR, 2, arr(U8, 2, b"\1\2") + arr(U8, 1, b"\3")))]),
                          [r"'x\.nested'", r"array of arrays; nested arrays are not supported"]),
    # --- neighbours of the same defects
    "unknown-array-element-type": (gguf_bytes([ARCH, kv("evil.arr", ARR, arr(99, 1, b"\0" * 8))]),
                                   [r"'evil\.arr'", r"array of unknown value type 99"]),
    "array-length-2^62": (gguf_bytes([ARCH, kv("tokenizer.ggml.scores", ARR, arr(F32, BIG, b"\0" * 8))]),
                          [r"'tokenizer\.ggml\.scores'", r"array of 4611686018427387904 float32", r"remain"]),
    "string-array-length-2^62": (gguf_bytes([ARCH, kv("tokenizer.ggml.tokens", ARR, arr(STR, BIG, s("a")))]),
                                 [r"'tokenizer\.ggml\.tokens'", r"array of 4611686018427387904 strings"]),
    "string-array-element-past-end": (gguf_bytes([ARCH, kv("tokenizer.ggml.tokens", ARR,
                                                           arr(STR, 2, s("a") + struct.pack("<Q", 1000) + b"zz"))]),
                                      [r"element 1 of metadata key 'tokenizer\.ggml\.tokens'",
                                       r"declares a string of 1000 bytes"]),
    "key-length-2^62": (gguf_bytes([ARCH, struct.pack("<Q", BIG) + b"general.name"]),
                        [r"metadata key #1", r"declares a string of 4611686018427387904 bytes"]),
    "duplicate-key": (gguf_bytes([ARCH, kv("a.b", U8, b"\1"), kv("a.b", U8, b"\2")]),
                      [r"'a\.b' appears twice"]),
    "key-not-utf8": (gguf_bytes([ARCH, kv(b"bad\xffkey", U8, b"\1")]),
                     [r"metadata key #1", r"not valid UTF-8"]),
    "value-not-utf8": (gguf_bytes([ARCH, kv("general.name", STR, s(b"caf\xe9"))]),
                       [r"'general\.name'", r"not valid UTF-8"]),
    "bool-not-0-or-1": (gguf_bytes([ARCH, kv("x.flag", BOOL, b"\x07")]),
                        [r"'x\.flag' is a bool of value 7"]),
    "bool-array-not-0-or-1": (gguf_bytes([ARCH, kv("x.flags", ARR, arr(BOOL, 3, b"\0\1\2"))]),
                              [r"element 2 of metadata key 'x\.flags' is a bool of value 2"]),
    "scalar-past-end": (gguf_bytes([ARCH, kv("x.n", U64, b"\1\2")]),
                        [r"truncated", r"metadata key 'x\.n'"]),
    "kv-count-too-big": (gguf_bytes([ARCH], n_kv=1 << 40), [r"metadata count 1099511627776 cannot fit"]),
    "kv-count-one-too-many": (gguf_bytes([ARCH, kv("a.b", U8, b"\1")], n_kv=3), [r"truncated", r"metadata key #2"]),
    "alignment-not-uint32": (gguf_bytes([ARCH, kv("general.alignment", U64, struct.pack("<Q", 32))]),
                             [r"general\.alignment is a uint64; GGUF requires a uint32"]),
    # --- tensor infos
    "tensor-5-dims": (gguf_bytes([ARCH], [tinfo("t", (1, 1, 1, 1, 1))]),
                      [r"tensor 't' has 5 dimensions"]),
    "tensor-2^32-dims": (gguf_bytes([ARCH], [tinfo("t", (), n_dims=0xFFFFFFFF)]),
                         [r"tensor 't' has 4294967295 dimensions"]),
    "tensor-empty-name": (gguf_bytes([ARCH], [tinfo("", (32,))], b"\0" * 128), [r"tensor #0 .* empty name"]),
    "tensor-twice": (gguf_bytes([ARCH], [tinfo("t", (32,)), tinfo("t", (32,), offset=128)], b"\0" * 256),
                     [r"tensor 't' appears twice"]),
    "tensor-name-2^62": (gguf_bytes([ARCH], [struct.pack("<Q", BIG) + b"t"]),
                         [r"name of tensor #0", r"declares a string of 4611686018427387904 bytes"]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_corrupt_container_is_refused_naming_key_and_problem(tmp_path, case):
    blob, patterns = CASES[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(blob)
    with pytest.raises(ModelError) as ei:
        GGUFFile.open(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg, msg
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in {msg!r}"


def _write(path: Path, endian=GGUFEndian.LITTLE, arrays=()) -> Path:
    w = GGUFWriter(path, "llama", endianess=endian)
    w.add_string("general.name", "hostile")
    for key, val in arrays:
        w.add_array(key, val)
    w.add_tensor("t", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_nested_array_from_gguf_writer_is_refused_not_flattened(tmp_path):
    """Regression: ``[[1, 2], [3]]`` written by gguf's own writer
    came back as ``[1, 2, 3]``."""
    p = _write(tmp_path / "nested.gguf", arrays=[("test.nested", [[1, 2], [3]])])
    with pytest.raises(ModelError, match=r"'test\.nested' .*array of arrays; nested arrays are not supported"):
        GGUFFile.open(p)


def test_big_endian_file_says_big_endian(tmp_path):
    """Regression: a big-endian file was reported only as
    'GGUF version 50331648 is not supported'."""
    p = _write(tmp_path / "be.gguf", endian=GGUFEndian.BIG)
    with pytest.raises(ModelError) as ei:
        GGUFFile.open(p)
    msg = str(ei.value)
    assert "big-endian" in msg and "version 3" in msg and "50331648" not in msg, msg
    assert "gguf-convert-endian" in msg


def test_same_writer_little_endian_opens(tmp_path):
    """The control for the two tests above: the writer's little-endian file, with a flat
    array, opens with the values written."""
    p = _write(tmp_path / "le.gguf", arrays=[("test.flat", [1, 2, 3])])
    gf = GGUFFile.open(p)
    assert gf.metadata["test.flat"] == [1, 2, 3] and gf.metadata["general.name"] == "hostile"
    assert gf.tensors["t"].data.shape == (4, 32) and gf.tensors["t"].data.dtype == np.float32


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_fifo_is_refused_without_blocking(tmp_path):
    """A named pipe given as the model would block ``open`` forever."""
    p = tmp_path / "model.gguf"
    os.mkfifo(p)
    with pytest.raises(ModelError, match=r"not a regular file"):
        GGUFFile.open(p)


# ---- the header reader the model list and `aotx pull` use (gguf_header.read_header) ----------

def test_header_reader_refuses_the_same_defects(tmp_path):
    """Regression: the model list reads each
    file's header with ``gguf_header``; there too a big-endian file said only 'version
    50331648', an empty key passed, and a pipe in the models folder blocked the list."""
    from aotx.engine.model.gguf_header import read_file_header, read_header

    with pytest.raises(ModelError) as ei:
        read_file_header(_write(tmp_path / "be.gguf", endian=GGUFEndian.BIG))
    assert "big-endian" in str(ei.value) and "50331648" not in str(ei.value), ei.value
    with pytest.raises(ModelError, match=r"'test\.nested' holds arrays \(nested arrays are not supported\)"):
        read_file_header(_write(tmp_path / "nested.gguf", arrays=[("test.nested", [[1, 2], [3]])]))
    with pytest.raises(ModelError, match=r"a metadata key is empty"):
        read_header(gguf_bytes([ARCH, kv("", U32, struct.pack("<I", 1))]))
    assert read_file_header(_write(tmp_path / "le.gguf", arrays=[("test.flat", [1, 2, 3])])).array_lengths == \
        {"test.flat": 3}
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.gguf")
        with pytest.raises(ModelError, match=r"not a regular file"):
            read_file_header(tmp_path / "pipe.gguf")


def _same_as_gguf_py(path: Path) -> int:
    """The strict parser reads ``path`` as gguf.GGUFReader does: same keys, values (and
    their Python types) and tensor views. Returns the tensor count."""
    import gguf

    gf = GGUFFile.open(path)
    r = gguf.GGUFReader(path)
    ref = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert gf.metadata.keys() == ref.keys()
    for k, v in ref.items():
        assert gf.metadata[k] == v, k
        assert type(gf.metadata[k]) is type(v), k
    assert len(gf.tensors) == len(r.tensors)
    for t in r.tensors:
        mine = gf.tensors[t.name]
        assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes and mine.qtype == t.tensor_type
        assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype
        assert np.array_equal(mine.data[:2], t.data[:2]), t.name
    return len(r.tensors)


def test_real_model_metadata_and_tensors(default_model_path):
    """The default model (SmolLM2, llama) reads as gguf-py reads it (the reference is
    gguf-py, not this parser)."""
    assert _same_as_gguf_py(default_model_path) == 272


#: every tiny architecture file of tests/models (qwen2, qwen3, gemma3, phi3, IQ quants, the
#: mixtures of experts)
TINY_NAMES = ["llama3", "qwen2", "qwen3", "gemma3", "phi3", "phi3-longrope", "iquants", "qwen3moe", "olmoe", "gptoss"]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_architecture_files_are_accepted(tiny_models, tiny_model_path, name):
    """The strictness refuses nothing llama.cpp's converter writes: each tiny architecture
    file (its metadata keys, arrays of strings, floats and ints, IQ4/MXFP4 tensors, 3-D
    expert stacks) opens
    and reads as gguf-py reads it."""
    assert set(TINY_NAMES) == set(tiny_models.TINY) | set(tiny_models.MOE)  # a new tiny file is checked here too
    assert _same_as_gguf_py(tiny_model_path(name)) > 0


def test_tiny_llama_and_cuda_test_model_are_accepted(tiny_models, tmp_path):
    p = tiny_models.llama.write_tiny_llama(tmp_path / "llama.gguf")
    assert _same_as_gguf_py(p) > 0
    from tests.models import cuda_testmodel

    p = cuda_testmodel.write_llama(tmp_path / "cuda.gguf", n_layers=1, d_model=256, vocab=512)
    assert _same_as_gguf_py(p) > 0


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_real_architecture_files_are_accepted(request, name):
    """The two real files (Qwen2.5-Coder-0.5B-Instruct with its tools template,
    Gemma 3 270M with its 262144-token SentencePiece vocabulary) read as gguf-py reads them."""
    path = request.getfixturevalue(f"{name}_model_path")
    assert _same_as_gguf_py(path) > 0
