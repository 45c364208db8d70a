"""Tiny llama GGUF files for tests: valid ones with random weights, and broken ones.

``write_tiny_llama(path, qtype=...)`` writes a complete llama model (2 layers,
d_model 64, or 256 for the K types whose blocks hold 256 elements) with the
``gguf`` package's ``GGUFWriter``, so that ``aotx.engine.model.loader.load_model``
loads it end to end: config metadata, a small but real gpt2-style byte-level BPE
tokenizer (the 256 byte symbols, a handful of merges, ChatML control tokens) and
a ChatML chat template. ``weights(path)`` reads back every tensor dequantized to
float64 with ``gguf.quants.dequantize`` (the tests' reference never touches the
engine's kernels).

The ``corrupt_*`` helpers patch a valid file in place at the byte offsets the
``gguf`` reader reports (GGUF v3: magic, version u32, tensor count u64, KV count
u64, KV pairs, tensor infos, padding, data), one defect each.

Not a fixture itself: ``tests/conftest.py`` exposes this module as the
``tiny_gguf`` fixture (pytest runs with ``--import-mode=importlib``). It imports nothing
else from ``tests/models/``, so it can also be loaded alone by path.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

#: Every tensor type the CPU backend must run.
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)

# byte offsets of the float16 scale fields (d, dmin) inside each K block (ggml-common.h)
_K_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few merges over GPT-2 byte-level symbols ("Ġ" is the space byte).
MERGES = ("h e", "Ġ t", "Ġt he", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġ w", "l l", "Ġ h", "he ll",
          "hell o", "Ġ hello")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode table: the 256 printable stand-ins, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocabulary(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of ``vocab`` entries: specials (CONTROL) at 0..2,
    the 256 byte symbols, each merge's result, then unreachable ``[PADn]`` fillers."""
    tokens = list(SPECIALS) + byte_symbols()
    for m in MERGES:
        a, b = m.split(" ")
        tokens.append(a + b)
    if vocab < len(tokens):
        raise ValueError(f"vocab must be at least {len(tokens)}")
    tokens += [f"[PAD{i}]" for i in range(vocab - len(tokens))]
    types = [int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (len(tokens) - 3)
    return tokens, types, list(MERGES)


def random_weight(qtype: T, m: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, T | None]:
    """A random (m, k) weight in ``qtype`` with entries of scale ~1/sqrt(k), as
    ``(array, raw_dtype)`` for ``GGUFWriter.add_tensor``. Types the gguf package cannot
    quantize (the K types, I8, IQ*) get random raw blocks; for the K types their float16
    scales are set so the dequantized weights have std ~1/sqrt(k) (dequantization is
    linear in d and dmin)."""
    std = 1.0 / np.sqrt(k)
    if qtype == T.F32:
        return (rng.standard_normal((m, k)) * std).astype(np.float32), None
    if qtype == T.F16:
        return (rng.standard_normal((m, k)) * std).astype(np.float16), None
    if qtype == T.I8:
        return rng.integers(-127, 128, (m, k), dtype=np.int8), None
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    if k % be:
        raise ValueError(f"{qtype.name} needs k % {be} == 0, got k={k}")
    if qtype in _K_F16_FIELDS:
        nb = k // be
        blocks = rng.integers(0, 256, (m, nb, bb), dtype=np.uint8)
        fields = _K_F16_FIELDS[qtype]
        for off in fields:
            blocks[:, :, off:off + 2] = np.full((m, nb), 1.0, np.float16).view(np.uint8).reshape(m, nb, 2)
        w = gguf.quants.dequantize(blocks.reshape(m, nb * bb), qtype)
        factor = std / max(float(np.std(w)), 1e-12)
        for off in fields:
            scale = (rng.uniform(0.5, 1.5, (m, nb)) * factor).astype(np.float16)
            blocks[:, :, off:off + 2] = scale.view(np.uint8).reshape(m, nb, 2)
        return blocks.reshape(m, nb * bb), qtype
    try:
        w = (rng.standard_normal((m, k)) * std).astype(np.float32)
        return gguf.quants.quantize(w, qtype), qtype
    except NotImplementedError:  # IQ* and friends: random bytes are still valid blocks to the reader
        return rng.integers(0, 256, (m, k // be * bb), dtype=np.uint8), qtype


def default_dims(qtype: T) -> tuple[int, int]:
    """(d_model, ffn) that every row of ``qtype`` can hold: K types need multiples of 256."""
    be = gguf.GGML_QUANT_SIZES[qtype][0]
    return (256, 256) if be >= 256 else (64, 128)


def write_tiny_llama(path: str | Path, *, qtype: T = T.Q8_0, n_layers: int = 2, d_model: int | None = None,
                     n_heads: int = 4, n_kv_heads: int = 2, ffn: int | None = None, vocab: int = 300,
                     seed: int = 0, tied: bool = True, arch: str = "llama", rope_base: float = 10000.0,
                     norm_eps: float = 1e-5, context_length: int = 256, alignment: int | None = None,
                     tensor_types: Mapping[str, T] | None = None, norm_qtype: T = T.F32,
                     skip_tensors: Iterable[str] = (), shapes: Mapping[str, tuple[int, ...]] | None = None,
                     metadata: Mapping[str, Any] | None = None, extra_tensors: Mapping[str, np.ndarray] | None = None,
                     ) -> Path:
    """Write a tiny llama GGUF to ``path`` and return it.

    ``qtype`` is the type of every 2-D weight (token embedding and output included);
    norms are ``norm_qtype`` (F32). Deliberate defects: ``tensor_types`` (name -> type)
    overrides a tensor's type, ``skip_tensors`` leaves tensors out, ``shapes`` (name ->
    numpy shape, i.e. (out, in) for a matrix) writes a tensor with another shape,
    ``metadata`` (key -> value, or None to drop the key) overrides metadata, ``arch``
    renames the architecture (and its key prefix). ``alignment`` writes an explicit
    ``general.alignment`` (to patch later with ``corrupt_alignment``).
    """
    path = Path(path)
    dd, df = default_dims(qtype)
    d_model = d_model or dd
    ffn = ffn or df
    head_dim = d_model // n_heads
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary(vocab)
    tensor_types = dict(tensor_types or {})
    shapes = dict(shapes or {})
    skip = set(skip_tensors)

    kv: dict[str, tuple[Any, V]] = {
        "general.name": ("tiny-llama", V.STRING),
        f"{arch}.context_length": (context_length, V.UINT32),
        f"{arch}.embedding_length": (d_model, V.UINT32),
        f"{arch}.block_count": (n_layers, V.UINT32),
        f"{arch}.feed_forward_length": (ffn, V.UINT32),
        f"{arch}.attention.head_count": (n_heads, V.UINT32),
        f"{arch}.attention.head_count_kv": (n_kv_heads, V.UINT32),
        f"{arch}.rope.freq_base": (float(rope_base), V.FLOAT32),
        f"{arch}.rope.dimension_count": (head_dim, V.UINT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (float(norm_eps), V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("smollm", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.token_type": (types, V.ARRAY),
        "tokenizer.ggml.merges": (merges, V.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, V.UINT32),
        "tokenizer.ggml.padding_token_id": (2, V.UINT32),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL),
        "tokenizer.chat_template": (CHATML, V.STRING),
    }
    for key, val in (metadata or {}).items():
        if val is None:
            kv.pop(key, None)
        elif isinstance(val, tuple) and len(val) == 2 and isinstance(val[1], V):
            kv[key] = val
        else:
            vt = (V.BOOL if isinstance(val, bool) else V.UINT32 if isinstance(val, int) and val >= 0
                  else V.INT32 if isinstance(val, int) else V.FLOAT32 if isinstance(val, float)
                  else V.ARRAY if isinstance(val, list) else V.STRING)
            kv[key] = (val, vt)

    w = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (val, vt) in kv.items():
        if vt == V.ARRAY:
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, vt)

    q_out, kv_out = n_heads * head_dim, n_kv_heads * head_dim
    mats = {"token_embd.weight": (vocab, d_model)}
    for i in range(n_layers):
        p = f"blk.{i}."
        mats.update({p + "attn_q.weight": (q_out, d_model), p + "attn_k.weight": (kv_out, d_model),
                     p + "attn_v.weight": (kv_out, d_model), p + "attn_output.weight": (d_model, q_out),
                     p + "ffn_gate.weight": (ffn, d_model), p + "ffn_up.weight": (ffn, d_model),
                     p + "ffn_down.weight": (d_model, ffn)})
    if not tied:
        mats["output.weight"] = (vocab, d_model)
    vecs = {"output_norm.weight": d_model}
    for i in range(n_layers):
        vecs[f"blk.{i}.attn_norm.weight"] = d_model
        vecs[f"blk.{i}.ffn_norm.weight"] = d_model

    names = ["token_embd.weight"] + [n for n in mats if n.startswith("blk.")]
    order: list[str] = []
    for i in range(n_layers):
        p = f"blk.{i}."
        order += [p + "attn_norm.weight"] + [n for n in names if n.startswith(p)] + [p + "ffn_norm.weight"]
    order = ["token_embd.weight"] + order + ["output_norm.weight"] + (["output.weight"] if not tied else [])
    for name in order:
        if name in skip:
            continue
        if name in mats:
            m, k = shapes.get(name, mats[name])
            arr, raw = random_weight(tensor_types.get(name, qtype), m, k, rng)
        else:
            shp = shapes.get(name, (vecs[name],))
            qt = tensor_types.get(name, norm_qtype)
            v = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
            if qt == T.F32:
                arr, raw = v, None
            elif qt == T.F16:
                arr, raw = v.astype(np.float16), None
            else:
                arr, raw = random_weight(qt, 1, shp[-1], rng)
                arr = arr.reshape(-1)
        w.add_tensor(name, arr, raw_dtype=raw)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def weights(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of ``path`` dequantized to float64, in numpy shape ((out, in) for a
    matrix), through ``gguf.GGUFReader`` and ``gguf.quants.dequantize`` only."""
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = np.asarray(a, np.float64).reshape(tuple(reversed([int(d) for d in t.shape])))
    return out


# ------------------------------------------------------------------ broken files

def patch(path: str | Path, offset: int, data: bytes) -> None:
    """Overwrite ``len(data)`` bytes of ``path`` at ``offset``."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def truncate(path: str | Path, size: int) -> None:
    """Cut ``path`` to its first ``size`` bytes."""
    with open(path, "r+b") as fh:
        fh.truncate(size)


def layout(path: str | Path) -> dict[str, Any]:
    """Byte offsets of the parts of a valid file: ``kv_start`` (24), ``kv_end`` (first
    tensor info), ``data_start``, ``size``, ``kv`` (key -> offset of its value),
    ``tensors`` (name -> dict with ``info`` start, ``dims`` [offset of each u64 dim],
    ``type`` (u32), ``offset`` (u64 relative data offset), ``data`` absolute start, ``n_bytes``)."""
    r = gguf.GGUFReader(path)
    kv = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        # parts: key_len, key, value type, then the value's parts
        kv[name] = f.offset + sum(int(p.nbytes) for p in f.parts[:3])
    tensors = {}
    for t in r.tensors:
        f = t.field
        sizes = [int(p.nbytes) for p in f.parts]
        o = f.offset
        starts = []
        for s in sizes:
            starts.append(o)
            o += s
        dims0 = starts[3]
        tensors[t.name] = {"info": f.offset, "dims": [dims0 + 8 * i for i in range(len(t.shape))],
                           "type": starts[4], "offset": starts[5], "data": int(t.data_offset),
                           "n_bytes": int(t.n_bytes)}
    infos = [v["info"] for v in tensors.values()]
    return {"kv_start": 24, "kv_end": min(infos) if infos else None,
            "data_start": min(v["data"] for v in tensors.values()), "size": Path(path).stat().st_size,
            "kv": kv, "tensors": tensors}


def corrupt_version(path: str | Path, version: int = 99) -> None:
    """Set the GGUF version field (bytes 4..8)."""
    patch(path, 4, struct.pack("<I", version))


def corrupt_alignment(path: str | Path, value: int = 0) -> None:
    """Set ``general.alignment`` (the file must have been written with ``alignment=``)."""
    patch(path, layout(path)["kv"]["general.alignment"], struct.pack("<I", value))


def corrupt_dim(path: str | Path, name: str, axis: int = 0, value: int = 0) -> None:
    """Set dimension ``axis`` (ggml order) of tensor ``name`` in its tensor info."""
    patch(path, layout(path)["tensors"][name]["dims"][axis], struct.pack("<Q", value))


def corrupt_tensor_offset(path: str | Path, name: str, extra: int = 1 << 20) -> None:
    """Move tensor ``name``'s data ``extra`` bytes further, past the end of the file."""
    t = layout(path)["tensors"][name]
    with open(path, "rb") as fh:
        fh.seek(t["offset"])
        cur = struct.unpack("<Q", fh.read(8))[0]
    patch(path, t["offset"], struct.pack("<Q", cur + extra))


def corrupt_tensor_type(path: str | Path, name: str, value: int) -> None:
    """Set tensor ``name``'s ggml type id (u32) to ``value`` (e.g. 200: no such type)."""
    patch(path, layout(path)["tensors"][name]["type"], struct.pack("<I", value))
