"""What every tiny random-weight GGUF writer shares: a real tokenizer copied from a GGUF,
random weights in any tensor type, and a writer that records what it wrote.

Determinism: a file depends only on its writer's arguments (seed included), on numpy's
``Generator`` bit streams and on ``gguf.GGUFWriter``'s byte layout. Quantized weights are
random raw blocks whose float16 (or E8M0) scale fields are set by this module, so no
``gguf.quants.quantize`` rounding enters the bytes; the one measured number (the scale that
gives a matrix the wanted standard deviation) is rounded to 3 significant digits, so a
platform's last-bit differences in a float reduction cannot change the file. The reference
tests (``tests/test_refs_tiny.py``) check every regenerated file's sha256 against the one
recorded with llama.cpp's logits.

Scales: a matrix of input width k gets entries of std ``1/sqrt(k)``, so every sublayer adds
O(1) per feature to the residual stream, more than the embedding (std ``1/sqrt(d_model)``):
attention and the feed-forward network shape the logits, not the token's own embedding.
The final norm's weights are ~3, which spreads the logits (std ~3) so that many positions
have a top-two gap above 0.5, where the reference tests compare the argmax.

Not part of the installed package: tests and ``tests/tools/`` load this folder by path.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

# (byte offset, unit value) of each float16 scale field in one block (ggml-common.h). The
# pairs (d, m/dmin) scale together: dequantization is linear in them jointly. The min
# fields are set so that a matrix's mean is ~0: Q4_1/Q5_1 centre each block (m = -d * mean
# quant), the K types with sub-block mins (Q2_K, Q4_K, Q5_K) take dmin = d * mean quant,
# which cancels on average over the random 4/6-bit sub-block scales and mins.
_F16_FIELDS: dict[T, tuple[tuple[int, float], ...]] = {
    T.Q4_0: ((0, 1.0),), T.Q5_0: ((0, 1.0),), T.Q8_0: ((0, 1.0),), T.IQ4_NL: ((0, 1.0),),
    T.Q4_1: ((0, 1.0), (2, -7.5)), T.Q5_1: ((0, 1.0), (2, -15.5)),
    T.Q2_K: ((80, 1.0), (82, 1.5)), T.Q3_K: ((108, 1.0),), T.Q4_K: ((0, 1.0), (2, 7.5)),
    T.Q5_K: ((0, 1.0), (2, 15.5)), T.Q6_K: ((208, 1.0),), T.IQ4_XS: ((0, 1.0),),
}

#: ``general.file_type`` (llama_ftype) the converter writes for a file mostly of a type.
FILE_TYPE = {T.F32: 0, T.F16: 1, T.Q4_0: 2, T.Q4_1: 3, T.Q8_0: 7, T.Q5_0: 8, T.Q5_1: 9, T.Q2_K: 10,
             T.Q3_K: 12, T.Q4_K: 15, T.Q5_K: 17, T.Q6_K: 18, T.IQ4_NL: 25, T.IQ4_XS: 30, T.BF16: 32,
             T.MXFP4: 38}

# the tokenizer keys copied from a source GGUF, in the order the converter writes them
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)


@dataclass(frozen=True)
class Tokenizer:
    """A GGUF's tokenizer metadata: ``kv`` is ((key, value, GGUFValueType), ...) in file
    order (arrays as tuples), ``n_vocab`` the token count. ``replace(**{key: value})``
    gives a copy with keys changed (value None drops the key)."""

    kv: tuple[tuple[str, Any, V], ...]
    n_vocab: int

    def get(self, key: str) -> Any:
        for k, v, _ in self.kv:
            if k == key:
                return v
        return None

    def replace(self, changes: Mapping[str, Any]) -> Tokenizer:
        kv = []
        seen = set()
        for k, v, t in self.kv:
            if k in changes:
                seen.add(k)
                if changes[k] is None:
                    continue
                v = changes[k]
            kv.append((k, v, t))
        for k, v in changes.items():
            if k not in seen and v is not None:
                kv.append((k, v, _value_type(v)))
        return Tokenizer(tuple(kv), self.n_vocab)


def _value_type(v: Any) -> V:
    if isinstance(v, bool):
        return V.BOOL
    if isinstance(v, int):
        return V.UINT32
    if isinstance(v, float):
        return V.FLOAT32
    if isinstance(v, (list, tuple)):
        return V.ARRAY
    return V.STRING


@functools.lru_cache(maxsize=4)
def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer metadata of the GGUF at ``path`` (every ``tokenizer.*`` key this
    module knows, read with ``gguf.GGUFReader``)."""
    r = gguf.GGUFReader(path)
    kv = []
    for key in _TOKENIZER_KEYS:
        f = r.fields.get(key)
        if f is None:
            continue
        vt = V(int(f.types[0]))
        val = f.contents()
        if vt == V.ARRAY:
            val = tuple(val)
        kv.append((key, val, vt))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return Tokenizer(tuple(kv), n_vocab)


