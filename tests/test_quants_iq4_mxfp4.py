"""IQ4_NL, IQ4_XS and MXFP4 on the CPU: dequantization, QuantMatrix
matmul and embedding rows, and a tiny llama GGUF that mixes them, end to end.

References, none written from our kernels:
* `gguf.quants.dequantize` (the gguf package's numpy decoder): our float32 rows equal it
  bit for bit;
* `_ggml_scalar`, a float64 decoder transcribed element by element from ggml-quants.c's
  `dequantize_row_iq4_nl`, `dequantize_row_iq4_xs`, `dequantize_row_mxfp4` and ggml-impl.h's
  `ggml_e8m0_to_fp32_half`. Every product in these types is exact in float32 (an 11-bit
  float16 mantissa times a 6-bit scale times a 7-bit level, or a power of two times a small
  integer), so rounding the float64 value once to float32 must give our value exactly;
* float64 `x @ W.T` on gguf's dequantized weights for the matmul: relative error < 1e-5
  (the only error is float32 accumulation; observed ~3e-7);
* the float64 llama forward of tests/test_forward.py for the tiny model (< 1e-4).

Inputs are fresh random data each run of a seed: gguf.quants.quantize of normal weights
for MXFP4 (gguf 0.19 can quantize it), random valid blocks byte by byte for IQ4_NL and
IQ4_XS (it cannot), and all-random bytes for MXFP4's edge test (every E8M0 exponent).
"""

from __future__ import annotations

import inspect
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import quants
from aotx.engine.backend.cpu import matmul as cpu_matmul
from aotx.engine.backend.cpu.matmul import QuantMatrix
from aotx.engine.model.batch import Segment
from aotx.engine.model.loader import load_model
from tests.conftest_quant_helpers import make_raw, random_blocks

NEW_TYPES = (T.IQ4_NL, T.IQ4_XS, T.MXFP4)
RTOL = 1e-5

# ggml-common.h, typed in again here so the test does not read the engine's copy
KV_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KV_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, np.float16)[0])


