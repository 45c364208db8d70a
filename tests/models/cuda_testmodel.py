"""Random-weight llama GGUF files for the CUDA parity tests and the CUDA bench.

Owns: ``write_llama(path, ...)``, which writes a llama model of any shape with random
blocks in a chosen tensor type (scales set so that each weight has std ~1/sqrt(k)), and
``SMOLLM2_135M``, the default model's shape (30 layers, d 576, 9 heads, 3 KV heads,
head_dim 64, ffn 1536, vocab 49152, Q4_1 layers, Q8_0 tied embedding), so the bench can
run on a machine that does not have the real file. Model metadata only: there is no
tokenizer in these files (build the model with ``architectures.llama.build``, not
``load_model``).

Blocks are written directly (random quants, chosen float16 scales) rather than through
``gguf.quants.quantize``: it is fast for 135M weights and covers the K types, which the
gguf package cannot quantize.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

SMOLLM2_135M = dict(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, ffn=1536, vocab=49152,
                    qtype=T.Q4_1, emb_qtype=T.Q8_0, rope_base=100000.0, norm_eps=1e-5, context_length=8192)

# per type: (offsets of float16 scale fields, scale of the field for unit std, offset fields that
# hold a "min" and the multiple of d it gets so the weights are centred)
_SCALES = {
    T.Q4_0: ((0,), 1 / 4.6, {}),
    T.Q4_1: ((0,), 1 / 4.6, {2: -7.5}),
    T.Q5_0: ((0,), 1 / 9.2, {}),
    T.Q5_1: ((0,), 1 / 9.2, {2: -15.5}),
    T.Q8_0: ((0,), 1 / 74.0, {}),
    T.Q4_K: ((0,), 1 / (31.5 * 4.6), {2: 7.5}),
    T.Q5_K: ((0,), 1 / (31.5 * 9.2), {2: 15.5}),
    T.Q6_K: ((208,), 1 / (74.0 * 18.5), {}),
}


def random_matrix(qtype: T, m: int, k: int, rng: np.random.Generator, std: float | None = None):
    """(array, raw_dtype) for ``GGUFWriter.add_tensor``: a random (m, k) weight of ``qtype``
    whose dequantized entries have std about ``std`` (default 1/sqrt(k))."""
    std = float(1.0 / np.sqrt(k)) if std is None else float(std)
    if qtype == T.F32:
        return (rng.standard_normal((m, k), np.float32) * np.float32(std)), None
    if qtype == T.F16:
        return (rng.standard_normal((m, k), np.float32) * std).astype(np.float16), None
    if qtype == T.BF16:
        f = rng.standard_normal((m, k), np.float32) * np.float32(std)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(m, 2 * k), T.BF16
    be, bb = GGML_QUANT_SIZES[qtype]
    nb = k // be
    blocks = rng.integers(0, 256, (m, nb, bb), dtype=np.uint8)
    if qtype not in _SCALES:  # other types: random blocks, valid to the reader (for refusal tests)
        return blocks.reshape(m, nb * bb), qtype
    fields, unit, mins = _SCALES[qtype]
    d = (std * unit * rng.uniform(0.7, 1.3, (m, nb))).astype(np.float16)
    for off in fields:
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(m, nb, 2)
    for off, mult in mins.items():
        mv = (d.astype(np.float32) * mult).astype(np.float16)
        blocks[:, :, off:off + 2] = mv.view(np.uint8).reshape(m, nb, 2)
    if qtype in (T.Q4_K, T.Q5_K):
        # 6-bit scales and mins equal (sc == mn) keeps each sub-block centred: d*sc*(q - 7.5)
        sc = rng.integers(16, 48, (m, nb, 8), dtype=np.uint8)
        s = blocks[:, :, 4:16]
        s[:, :, 0:4] = sc[:, :, 0:4]
        s[:, :, 4:8] = sc[:, :, 0:4]
        s[:, :, 8:12] = (sc[:, :, 4:8] & 15) | ((sc[:, :, 4:8] & 15) << 4)
        s[:, :, 0:4] |= (sc[:, :, 4:8] >> 4) << 6
        s[:, :, 4:8] |= (sc[:, :, 4:8] >> 4) << 6
        blocks[:, :, 4:16] = s
    return blocks.reshape(m, nb * bb), qtype


def write_llama(path: str | Path, *, n_layers: int = 2, d_model: int = 256, n_heads: int = 4, n_kv_heads: int = 2,
                ffn: int = 512, vocab: int = 512, qtype: T = T.Q8_0, emb_qtype: T | None = None,
                out_qtype: T | None = None, layer_types: dict[str, T] | None = None, seed: int = 0,
                rope_base: float = 10000.0, norm_eps: float = 1e-5, context_length: int = 4096) -> Path:
    """Write a random llama GGUF and return its path.

    ``qtype``: type of every layer matrix (``layer_types`` maps a suffix such as
    ``"attn_v.weight"`` to another type); ``emb_qtype``: the token embedding's (default
    ``qtype``); ``out_qtype``: an untied ``output.weight`` of that type (None: tied).
    Norm weights are F32 around 1."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    hd = d_model // n_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("aotx-random-llama")
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_vocab_size(vocab)

    def add(name: str, qt: T, m: int, k: int, std: float | None = None) -> None:
        arr, raw = random_matrix(qt, m, k, rng, std)
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d_model)).astype(np.float32))

    add("token_embd.weight", emb_qtype or qtype, vocab, d_model, std=1.0)
    norm("output_norm.weight")
    if out_qtype is not None:
        add("output.weight", out_qtype, vocab, d_model)
    lt = layer_types or {}
    shapes = {"attn_q.weight": (n_heads * hd, d_model), "attn_k.weight": (n_kv_heads * hd, d_model),
              "attn_v.weight": (n_kv_heads * hd, d_model), "attn_output.weight": (d_model, n_heads * hd),
              "ffn_gate.weight": (ffn, d_model), "ffn_up.weight": (ffn, d_model), "ffn_down.weight": (d_model, ffn)}
    for i in range(n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for suffix, (m, k) in shapes.items():
            add(f"blk.{i}.{suffix}", lt.get(suffix, qtype), m, k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