def _sig3(x: float) -> float:
    """``x`` rounded to 3 significant digits (platform-proof scale factors)."""
    return float(f"{x:.3g}")


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_matrix(qtype: T, m: int, k: int, rng: np.random.Generator, std: float) -> tuple[np.ndarray, T | None]:
    """A random (m, k) weight of ``qtype`` whose entries have standard deviation ~``std``,
    as ``(array, raw_dtype)`` for ``GGUFWriter.add_tensor``.

    F32/F16/BF16: normal entries. Block types: random raw blocks with their scale fields
    set (per block, a uniform factor in [0.5, 1.5) times one measured, rounded scale)."""
    if qtype == T.F32:
        return (rng.standard_normal((m, k)) * std).astype(np.float32), None
    if qtype == T.F16:
        return (rng.standard_normal((m, k)) * std).astype(np.float16), None
    if qtype == T.BF16:
        x = (rng.standard_normal((m, k)) * std).astype(np.float32).view(np.uint32)
        bf = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        return bf.view(np.uint8).reshape(m, 2 * k), T.BF16
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    if k % be:
        raise ValueError(f"{qtype.name} needs a row length that is a multiple of {be}, got {k}")
    nb = k // be
    blocks = rng.integers(0, 256, (m, nb, bb), dtype=np.uint8)
    per_block = rng.uniform(0.5, 1.5, (m, nb))
    if qtype == T.MXFP4:  # one E8M0 exponent byte: scale 2**(e - 127); values up to +-6 at e=127
        blocks[:, :, 0] = 127
        unit = float(np.std(gguf.quants.dequantize(blocks.reshape(m, nb * bb), qtype).astype(np.float64)))
        e = np.round(np.log2(std / unit * per_block)).astype(np.int64) + 127
        blocks[:, :, 0] = np.clip(e, 1, 254).astype(np.uint8)
        return blocks.reshape(m, nb * bb), qtype
    fields = _F16_FIELDS.get(qtype)
    if fields is None:
        raise ValueError(f"no random block recipe for {qtype.name}")
    for off, val in fields:
        blocks[:, :, off:off + 2] = _f16_bytes(np.full((m, nb), val))
    unit = float(np.std(gguf.quants.dequantize(blocks.reshape(m, nb * bb), qtype).astype(np.float64)))
    factor = _sig3(std / unit)
    for off, val in fields:
        blocks[:, :, off:off + 2] = _f16_bytes(val * factor * per_block)
    return blocks.reshape(m, nb * bb), qtype