def _e8m0_half(e: int) -> float:
    bits = (0x00200000 << e) if e < 2 else ((e - 1) << 23)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _ggml_scalar(qtype: T, row: bytes) -> np.ndarray:
    """float64 values of one row, following ggml-quants.c's loops element by element."""
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    y: list[float] = []
    for o in range(0, len(row), bb):
        x = row[o:o + bb]
        if qtype == T.IQ4_NL:
            d, qs = _f16(x[0:2]), x[2:18]
            y += [d * KV_IQ4NL[qs[j] & 0xF] for j in range(16)] + [d * KV_IQ4NL[qs[j] >> 4] for j in range(16)]
        elif qtype == T.IQ4_XS:
            d = _f16(x[0:2])
            scales_h = x[2] | (x[3] << 8)
            scales_l, qs = x[4:8], x[8:136]
            for ib in range(8):
                ls = ((scales_l[ib // 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
                dl = d * (ls - 32)
                q = qs[16 * ib:16 * ib + 16]
                y += [dl * KV_IQ4NL[q[j] & 0xF] for j in range(16)] + [dl * KV_IQ4NL[q[j] >> 4] for j in range(16)]
        elif qtype == T.MXFP4:
            d, qs = _e8m0_half(x[0]), x[1:17]
            y += [KV_MXFP4[qs[j] & 0x0F] * d for j in range(16)] + [KV_MXFP4[qs[j] >> 4] * d for j in range(16)]
        else:
            raise AssertionError(qtype)
    return np.array(y, np.float64)


def _gguf(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(-1, k)


def _rel(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_the_three_types_are_supported_with_ggml_block_sizes():
    assert {T.IQ4_NL, T.IQ4_XS, T.MXFP4} <= quants.SUPPORTED_TYPES
    assert T.MXFP4.value == 39 and T.IQ4_NL.value == 20 and T.IQ4_XS.value == 23
    assert quants.block_layout(T.IQ4_NL) == (32, 18)
    assert quants.block_layout(T.IQ4_XS) == (256, 136)
    assert quants.block_layout(T.MXFP4) == (32, 17)
    assert quants.row_bytes(T.MXFP4, 96) == 51          # odd: MXFP4 rows are byte-aligned only


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_and_the_ggml_loops(qtype, seed):
    rng = np.random.default_rng([seed, qtype.value])
    k = int(rng.choice([256, 512, 1280]))
    m = int(rng.integers(1, 40))
    raw = make_raw(qtype, m, k, rng)
    ref = _gguf(raw, qtype, k)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    got = quants.dequantize_rows(raw, qtype, slice(None), k)
    np.testing.assert_array_equal(got, ref)
    ids = rng.integers(-m, m, 7)
    np.testing.assert_array_equal(quants.dequantize_rows(raw, qtype, ids, k), ref[ids])
    for r in {0, m - 1}:
        np.testing.assert_array_equal(got[r], _ggml_scalar(qtype, bytes(raw[r])).astype(np.float32))


def test_mxfp4_every_exponent_byte_equals_ggml():
    """Uniformly random blocks: e = 0, 1 decode to float32 subnormals and e = 255 to 2^127
    (so 2^127 * 6 overflows to inf), exactly as ggml_e8m0_to_fp32_half and gguf do."""
    seed = np.random.SeedSequence().entropy                  # fresh each run, named on failure
    rng = np.random.default_rng(seed)
    raw = random_blocks(T.MXFP4, 64, 32 * 64, rng)
    b = raw.reshape(64, 64, 17)
    b[0, :, 0] = [0, 1, 2, 3, 126, 127, 128, 254, 255] + list(range(4, 59))   # every edge in one row
    with np.errstate(over="ignore"):
        ref = _gguf(raw, T.MXFP4, 32 * 64)
        scalar = _ggml_scalar(T.MXFP4, bytes(raw[0])).astype(np.float32)
    got = quants.dequantize_rows(raw, T.MXFP4, slice(None), 32 * 64)
    np.testing.assert_array_equal(got, ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got[0], scalar, err_msg=f"seed {seed}")
    assert np.isinf(got[0, 8 * 32:9 * 32]).any()                        # e = 255
    assert 0 < np.abs(got[0, :32]).max() <= 12 * 2.0 ** -128              # e = 0: 2^-128 times a level


def test_mxfp4_values_table_in_nibble_order():
    """qs[j] = j | (15 - j) << 4 with e = 128 (scale 1): element j is kvalues_mxfp4[j], element 16 + j
    is kvalues_mxfp4[15 - j] - the E2M1 values doubled: 0, .5, 1, 1.5, 2, 3, 4, 6 times 2."""
    blk = np.array([128] + [j | ((15 - j) << 4) for j in range(16)], np.uint8).reshape(1, 17)
    got = quants.dequantize_rows(blk, T.MXFP4, [0], 32)[0]
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    table = [2 * v for v in e2m1] + [-2 * v for v in e2m1]
    assert got.tolist() == table + table[::-1]


def test_iq4_xs_extreme_sub_block_scales():
    """scales_l/scales_h all ones give ls = 63 (dl = 31 d); all zeros give ls = 0 (dl = -32 d);
    a mix checks which bits of scales_h belong to which sub-block."""
    blocks = np.zeros((3, 136), np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    blocks[:, 8:] = np.tile(np.arange(16, dtype=np.uint8) * 17, 8)          # qs[j] = j | j << 4
    blocks[0, 2:8] = 0xFF
    blocks[2, 2:4] = np.frombuffer(struct.pack("<H", 0b1110010011100100), np.uint8)
    blocks[2, 4:8] = [0x10, 0x32, 0x54, 0x76]
    got = quants.dequantize_rows(blocks, T.IQ4_XS, slice(None), 256)
    np.testing.assert_array_equal(got, _gguf(blocks, T.IQ4_XS, 256))
    kv = np.array(KV_IQ4NL, np.float32)
    np.testing.assert_array_equal(got[0, :16], np.float32(0.5 * 31) * kv)
    np.testing.assert_array_equal(got[1, 240:], np.float32(0.5 * -32) * kv)
    for ib in range(8):                                    # ls = ib | ((ib % 4) << 4)
        ls = ib | ((ib % 4) << 4)
        np.testing.assert_array_equal(got[2, 32 * ib + 16:32 * ib + 32], np.float32(0.5 * (ls - 32)) * kv, err_msg=f"{ib}")


@pytest.mark.parametrize("n", [1, 3, 17, 64])
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_quant_matrix_matmul_and_rows(qtype, n):
    rng = np.random.default_rng([n, qtype.value])
    k = 512 if qtype == T.IQ4_XS else 96 * 3
    m = 75                                                 # not a multiple of the tile (R rows)
    raw = make_raw(qtype, m, k, rng)
    w = _gguf(raw, qtype, k).astype(np.float64)
    for int8 in (False, True):      # int8: cpu_matmul's integer path (int8 activations, llama.cpp's 2e-2)
        qm = QuantMatrix(raw, qtype, m, k, "blk.0.ffn_up.weight", int8=int8)
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = qm.matmul(x)
        assert out.shape == (n, m) and out.dtype == np.float32
        assert _rel(out, x.astype(np.float64) @ w.T) < (2e-2 if qm.int8 else RTOL)
        ids = np.array([0, m - 1, 40, 40, -2])
        np.testing.assert_array_equal(qm.rows(ids), w.astype(np.float32)[ids])
        if not int8:
            assert qm.nbytes == raw.nbytes                 # the float path keeps the file's layout


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_quant_matrix_several_tiles_and_memmap(qtype, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "TILE_FLOATS", 64 * 256)           # 64-row tiles
    monkeypatch.setattr(cpu_matmul, "_local", type(cpu_matmul._local)())
    rng = np.random.default_rng([7, qtype.value])
    m, k = 300, 256
    raw = make_raw(qtype, m, k, rng)
    p = tmp_path / "w.bin"
    raw.tofile(p)
    mm = np.memmap(p, np.uint8, "r", shape=raw.shape)
    qm = QuantMatrix(mm, qtype, m, k, int8=False)         # the float path reads the file's layout
    assert np.shares_memory(qm._raw, mm)
    x = rng.standard_normal((9, k)).astype(np.float32)
    assert _rel(qm.matmul(x), x.astype(np.float64) @ _gguf(raw, qtype, k).astype(np.float64).T) < RTOL


# ------------------------------------------------------------------ a tiny GGUF of these types

MIX = {"token_embd.weight": T.IQ4_NL,
       "blk.0.attn_q.weight": T.IQ4_XS, "blk.0.attn_k.weight": T.MXFP4, "blk.0.attn_v.weight": T.IQ4_NL,
       "blk.0.attn_output.weight": T.MXFP4, "blk.0.ffn_gate.weight": T.IQ4_NL, "blk.0.ffn_up.weight": T.IQ4_XS,
       "blk.0.ffn_down.weight": T.MXFP4,
       "blk.1.attn_q.weight": T.MXFP4, "blk.1.attn_k.weight": T.IQ4_NL, "blk.1.attn_v.weight": T.IQ4_XS,
       "blk.1.attn_output.weight": T.IQ4_NL, "blk.1.ffn_gate.weight": T.IQ4_XS, "blk.1.ffn_up.weight": T.MXFP4,
       "blk.1.ffn_down.weight": T.IQ4_XS}
# float16 d for weights of std ~ 1/sqrt(k): the levels' rms is ~66, IQ4_XS's (ls - 32) ~18.5
_D_FOR_UNIT_STD = {T.IQ4_NL: 1 / 66.0, T.IQ4_XS: 1 / (66.0 * 18.5)}


def write_mixed_model(tiny_gguf, path, seed: int = 0, tensor_types=MIX):
    """tests/models/llama.py's llama (d_model 256, ffn 256, untied Q8_0 output) with the
    `tensor_types` (default MIX). The writer quantizes MXFP4 with gguf and scales the K
    types' random blocks; it writes IQ4_NL/IQ4_XS as random bytes (any float16 d, NaN
    included), so their data is replaced in place by random valid blocks with a sane d,
    at the offsets the gguf reader reports."""
    tiny_gguf.write_tiny_llama(path, qtype=T.Q8_0, d_model=256, ffn=256, tied=False, seed=seed,
                               tensor_types=tensor_types)
    rng = np.random.default_rng(seed + 1)
    lay = tiny_gguf.layout(path)["tensors"]
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type in _D_FOR_UNIT_STD:
            k, m = (int(s) for s in t.shape)
            blocks = random_blocks(t.tensor_type, m, k, rng, scale=_D_FOR_UNIT_STD[t.tensor_type] / np.sqrt(k))
            assert blocks.nbytes == lay[t.name]["n_bytes"]
            tiny_gguf.patch(path, lay[t.name]["data"], blocks.tobytes())
    return path


def new_kv_f32(model, n_slots: int, n_ctx: int):
    """A float32 KV cache (the tolerances here are float32's), also once the float16
    default gives new_kv_cache a kv_type argument."""
    if "kv_type" in inspect.signature(model.new_kv_cache).parameters:
        return model.new_kv_cache(n_slots, n_ctx, kv_type="f32")
    return model.new_kv_cache(n_slots, n_ctx)


def test_tiny_gguf_with_the_new_types_loads_and_matches_the_float64_forward(tiny_gguf, tmp_path):
    from tests.test_forward import TOKENS, reference_logits, rel_err

    p = write_mixed_model(tiny_gguf, tmp_path / "iq4-mxfp4.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(p).tensors}
    assert {types[n] for n in MIX} == set(NEW_TYPES)
    W = tiny_gguf.weights(p)
    assert all(np.isfinite(a).all() for a in W.values())
    lm = load_model(p, int8_activations=False)
    ref = reference_logits(W, lm.gguf.metadata, TOKENS)
    kv = new_kv_f32(lm.model, 1, len(TOKENS))
    got = lm.model.forward(np.asarray(TOKENS, np.int32), [Segment(0, 0, len(TOKENS), all_logits=True)], kv)
    assert got.shape == ref.shape and rel_err(got, ref) < 1e-4
    kv = new_kv_f32(lm.model, 1, len(TOKENS))             # decode rows, one at a time
    for i, t in enumerate(TOKENS[:3]):
        row = lm.model.forward(np.array([t], np.int32), [Segment(0, i, 1)], kv)
        assert rel_err(row[0], ref[i]) < 1e-4
