"""Random-weight GGUFs in the exact shapes and tensor-type mix of real Q4_K_M models.

Owns: ``SHAPES`` (Qwen2.5-0.5B-Instruct, Qwen2.5-7B-Instruct and Llama-3.1-8B-Instruct, as
llama.cpp's ``llama-quantize`` lays out Q4_K_M: ``q4_k_m_types``; and the default model,
SmolLM2-135M-Instruct, Q4_1 with a Q8_0 tied embedding), ``write_shape(path,
name, tokenizer_kv)`` which streams such a file tensor by tensor (a few GB, in seconds:
every matrix's rows are drawn from a small pool of random valid rows of its type), and
the tokenizer metadata both engines need (``tokenizer_kv_from_gguf``, ``save_tokenizer``,
``load_tokenizer``): throughput does not depend on the weights, so the vocabulary is
SmolLM2's (49,152 tokens, from the default model), which llama.cpp accepts, instead of
each model's own (its output head is then smaller: the table says so).

Q4_K_M, from llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp of the llama.cpp
vendored in llama-cpp-python 0.3.36): Q4_K everywhere; ``attn_v`` and ``ffn_down`` Q6_K on
the layers where ``use_more_bits(i, n)`` (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2);
``output`` Q6_K; a row length that is not a multiple of 256 falls back (Q4_K -> Q5_0,
Q6_K -> Q8_0), which is why Qwen2.5-0.5B (d_model 896) is mostly Q5_0 with Q8_0 ``attn_v``
and output; its real file (tests: /work/coord/models) has exactly that mix.

``arch``: "qwen2" writes QKV biases and the qwen2 metadata (what the real files are);
"llama" writes the same shapes as a llama model (no biases), for an engine without qwen2.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from tests.models.cuda_testmodel import random_matrix

SHAPES = {
    # the default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 tied embedding; not a Q4_K_M file)
    "smollm2-135m": dict(arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, ffn=1536,
                         rope_base=100000.0, norm_eps=1e-5, context_length=8192, tied=True,
                         types={"layer": T.Q4_1, "token_embd.weight": T.Q8_0}, file_type=3),
    "qwen2.5-0.5b": dict(arch="qwen2", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, ffn=4864,
                         rope_base=1e6, norm_eps=1e-6, context_length=32768, tied=False),
    "qwen2.5-7b": dict(arch="qwen2", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, ffn=18944,
                       rope_base=1e6, norm_eps=1e-6, context_length=32768, tied=False),
    "llama-3.1-8b": dict(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn=14336,
                         rope_base=500000.0, norm_eps=1e-5, context_length=131072, tied=False),
}
VOCAB = 49152
POOL_ROWS = 512


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qt: T, k: int) -> T:
    be = GGML_QUANT_SIZES[qt][0]
    if k % be == 0:
        return qt
    return {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}[qt]


def tensor_type(shape: str, name: str, i: int | None, k: int) -> T:
    """The type of tensor ``name`` of layer ``i`` in shape ``shape``: the shape's own
    ``types`` (a fixed mix) or Q4_K_M's rule."""
    s = SHAPES[shape]
    fixed = s.get("types")
    if fixed is not None:
        return fixed.get(name, fixed["layer"])
    return q4_k_m_types(name, i, s["n_layers"], k)


def q4_k_m_types(name: str, i: int | None, n_layers: int, k: int) -> T:
    """The tensor type llama.cpp's Q4_K_M gives tensor ``name`` (a suffix such as
    "attn_v.weight", or "output.weight" / "token_embd.weight") of layer ``i`` with rows
    of ``k`` inputs."""
    if name == "output.weight":
        qt = T.Q6_K
    elif name in ("attn_v.weight", "ffn_down.weight") and use_more_bits(int(i), n_layers):
        qt = T.Q6_K
    else:
        qt = T.Q4_K
    return _fallback(qt, k)