class TinyWriter:
    """A ``gguf.GGUFWriter`` with the habits of the tiny files: metadata through the
    writer's own ``add_*`` helpers (the keys the converter writes), tensors drawn from one
    seeded generator in call order, and deliberate defects for bad-input tests.

    Defects (all optional): ``types`` maps a tensor name or a role (the name without
    ``blk.N.`` and ``.weight``, e.g. ``"attn_q"``) to a tensor type; ``skip`` leaves
    tensors out (their random values are still drawn, so every other tensor keeps its
    bytes: a file without, say, its biases differs from the reference only there);
    ``shapes`` gives a tensor another numpy shape ((out, in) for a matrix);
    ``metadata`` sets (or, with None, drops) metadata keys after everything else."""

    def __init__(self, path: str | Path, arch: str, *, seed: int, name: str,
                 types: Mapping[str, T] | None = None, skip: Iterable[str] = (),
                 shapes: Mapping[str, tuple[int, ...]] | None = None,
                 metadata: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.arch = arch
        self.w = gguf.GGUFWriter(self.path, arch)
        self.rng = np.random.default_rng(seed)
        self.types = dict(types or {})
        self.skip = set(skip)
        self.shapes = dict(shapes or {})
        self.metadata = dict(metadata or {})
        self.counts: Counter[T] = Counter()
        self.w.add_type("model")
        self.w.add_name(name)

    def type_of(self, name: str, default: T) -> T:
        role = name.removesuffix(".weight").removesuffix(".bias")
        if role.startswith("blk."):
            role = role.split(".", 2)[2]
        return self.types.get(name, self.types.get(role, default))

    def decoder_hparams(self, *, n_layers: int, context_length: int, d_model: int, ffn: int, n_heads: int,
                        n_kv_heads: int, rope_base: float, norm_eps: float) -> None:
        """The hyperparameters every llama-style converter writes, in its order (block_count,
        context_length, embedding_length, feed_forward_length, head_count, head_count_kv,
        rope.freq_base, layer_norm_rms_epsilon); an architecture adds its own keys after."""
        w = self.w
        w.add_block_count(n_layers)
        w.add_context_length(context_length)
        w.add_embedding_length(d_model)
        w.add_feed_forward_length(ffn)
        w.add_head_count(n_heads)
        w.add_head_count_kv(n_kv_heads)
        w.add_rope_freq_base(rope_base)
        w.add_layer_norm_rms_eps(norm_eps)

    def tokenizer(self, tok: Tokenizer) -> None:
        for key, val, vt in tok.kv:
            if vt == V.ARRAY:
                self.w.add_array(key, list(val))
            else:
                self.w.add_key_value(key, val, vt)

    def matrix(self, name: str, out: int, inp: int, qtype: T, std: float | None = None) -> None:
        """A weight of numpy shape (out, inp) (ggml {inp, out}), entries of std
        ``std`` (default ``1/sqrt(inp)``)."""
        qtype = self.type_of(name, qtype)
        out, inp = self.shapes.get(name, (out, inp))
        arr, raw = random_matrix(qtype, out, inp, self.rng, std if std is not None else 1.0 / math.sqrt(inp))
        if name in self.skip:  # drawn all the same: skipping a tensor leaves every other one as it was
            return
        self.counts[qtype] += out * inp
        self.w.add_tensor(name, arr, raw_dtype=raw)

    def vector(self, name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        """A float32 vector (a norm weight, a bias) of normal entries."""
        shape = self.shapes.get(name, (n,))
        arr = (mean + std * self.rng.standard_normal(shape)).astype(np.float32)
        if name not in self.skip:
            self.w.add_tensor(name, arr)

    def tensor(self, name: str, arr: np.ndarray) -> None:
        """A tensor given as is (e.g. ``rope_freqs.weight``)."""
        if name not in self.skip:
            self.w.add_tensor(name, arr)

    def write(self) -> Path:
        main = max(self.counts, key=lambda t: (self.counts[t], -int(t))) if self.counts else T.F32
        self.w.add_file_type(FILE_TYPE.get(main, 1024))
        self.w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, val in self.metadata.items():
            if val is None:
                self.w.kv_data[0].pop(key, None)
            elif isinstance(val, tuple) and len(val) == 2 and isinstance(val[1], V):
                self.w.add_key_value(key, val[0], val[1])
            else:
                vt = _value_type(val)
                self.w.add_key_value(key, list(val) if vt == V.ARRAY else val, vt)
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.path


def std_vocab(d_model: int) -> float:
    """Standard deviation of token-embedding and output-matrix entries."""
    return 1.0 / math.sqrt(d_model)
