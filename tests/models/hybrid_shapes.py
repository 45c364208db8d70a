"""Random-weight ``qwen35`` GGUFs in the exact shapes of Qwen3.5-0.8B and Qwen3.5-2B, with the
tensor types llama.cpp's ``llama-quantize`` gives a Q4_K_M file of that architecture.

Owns: ``SHAPES`` (the two text stacks), ``tensor_list(name, n_vocab)`` (every tensor's name,
numpy shape and type, in file order), ``vocab()`` (Qwen3.5's own tokenizer, padded to the
model's 248,320 rows) and ``write(path, name)``, which streams a file tensor by tensor (a
matrix's rows drawn from a small pool of random valid rows of its type, as ``shapes.py``
does), so memory stays at a few MB whatever the size. Leaves the metadata keys to the tiny
writer (``qwen35.hparams``), the random blocks to ``cuda_testmodel.random_matrix``.

The shapes (Qwen3.5-0.8B / -2B config.json, text part): 24 layers, three gated DeltaNet
layers to one gated full-attention layer (``full_attention_interval`` 4); full attention 8
query heads and 2 KV heads of 256 (the query projection doubled: query and gate), RoPE over
64 of the 256 dimensions (partial_rotary_factor 0.25) in M-RoPE sections [11, 11, 10, 0],
base 1e7; linear attention 16 key and 16 value heads of 128 (``ssm.state_size`` 128),
convolution kernel 4; embeddings tied. d_model / FFN: 1024 / 3584 (0.8B), 2048 / 6144 (2B).
The MTP block the real checkpoints carry is left out (llama.cpp's main graph skips it).

Q4_K_M for qwen35, from src/llama-quant.cpp (llama.cpp 0c1e570, vendored in
llama-cpp-python 0.3.36): Q4_K by default, for every 2-D ``*.weight`` but norms and
``ssm_conv1d`` (kept F32); ``attn_v`` *and* ``attn_qkv`` count as attention-V tensors
(``category_is_attn_v``), one per layer here, so both are Q6_K on ``use_more_bits(i, 24)``
layers; ``ffn_down`` likewise; the tied ``token_embd`` takes the output's Q6_K.
1-D tensors (norms, ``ssm_a``, ``ssm_dt.bias``) stay F32.

Weights: like the tiny file's, the state is load-bearing but bounded (``ssm_a`` ~ -0.6,
``ssm_dt.bias`` ~ -1); throughput does not depend on the values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import GGUFValueType as V

from tests.models import hf_vocab, qwen35
from tests.models.common import FILE_TYPE, TinyWriter, Tokenizer
from tests.models.cuda_testmodel import random_matrix
from tests.models.shapes import POOL_ROWS, use_more_bits

_COMMON = {"n_layers": 24, "n_heads": 8, "n_kv_heads": 2, "head_dim": 256, "rope_dim": 64, "sections": (11, 11, 10, 0),
           "n_k": 16, "n_v": 16, "state": 128, "conv": 4, "interval": 4, "context_length": 262144}
SHAPES = {
    "qwen3.5-0.8b": {**_COMMON, "d_model": 1024, "ffn": 3584},
    "qwen3.5-2b": {**_COMMON, "d_model": 2048, "ffn": 6144},
}
N_VOCAB = 248320


def vocab(n_vocab: int = N_VOCAB) -> Tokenizer:
    """Qwen3.5's tokenizer (``hf_vocab.tokenizer("qwen35")``: 248,077 tokens) padded to
    ``n_vocab`` with ``[PADi]`` UNUSED tokens, as the converter pads to config.json's
    vocab_size."""
    tok = hf_vocab.tokenizer("qwen35")
    n0 = tok.n_vocab
    tokens = tuple(tok.get("tokenizer.ggml.tokens")) + tuple(f"[PAD{i}]" for i in range(n0, n_vocab))
    types = tuple(tok.get("tokenizer.ggml.token_type")) + (5,) * (n_vocab - n0)
    return Tokenizer(tok.replace({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}).kv, n_vocab)


def q4_k_m(role: str, i: int | None, n_layers: int) -> T:
    """The type llama-quantize's Q4_K_M gives a 2-D weight of role ``role`` of layer ``i``."""
    if role == "token_embd":
        return T.Q6_K
    if role in ("attn_v", "attn_qkv", "ffn_down") and use_more_bits(int(i), n_layers):
        return T.Q6_K
    return T.Q4_K