def tensor_list(name: str) -> list[tuple[str, tuple[int, int] | tuple[int], T]]:
    """(tensor name, numpy shape ((m, k) for a matrix), type) of every tensor, in file order."""
    s = SHAPES[name]
    d, L, hd = s["d_model"], s["n_layers"], s["d_model"] // s["n_heads"]
    qd, kd, f = s["n_heads"] * hd, s["n_kv_heads"] * hd, s["ffn"]
    out = [("token_embd.weight", (VOCAB, d), tensor_type(name, "token_embd.weight", None, d)),
           ("output_norm.weight", (d,), T.F32)]
    if not s["tied"]:
        out.append(("output.weight", (VOCAB, d), tensor_type(name, "output.weight", None, d)))
    for i in range(L):
        mats = [("attn_q.weight", (qd, d)), ("attn_k.weight", (kd, d)), ("attn_v.weight", (kd, d)),
                ("attn_output.weight", (d, qd)), ("ffn_gate.weight", (f, d)), ("ffn_up.weight", (f, d)),
                ("ffn_down.weight", (d, f))]
        out.append((f"blk.{i}.attn_norm.weight", (d,), T.F32))
        out.append((f"blk.{i}.ffn_norm.weight", (d,), T.F32))
        for suffix, shape in mats:
            out.append((f"blk.{i}.{suffix}", shape, tensor_type(name, suffix, i, shape[1])))
        if s["arch"] == "qwen2":
            for part, m in (("q", qd), ("k", kd), ("v", kd)):
                out.append((f"blk.{i}.attn_{part}.bias", (m,), T.F32))
    return out


def weight_bytes(name: str) -> int:
    """Bytes of every tensor of the shape (what an engine reads per token, roughly)."""
    n = 0
    for _, shape, qt in tensor_list(name):
        if len(shape) == 1:
            n += 4 * shape[0]
        else:
            be, bb = GGML_QUANT_SIZES[qt]
            n += shape[0] * shape[1] // be * bb
    return n


# ---- tokenizer metadata ---------------------------------------------------------------------------

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def tokenizer_kv_from_gguf(path) -> list[dict]:
    """The tokenizer keys of a GGUF as JSON-able dicts (key, value, type, sub_type)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    out = []
    for key in TOKENIZER_KEYS:
        f = r.fields.get(key)
        if f is None:
            continue
        vt = f.types[0]
        sub = f.types[1].name if vt == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        out.append({"key": key, "value": val, "type": vt.name, "sub_type": sub})
    return out


def save_tokenizer(kv: list[dict], path) -> None:
    Path(path).write_text(json.dumps(kv))


def load_tokenizer(path) -> list[dict]:
    return json.loads(Path(path).read_text())


def _add_kv(w: gguf.GGUFWriter, kv: list[dict]) -> None:
    V = gguf.GGUFValueType
    for e in kv:
        vt = V[e["type"]]
        sub = V[e["sub_type"]] if e.get("sub_type") else None
        w.add_key_value(e["key"], e["value"], vt, sub_type=sub)


# ---- the writer -----------------------------------------------------------------------------------

def write_shape(path, name: str, tokenizer_kv: list[dict], *, arch: str | None = None, seed: int = 0) -> Path:
    """Write the random-weight GGUF of shape ``name`` to ``path`` (streamed: one tensor in
    memory at a time) and return the path. ``arch`` overrides the shape's architecture
    ("llama" writes a qwen shape without biases)."""
    path = Path(path)
    s = dict(SHAPES[name])
    arch = arch or s["arch"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"aotx-random-{name}-q4_k_m-shape")
    w.add_context_length(s["context_length"])
    w.add_embedding_length(s["d_model"])
    w.add_block_count(s["n_layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv_heads"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["norm_eps"])
    w.add_vocab_size(VOCAB)
    w.add_file_type(s.get("file_type", 15))   # LLAMA_FTYPE_MOSTLY_Q4_K_M (15), _Q4_1 (3)
    if arch == "llama":
        w.add_rope_dimension_count(s["d_model"] // s["n_heads"])
    _add_kv(w, tokenizer_kv)
    tensors = [t for t in tensor_list(name) if arch == "qwen2" or not t[0].endswith(".bias")]
    pools: dict[tuple[int, int], np.ndarray] = {}

    def data(tname, shape, qt):
        if len(shape) == 1:
            if qt != T.F32:
                raise ValueError(qt)
            return (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        m, k = shape
        emb = tname == "token_embd.weight"
        key = (int(qt), k, emb)
        if key not in pools:
            arr, _ = random_matrix(qt, POOL_ROWS, k, rng, 1.0 if emb else None)
            pools[key] = np.ascontiguousarray(np.asarray(arr).view(np.uint8).reshape(POOL_ROWS, -1))
        return pools[key][rng.integers(0, POOL_ROWS, m)]

    for tname, shape, qt in tensors:
        if len(shape) == 1:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            be, bb = GGML_QUANT_SIZES[qt]
            w.add_tensor_info(tname, (shape[0], shape[1] // be * bb), np.dtype(np.uint8),
                              shape[0] * shape[1] // be * bb, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shape, qt in tensors:
        w.write_tensor_data(data(tname, shape, qt))
    w.close()
    return path
