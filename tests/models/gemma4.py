"""A tiny ``gemma4`` GGUF (Gemma 4 dense, E2B/E4B-like): sliding and global layers of
different head sizes and KV heads, per-layer token embeddings, the last two layers
reusing earlier layers' KV, double-wide FFNs on those, layer output scales, final logit
soft-capping.

Shape: 4 layers, ``attention.sliding_window_pattern`` [T, F, T, F] (window 8,
``rope.freq_base_swa`` 10000), ``attention.shared_kv_layers`` 2 (layer 2 reads layer 0's
KV, layer 3 layer 1's). Four layers keep the file as sensitive to activation rounding
as the other tiny files (llama.cpp and a float64 reference differ by a mean 0.08; with
six layers, 0.15). d_model 64, 4 query heads; sliding layers 2 KV heads of 16
(``key_length_swa``), RoPE over all 16 (``rope.dimension_count_swa``); global layers 1
KV head of 32 (``key_length``), RoPE at 1e6 over 32 (``rope.dimension_count``) with
``rope_freqs`` 1 for the first 4 pairs and 1e30 for the other 12 (the converter's
"proportional" RoPE, partial factor 0.25). ``head_count_kv`` and ``feed_forward_length``
are per-layer arrays (FFN 128, 256 on the KV-sharing layers), as the converter writes
them. The global layers have no ``attn_v`` (V is the K projection, RMS-normed without a
weight). Per-layer inputs of 16 (``embedding_length_per_layer_input``). Norm weights as
stored (the converter adds no 1). Tied output, final_logit_softcapping 30. Tokenizer: the
given one's (SmolLM2's gpt2 BPE in the tests). Deterministic for any seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q8_0, "per_layer_token_embd": T.Q8_0, "per_layer_model_proj": T.Q8_0, "attn_q": T.F16,
         "attn_k": T.F16, "attn_v": T.Q8_0, "attn_output": T.BF16, "ffn_gate": T.Q8_0, "ffn_up": T.Q5_0,
         "ffn_down": T.Q8_0, "inp_gate": T.Q8_0, "proj": T.F16}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 45, n_layers: int = 4, d_model: int = 64,
          n_heads: int = 4, swa: tuple[bool, ...] = (True, False, True, False), window: int = 8,
          head_swa: int = 16, head_full: int = 32, kv_swa: int = 2, kv_full: int = 1, rot_pairs_full: int = 4,
          shared_kv: int = 2, ffn: int = 128, ple: int = 16, rope_base: float = 1000000.0,
          rope_base_swa: float = 10000.0, softcap: float = 30.0, context_length: int = 131072,
          out_scale: bool = True, **defects: Any) -> Path:
    """Write the tiny gemma4 file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "gemma4", seed=seed, name="tiny-gemma4", **defects)
    w = tw.w
    first_shared = n_layers - shared_kv
    ffns = [ffn if i < first_shared else 2 * ffn for i in range(n_layers)]
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffns)
    w.add_head_count(n_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    w.add_rope_freq_base(rope_base)
    w.add_rope_freq_base_swa(rope_base_swa)
    if softcap:
        w.add_final_logit_softcapping(softcap)
    if window:
        w.add_sliding_window(window)
    w.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    w.add_shared_kv_layers(shared_kv)
    w.add_embedding_length_per_layer_input(ple)
    w.add_array("gemma4.attention.sliding_window_pattern", list(swa))
    w.add_key_length_swa(head_swa)
    w.add_value_length_swa(head_swa)
    w.add_rope_dimension_count(head_full)
    w.add_rope_dimension_count_swa(head_swa)
    tw.tokenizer(tokenizer)

    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    if ple:
        tw.matrix("per_layer_token_embd.weight", tokenizer.n_vocab, ple * n_layers, TYPES["per_layer_token_embd"],
                  std=1.0 / ple ** 0.5)
        tw.matrix("per_layer_model_proj.weight", ple * n_layers, d_model, TYPES["per_layer_model_proj"])
        tw.vector("per_layer_proj_norm.weight", ple)
    tw.tensor("rope_freqs.weight", np.array([1.0] * rot_pairs_full + [1e30] * (head_full // 2 - rot_pairs_full),
                                            np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        hd, kv = (head_swa, kv_swa) if swa[i] else (head_full, kv_full)
        has_kv = i < first_shared
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", n_heads * hd, d_model, TYPES["attn_q"])
        if has_kv:
            tw.matrix(p + "attn_k.weight", kv * hd, d_model, TYPES["attn_k"])
            if swa[i]:
                tw.matrix(p + "attn_v.weight", kv * hd, d_model, TYPES["attn_v"])
            tw.vector(p + "attn_k_norm.weight", hd, std=0.3)
        tw.vector(p + "attn_q_norm.weight", hd, std=0.3)
        tw.matrix(p + "attn_output.weight", d_model, n_heads * hd, TYPES["attn_output"])
        tw.vector(p + "post_attention_norm.weight", d_model)
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffns[i], d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffns[i], d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffns[i], TYPES["ffn_down"])
        tw.vector(p + "post_ffw_norm.weight", d_model)
        if ple:
            tw.matrix(p + "inp_gate.weight", ple, d_model, TYPES["inp_gate"])
            tw.matrix(p + "proj.weight", d_model, ple, TYPES["proj"])
            tw.vector(p + "post_norm.weight", d_model)
        if out_scale:
            tw.vector(p + "layer_output_scale.weight", 1, mean=0.8, std=0.1)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    return tw.write()


#: the text the synthetic Gemma 4 vocabulary is trained on (also what its references tokenize)
VOCAB_TEXT = ("The quick brown fox jumps over the lazy dog. On a narrow spit of rock at the edge of the northern "
              "sea there stood a lighthouse, and in the lighthouse there lived an old keeper.\n"
              "def fibonacci(n):\n    a, b = 0, 1\n    return a\n\nprint(fibonacci(10))\n")


def synthetic_vocab(n_merges: int = 300) -> Tokenizer:
    """A small vocabulary of Gemma 4's kind (``tokenizer.ggml.model`` "gemma4": BPE over raw
    UTF-8 with ``▁`` for spaces and ``<0xXX>`` byte fallback): specials ``<pad>`` ``<eos>``
    ``<bos>`` ``<unk>`` ``<|turn>`` ``<turn|>``, the 256 byte tokens, the characters of
    ``VOCAB_TEXT`` and ``n_merges`` merges trained on it (most frequent pair first, ties by
    the pair's text), and ``\\n\\n\\n``, a token no merge makes (llama.cpp looks newline runs up
    whole). Deterministic."""
    from gguf import GGUFValueType as V

    specials = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<|turn>", 3), ("<turn|>", 3)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in specials] + [6] * 256
    words = [list(w) for w in VOCAB_TEXT.replace(" ", "▁").split("\n") if w]
    chars = sorted({c for w in words for c in w})
    tokens += chars
    types += [1] * len(chars)
    merges = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), _ = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    tokens += ["\n", "\n\n", "\n\n\n"]
    types += [1, 1, 1]
    merges.append("\n \n")
    kv = (("tokenizer.ggml.model", "gemma4", V.STRING), ("tokenizer.ggml.pre", "gemma4", V.STRING),
          ("tokenizer.ggml.tokens", tuple(tokens), V.ARRAY), ("tokenizer.ggml.token_type", tuple(types), V.ARRAY),
          ("tokenizer.ggml.merges", tuple(merges), V.ARRAY), ("tokenizer.ggml.bos_token_id", 2, V.UINT32),
          ("tokenizer.ggml.eos_token_id", 1, V.UINT32), ("tokenizer.ggml.unknown_token_id", 3, V.UINT32),
          ("tokenizer.ggml.padding_token_id", 0, V.UINT32), ("tokenizer.ggml.add_bos_token", True, V.BOOL),
          ("tokenizer.ggml.add_space_prefix", False, V.BOOL))
    return Tokenizer(kv, len(tokens))