def tensor_list(name: str, n_vocab: int = N_VOCAB) -> list[tuple[str, tuple[int, ...], T]]:
    """(tensor name, numpy shape ((out, in) for a matrix), type) of every tensor, in file order."""
    s = SHAPES[name]
    d, L, f, hd = s["d_model"], s["n_layers"], s["ffn"], s["head_dim"]
    q, kv = s["n_heads"] * hd, s["n_kv_heads"] * hd
    key, value = s["n_k"] * s["state"], s["n_v"] * s["state"]
    out = [("token_embd.weight", (n_vocab, d), q4_k_m("token_embd", None, L))]
    for i in range(L):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (d,), T.F32), (p + "post_attention_norm.weight", (d,), T.F32)]
        if (i + 1) % s["interval"]:
            mats = [("attn_qkv", (2 * key + value, d)), ("attn_gate", (value, d)), ("ssm_beta", (s["n_v"], d)),
                    ("ssm_alpha", (s["n_v"], d))]
            out += [(p + r + ".weight", shape, q4_k_m(r, i, L)) for r, shape in mats]
            out += [(p + "ssm_conv1d.weight", (2 * key + value, s["conv"]), T.F32), (p + "ssm_dt.bias", (s["n_v"],), T.F32),
                    (p + "ssm_a", (s["n_v"],), T.F32), (p + "ssm_norm.weight", (s["state"],), T.F32),
                    (p + "ssm_out.weight", (d, value), q4_k_m("ssm_out", i, L))]
        else:
            mats = [("attn_q", (2 * q, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d))]
            out += [(p + r + ".weight", shape, q4_k_m(r, i, L)) for r, shape in mats]
            out += [(p + "attn_q_norm.weight", (hd,), T.F32), (p + "attn_k_norm.weight", (hd,), T.F32),
                    (p + "attn_output.weight", (d, q), q4_k_m("attn_output", i, L))]
        out += [(p + r + ".weight", shape, q4_k_m(r, i, L))
                for r, shape in (("ffn_gate", (f, d)), ("ffn_up", (f, d)), ("ffn_down", (d, f)))]
    out.append(("output_norm.weight", (d,), T.F32))
    return out


def _nbytes(shape: tuple[int, ...], qt: T) -> int:
    if qt == T.F32:
        return 4 * int(np.prod(shape))
    be, bb = GGML_QUANT_SIZES[qt]
    return shape[0] * shape[1] // be * bb


def write(path: str | Path, name: str, tokenizer: Tokenizer | None = None, *, seed: int = 0) -> Path:
    """Write the random-weight Q4_K_M-typed file of shape ``name`` to ``path`` (streamed);
    ``tokenizer`` defaults to ``vocab()``."""
    path = Path(path)
    s = SHAPES[name]
    tok = vocab() if tokenizer is None else tokenizer
    tw = TinyWriter(path, "qwen35", seed=seed, name=f"aotx-random-{name}-q4_k_m-shape")
    qwen35.hparams(tw, n_layers=s["n_layers"], nextn=0, d_model=s["d_model"], ffn=s["ffn"], n_heads=s["n_heads"],
                   n_kv_heads=s["n_kv_heads"], head_dim=s["head_dim"], rope_dim=s["rope_dim"],
                   sections=s["sections"], n_k=s["n_k"], n_v=s["n_v"], state=s["state"], conv=s["conv"],
                   interval=s["interval"], context_length=s["context_length"])
    w = tw.w
    for key, val, vt in tok.kv:
        if vt == V.ARRAY:
            w.add_array(key, list(val))
        else:
            w.add_key_value(key, val, vt)
    w.add_file_type(FILE_TYPE[T.Q4_K])
    w.add_quantization_version(2)
    tensors = tensor_list(name, tok.n_vocab)
    for tname, shape, qt in tensors:
        if qt == T.F32:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), _nbytes(shape, qt))
        else:
            be, bb = GGML_QUANT_SIZES[qt]
            w.add_tensor_info(tname, (shape[0], shape[1] // be * bb), np.dtype(np.uint8), _nbytes(shape, qt),
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pools: dict[tuple[int, int, bool], np.ndarray] = {}
    for tname, shape, qt in tensors:
        if tname.endswith("ssm_a"):
            arr = (-0.6 + 0.15 * rng.standard_normal(shape)).astype(np.float32)
        elif tname.endswith("ssm_dt.bias"):
            arr = (-1.0 + 0.5 * rng.standard_normal(shape)).astype(np.float32)
        elif qt == T.F32:
            arr = ((0.5 * rng.standard_normal(shape)) if len(shape) == 2 else
                   (1.0 + 0.1 * rng.standard_normal(shape))).astype(np.float32)
        else:
            m, k = shape
            emb = tname == "token_embd.weight"
            pk = (int(qt), k, emb)
            if pk not in pools:
                a, _ = random_matrix(qt, POOL_ROWS, k, rng, 1.0 / np.sqrt(k) if emb else None)
                pools[pk] = np.ascontiguousarray(np.asarray(a).view(np.uint8).reshape(POOL_ROWS, -1))
            arr = pools[pk][rng.integers(0, POOL_ROWS, m)]
        w.write_tensor_data(arr)
    w.close()
    return path
