"""A tiny ``gemma4`` GGUF (Gemma 4 dense, E2B/E4B-like): sliding and global layers of
different head sizes and KV heads, per-layer token embeddings, the last two layers
reusing earlier layers' KV, double-wide FFNs on those, layer output scales, final logit
soft-capping; with ``n_expert`` the mixture-of-experts variant (26B-A4B-like, ``HYBRID``'s
``gemma4moe``).

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

The mixture-of-experts variant (``n_expert`` > 0; the 26B-A4B's layout as
conversion/gemma.py writes it): every layer keeps its dense FFN (the shared expert) and
adds ``ffn_gate_inp`` (F32, the router: entries of std ``ROUTER_STD`` on an input of norm
~1, so near-ties are rare), ``ffn_gate_inp.scale`` (the router input's per-channel
scale), ``pre_ffw_norm_2``, ``post_ffw_norm_1``, ``post_ffw_norm_2``, the experts as
one ``ffn_gate_up_exps`` stack (each expert's gate rows then its up rows; with
``fused_gate_up=False`` as ``ffn_gate_exps`` and ``ffn_up_exps`` holding the same values)
and ``ffn_down_exps`` with its per-expert ``ffn_down_exps.scale`` (optional: ``skip`` it);
keys ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``. The
26B-A4B has no per-layer inputs and no shared KV: ``gemma4moe`` passes ``ple=0``,
``shared_kv=0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, random_matrix, std_vocab
from .experts import experts

TYPES = {"token_embd": T.Q8_0, "per_layer_token_embd": T.Q8_0, "per_layer_model_proj": T.Q8_0, "attn_q": T.F16,
         "attn_k": T.F16, "attn_v": T.Q8_0, "attn_output": T.BF16, "ffn_gate": T.Q8_0, "ffn_up": T.Q5_0,
         "ffn_down": T.Q8_0, "inp_gate": T.Q8_0, "proj": T.F16, "ffn_gate_inp": T.F32,
         "ffn_gate_up_exps": T.Q8_0, "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q4_0}
#: the mixture-of-experts file's types: attention and the dense FFN in F32, so that the
#: experts' matmuls are the only int8 ones before the head. (The two engines round int8 and
#: half-precision activations differently; with every matmul quantized, that noise flips
#: near-tied routes in a quarter of the rows: mean |d| 0.17-0.31 against llama.cpp, and
#: llama.cpp itself with flash attention on moves by 0.18.)
MOE_TYPES = {**TYPES, **{r: T.F32 for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                            "ffn_down")}}
#: router entries' std: the router's input has norm ~1, so its logits have std ~ROUTER_STD
ROUTER_STD = 4.0


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 45, n_layers: int = 4, d_model: int = 64,
          n_heads: int = 4, swa: tuple[bool, ...] = (True, False, True, False), window: int = 8,
          head_swa: int = 16, head_full: int = 32, kv_swa: int = 2, kv_full: int = 1, rot_pairs_full: int = 4,
          shared_kv: int = 2, ffn: int = 128, ple: int = 16, rope_base: float = 1000000.0,
          rope_base_swa: float = 10000.0, softcap: float = 30.0, context_length: int = 131072,
          out_scale: bool = True, n_expert: int = 0, n_expert_used: int = 2, expert_ffn: int = 64,
          fused_gate_up: bool = True, **defects: Any) -> Path:
    """Write the tiny gemma4 file to ``path`` (``n_expert`` > 0: the mixture-of-experts
    variant); ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "gemma4", seed=seed, name="tiny-gemma4moe" if n_expert else "tiny-gemma4", **defects)
    types = MOE_TYPES if n_expert else TYPES
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
    if n_expert:
        w.add_expert_feed_forward_length(expert_ffn)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    tw.tokenizer(tokenizer)

    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, types["token_embd"], std=std_vocab(d_model))
    if ple:
        tw.matrix("per_layer_token_embd.weight", tokenizer.n_vocab, ple * n_layers, types["per_layer_token_embd"],
                  std=1.0 / ple ** 0.5)
        tw.matrix("per_layer_model_proj.weight", ple * n_layers, d_model, types["per_layer_model_proj"])
        tw.vector("per_layer_proj_norm.weight", ple)
    tw.tensor("rope_freqs.weight", np.array([1.0] * rot_pairs_full + [1e30] * (head_full // 2 - rot_pairs_full),
                                            np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        hd, kv = (head_swa, kv_swa) if swa[i] else (head_full, kv_full)
        has_kv = i < first_shared
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", n_heads * hd, d_model, types["attn_q"])
        if has_kv:
            tw.matrix(p + "attn_k.weight", kv * hd, d_model, types["attn_k"])
            if swa[i]:
                tw.matrix(p + "attn_v.weight", kv * hd, d_model, types["attn_v"])
            tw.vector(p + "attn_k_norm.weight", hd, std=0.3)
        tw.vector(p + "attn_q_norm.weight", hd, std=0.3)
        tw.matrix(p + "attn_output.weight", d_model, n_heads * hd, types["attn_output"])
        tw.vector(p + "post_attention_norm.weight", d_model)
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffns[i], d_model, types["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffns[i], d_model, types["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffns[i], types["ffn_down"])
        tw.vector(p + "post_ffw_norm.weight", d_model)
        if n_expert:
            _moe_layer(tw, p, d_model, n_expert, expert_ffn, fused_gate_up)
        if ple:
            tw.matrix(p + "inp_gate.weight", ple, d_model, types["inp_gate"])
            tw.matrix(p + "proj.weight", d_model, ple, types["proj"])
            tw.vector(p + "post_norm.weight", d_model)
        if out_scale:
            tw.vector(p + "layer_output_scale.weight", 1, mean=0.8, std=0.1)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    return tw.write()


def _moe_layer(tw: TinyWriter, p: str, d_model: int, n_expert: int, ff: int, fused_gate_up: bool) -> None:
    """Layer ``p``'s router, its norms and experts (the gate stack's values drawn before the
    up stack's whether they are written fused or apart)."""
    tw.vector(p + "post_ffw_norm_1.weight", d_model)
    tw.vector(p + "pre_ffw_norm_2.weight", d_model)
    tw.vector(p + "post_ffw_norm_2.weight", d_model)
    tw.matrix(p + "ffn_gate_inp.weight", n_expert, d_model, TYPES["ffn_gate_inp"], std=ROUTER_STD)
    tw.vector(p + "ffn_gate_inp.scale", d_model, mean=1.0, std=0.2)
    if fused_gate_up:
        name = p + "ffn_gate_up_exps.weight"
        qtype = tw.type_of(name, TYPES["ffn_gate_up_exps"])
        gate = [random_matrix(qtype, ff, d_model, tw.rng, 1.0 / d_model ** 0.5) for _ in range(n_expert)]
        up = [random_matrix(qtype, ff, d_model, tw.rng, 1.0 / d_model ** 0.5) for _ in range(n_expert)]
        if name not in tw.skip:
            arr = np.stack([np.concatenate([g[0], u[0]]) for g, u in zip(gate, up)])
            tw.counts[qtype] += n_expert * 2 * ff * d_model
            tw.w.add_tensor(name, arr, raw_dtype=gate[0][1])
    else:
        experts(tw, p + "ffn_gate_exps.weight", n_expert, ff, d_model, TYPES["ffn_gate_exps"])
        experts(tw, p + "ffn_up_exps.weight", n_expert, ff, d_model, TYPES["ffn_up_exps"])
    experts(tw, p + "ffn_down_exps.weight", n_expert, d_model, ff, TYPES["ffn_down_exps"])
    tw.vector(p + "ffn_down_exps.scale", n_expert, mean=1.0, std=0.3)


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
