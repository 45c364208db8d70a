"""The op set (engine/backend/ops.py), the CPU kernels behind it and the CPU program
executor, against float64 numpy written from the op definitions (tests/program_reference.py
and the formulas below), plus the f16 KV cache and its capsules.

References: RoPE as ggml's rope_yarn with ext_factor 0 (angle = pos * freq_scale *
base^(-2j/dim) / ff[j], cos/sin times attn_factor; "normal" pairs (2j, 2j+1), "neox" pairs
(j, j + dim/2)); GELU's tanh form with ggml's constants; sliding-window attention as
llama.cpp's LLAMA_SWA_TYPE_STANDARD mask (position t hidden from p when p - t >= window).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cpu import attention as cpu_attention
from aotx.engine.backend.cpu import ops as cpu_ops
from aotx.engine.backend.cpu.matmul import QuantMatrix
from aotx.engine.backend.cpu.program import CpuProgram
from aotx.engine.backend.ops import ProgramBuilder, ProgramError, RopeSpec
from aotx.engine.model.batch import BatchLayout, Segment

HERE = Path(__file__).resolve().parent


def _program_reference():
    mod = sys.modules.get("aotx_tests_program_reference")
    if mod is None:
        spec = importlib.util.spec_from_file_location("aotx_tests_program_reference", HERE / "program_reference.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def f32_matrix(rng, m: int, k: int, name: str) -> QuantMatrix:
    w = (rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float32)
    return QuantMatrix(w, T.F32, m, k, name)


# ------------------------------------------------------------------ RoPE

def _angles(spec: RopeSpec, n_ctx: int) -> np.ndarray:
    j = np.arange(spec.dim // 2)
    ff = np.ones(spec.dim // 2) if spec.factors_for(n_ctx) is None else np.asarray(spec.factors_for(n_ctx))
    return np.arange(n_ctx)[:, None] * spec.freq_scale * spec.base ** (-2.0 * j / spec.dim)[None, :] / ff


def test_rope_tables_follow_ggml_formula_with_factors_and_attn_factor():
    ff = tuple(np.linspace(1.0, 8.0, 8))
    spec = RopeSpec("neox", 16, 500000.0, freq_scale=0.25, attn_factor=1.19, freq_factors=ff)
    cos, sin = spec.tables(300)
    ang = _angles(spec, 300)
    np.testing.assert_allclose(cos, 1.19 * np.cos(ang), rtol=0, atol=2e-7)
    np.testing.assert_allclose(sin, 1.19 * np.sin(ang), rtol=0, atol=2e-7)
    plain = RopeSpec("neox", 16, 500000.0)
    assert not np.allclose(plain.tables(300)[1], sin)     # each field changes the numbers


def test_long_factors_apply_past_the_original_context():
    short, long = (1.0,) * 4, (2.0, 3.0, 4.0, 5.0)
    spec = RopeSpec("neox", 8, 10000.0, freq_factors=short, long_factors=long, long_ctx=64)
    assert spec.factors_for(64) == short and spec.factors_for(65) == long
    assert not np.allclose(spec.tables(64)[1][:10], spec.tables(65)[1][:10])


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_kernels_rotate_the_right_pairs(mode):
    rng = np.random.default_rng(1)
    hd, dim, n = 32, 24, 7                   # partial rotary: the last 8 dims pass through
    spec = RopeSpec(mode, dim, 10000.0)
    x = rng.standard_normal((n, 3, hd)).astype(np.float32)
    pos = np.array([0, 1, 5, 17, 99, 3, 64], np.int32)
    cos, sin = spec.tables(128)
    got = x.copy()
    (cpu_ops.rope_inplace if mode == "normal" else cpu_ops.rope_neox_inplace)(got, pos, cos, sin)
    ref = _program_reference()._rope(x.reshape(n, -1).astype(np.float64), spec, hd, pos, 128).reshape(n, 3, hd)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(got[:, :, dim:], x[:, :, dim:])
    # the two modes differ (a kernel of the wrong mode would pass the other's test)
    other = x.copy()
    (cpu_ops.rope_neox_inplace if mode == "normal" else cpu_ops.rope_inplace)(other, pos, cos, sin)
    assert np.abs(other - got).max() > 0.1


# ------------------------------------------------------------------ norms, activations

def test_head_rms_norm_normalizes_each_head_of_a_strided_view():
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((5, 4 * 16 + 2 * 16)).astype(np.float32) * 3
    w = rng.standard_normal(16).astype(np.float32)
    q = qkv[:, :64].reshape(5, 4, 16)        # a column block of a fused QKV output
    ref = q.astype(np.float64) / np.sqrt(np.mean(q.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * w
    rest = qkv[:, 64:].copy()
    cpu_ops.head_rms_norm(q, w, 1e-6)
    np.testing.assert_allclose(qkv[:, :64].reshape(5, 4, 16), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(qkv[:, 64:], rest)


def test_gelu_tanh_mul_matches_float64():
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((4, 300)) * 4).astype(np.float32)
    u = rng.standard_normal((4, 300)).astype(np.float32)
    out = np.empty_like(g)
    cpu_ops.gelu_tanh_mul(g, u, out)
    g64 = g.astype(np.float64)
    ref = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    silu = np.empty_like(g)
    cpu_ops.silu_mul(g, u, silu)
    assert np.abs(silu - out).max() > 0.01   # a different activation


# ------------------------------------------------------------------ attention

def _attend64(q, kc, vc, slots, lengths, scale, window):
    """float64 reference: row b attends to its slot's positions [lo, length)."""
    B, H, hd = q.shape
    KV = kc.shape[1]
    out = np.zeros((B, H, hd))
    for b in range(B):
        T_ = int(lengths[b])
        lo = max(0, T_ - window) if window > 0 else 0
        for h in range(H):
            g = h // (H // KV)
            k = kc[slots[b], g, lo:T_].astype(np.float64)
            s = scale * (k @ q[b, h])
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vc[slots[b], g, lo:T_].astype(np.float64)
    return out


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("window", [0, 5, 40])
def test_attention_rows_window_and_f16_cache(kv_type, window):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 6, 16)).astype(np.float32)
    kc = rng.standard_normal((3, 2, 48, 16)).astype(np.float32)
    vc = rng.standard_normal((3, 2, 48, 16)).astype(np.float32)
    if kv_type == "f16":
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)   # the values the cache holds
    slots = np.array([2, 0, 1, 2], np.int32)
    lengths = np.array([1, 9, 48, 30], np.int32)
    store = (lambda a: a.view(np.uint16)) if kv_type == "f16" else (lambda a: a)
    out = np.empty_like(q)
    cpu_attention.attention_rows(q, store(kc), store(vc), slots, lengths, 0.3, window, out)
    ref = _attend64(q, kc, vc, slots, lengths, 0.3, window)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    if window:
        assert np.abs(ref - _attend64(q, kc, vc, slots, lengths, 0.3, 0)).max() > 1e-3


@pytest.mark.parametrize("window", [0, 4, 11])
def test_attention_prefill_rows_with_window(window):
    rng = np.random.default_rng(5)
    n, pos0 = 9, 6
    q = rng.standard_normal((n, 4, 8)).astype(np.float32)
    kc = rng.standard_normal((1, 2, 32, 8)).astype(np.float32)
    vc = rng.standard_normal((1, 2, 32, 8)).astype(np.float32)
    got = np.empty_like(q)
    cpu_attention.attention_rows(q, kc, vc, np.zeros(n, np.int32), np.arange(pos0 + 1, pos0 + n + 1, dtype=np.int32),
                                 0.5, window, got)
    ref = _attend64(q, kc, vc, np.zeros(n, np.int32), np.arange(pos0 + 1, pos0 + n + 1), 0.5, window)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ the Program and its executor

def test_builder_refuses_inconsistent_programs():
    rng = np.random.default_rng(6)
    W = f32_matrix(rng, 40, 16, "embd")
    b = ProgramBuilder()
    x = b.embed(W)
    with pytest.raises(ProgramError, match="takes 32 inputs"):
        b.linear(x, f32_matrix(rng, 8, 32, "w"))
    with pytest.raises(ProgramError, match="partition"):
        b.split(x, (10, 10))
    with pytest.raises(ProgramError, match="rope dim"):
        b.rope(x, RopeSpec("neox", 10, 1e4), 8)
    with pytest.raises(ProgramError, match="before take_rows"):
        r = b.take_rows(x)
        b.attention(r, r, r, n_heads=2, n_kv_heads=2, head_dim=8, scale=1.0)
    with pytest.raises(ProgramError, match="first op"):
        b.embed(W)


def _toy_program(rng, window: int = 0):
    """A program that exercises every op, a value read after an elementwise op could have
    overwritten it (x0 below), fused-QKV views and two RoPE specs."""
    d, H, KV, hd, f, vocab = 32, 4, 2, 8, 48, 50
    b = ProgramBuilder()
    emb = f32_matrix(rng, vocab, d, "token_embd")
    x0 = b.embed(emb, scale=2.0)
    x = x0
    for i in range(2):
        h = b.rms_norm(x, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), 1e-5)
        bias = (0.1 * rng.standard_normal(H * hd + 2 * KV * hd)).astype(np.float32)
        wqkv = f32_matrix(rng, H * hd + 2 * KV * hd, d, f"qkv{i}")
        q, k, v = b.split(b.linear(h, wqkv, bias), (H * hd, KV * hd, KV * hd))
        q = b.head_rms_norm(q, rng.standard_normal(hd).astype(np.float32), 1e-6, hd)
        spec = RopeSpec("neox" if i else "normal", hd, 100.0 + i, attn_factor=1.1)
        q, k = b.rope(q, spec, hd), b.rope(k, spec, hd)
        a = b.attention(q, k, v, n_heads=H, n_kv_heads=KV, head_dim=hd, scale=0.3, window=window if i == 0 else 0)
        x = b.add(b.scale(b.linear(a, f32_matrix(rng, d, H * hd, f"o{i}")), 0.5), x)
        if i == 1:
            x = b.add(x, x0)                      # x0 read again: nothing may have overwritten it
            x = b.take_rows(x)
        g, u = b.split(b.linear(x, f32_matrix(rng, 2 * f, d, f"gu{i}")), (f, f))
        x = b.add(x, b.linear(b.glu(g, u, "gelu_tanh" if i else "silu"), f32_matrix(rng, d, f, f"down{i}")))
    logits = b.softcap(b.linear(x, emb), 3.0)
    return b.finish(logits)


@pytest.mark.parametrize("window", [0, 3])
def test_cpu_program_matches_float64_interpreter(window):
    rng = np.random.default_rng(7)
    prog = _toy_program(rng, window)
    cp = CpuProgram(prog)
    toks = rng.integers(0, 50, 21).astype(np.int32)
    ref = _program_reference().reference_logits(prog, toks)
    kv = cp.new_kv_cache(2, 32, "f32")
    got = cp.forward(toks, BatchLayout.of([Segment(1, 0, 21, all_logits=True)]), kv)
    assert rel_err(got, ref) < 1e-5
    # the same rows as decode steps, a short verify window and a chunk, in another slot
    kv = cp.new_kv_cache(2, 32, "f32")
    rows = []
    for a, c in [(0, 17), (17, 18), (18, 21)]:
        seg = Segment(0, a, c - a, all_logits=True)
        rows.append(cp.forward(toks[a:c], BatchLayout.of([seg]), kv))
    assert rel_err(np.concatenate(rows), ref) < 1e-5
    # buffers are reused across calls: a second identical call gives identical numbers
    kv2 = cp.new_kv_cache(2, 32, "f32")
    again = cp.forward(toks, BatchLayout.of([Segment(1, 0, 21, all_logits=True)]), kv2)
    np.testing.assert_array_equal(again, got)


def test_cpu_program_embeds_replace_rows_unscaled():
    """embed: token rows are scale * table row; caller embeddings replace rows as given."""
    rng = np.random.default_rng(8)
    table = f32_matrix(rng, 50, 16, "token_embd")
    b = ProgramBuilder()
    x = b.take_rows(b.embed(table, scale=2.0))
    prog = b.finish(b.linear(x, QuantMatrix(np.eye(16, dtype=np.float32), T.F32, 16, 16, "identity")))
    cp = CpuProgram(prog)
    toks = np.array([3, 10_000, 10_001, 7], np.int32)      # placeholders past the vocabulary
    values = rng.standard_normal((2, 16)).astype(np.float32)
    out = cp.forward(toks, BatchLayout.of([Segment(0, 0, 4, all_logits=True)]), cp.new_kv_cache(1, 8),
                     embeds=(np.array([1, 2], np.int64), values))
    rows = table.rows(np.arange(50))
    np.testing.assert_allclose(out[[0, 3]], 2.0 * rows[[3, 7]], rtol=1e-6)
    np.testing.assert_allclose(out[1:3], values, rtol=1e-6)


# ------------------------------------------------------------------ the f16 KV cache

def test_f16_cache_stores_round_to_nearest_even_and_snapshots_float16():
    rng = np.random.default_rng(9)
    prog = _toy_program(rng)
    cp = CpuProgram(prog)
    toks = rng.integers(0, 50, 12).astype(np.int32)
    kv16 = cp.new_kv_cache(1, 16, "f16")
    kv32 = cp.new_kv_cache(1, 16, "f32")
    lay = BatchLayout.of([Segment(0, 0, 12, all_logits=True)])
    cp.forward(toks, lay, kv32)
    out16 = cp.forward(toks, lay, kv16)
    # layer 0's K depends only on the embedding: the f16 cache holds exactly its rounding
    np.testing.assert_array_equal(kv16.k[0][0, :, :12], kv32.k[0][0, :, :12].astype(np.float16).view(np.uint16))
    k, v = kv16.snapshot_slot(0, 12)
    assert k.dtype == np.float16 and k.shape == (2, 2, 12, 8)
    assert kv16.kv_type == "f16" and kv32.kv_type == "f32"
    assert cp.kv_cache_bytes(3, 100, "f16") * 2 == cp.kv_cache_bytes(3, 100, "f32")
    with pytest.raises(ValueError, match="cannot restore"):
        kv32.restore_slot(0, k, v, 12)
    ref = _program_reference().reference_logits(prog, toks)
    assert 1e-6 < rel_err(out16, ref) < 5e-3       # f16 rounding shows, within half-precision error


def test_capsules_record_kv_type_and_refuse_another(tmp_path):
    from aotx.engine.state import capsule as C

    rng = np.random.default_rng(10)
    prog = _toy_program(rng)
    cp = CpuProgram(prog)
    toks = rng.integers(0, 50, 9).astype(np.int32)
    kv16 = cp.new_kv_cache(2, 16, "f16")
    cp.forward(toks, BatchLayout.of([Segment(0, 0, 9)]), kv16)
    cap = C.snapshot(kv16, 0, toks.tolist(), fingerprint="fp")
    assert cap.header.kv_type == "f16" and "kv:f16:" in cap.header.layout and cap.k.dtype == np.float16
    C.save(cap, tmp_path / "c.caps")
    back = C.load(tmp_path / "c.caps")
    assert back.k.dtype == np.float16 and back.k.tobytes() == cap.k.tobytes()
    C.restore(back, kv16, 1, fingerprint="fp")
    np.testing.assert_array_equal(kv16.k[1][1, :, :9], kv16.k[1][0, :, :9])
    kv32 = cp.new_kv_cache(2, 16, "f32")
    with pytest.raises(C.CapsuleError, match=r"holds f16 KV.*is f32.*--kv-type f16"):
        C.restore(back, kv32, 0, fingerprint="fp")
    assert not kv32.k[0].any()                       # a refused restore writes nothing


def test_capsule_cache_skips_a_disk_capsule_of_another_kv_type(tmp_path):
    """Bug guard: an engine restarted with another --kv-type found its old disk capsules
    and the restore raised inside the tick; now the lookup passes them over, saying why."""
    from aotx.engine.state import capsule as C
    from aotx.engine.state.cache import CapsuleCache

    rng = np.random.default_rng(11)
    cp = CpuProgram(_toy_program(rng))
    toks = rng.integers(0, 50, 9).astype(np.int32)
    kv32 = cp.new_kv_cache(1, 16, "f32")
    cp.forward(toks, BatchLayout.of([Segment(0, 0, 9)]), kv32)
    C.save(C.snapshot(kv32, 0, toks.tolist(), fingerprint="fp"), tmp_path / "conv1.caps")
    cache = CapsuleCache(tmp_path, fingerprint="fp", kv_type="f16")
    cap, n, note = cache.best_for("conv1", toks.tolist() + [1])
    assert cap is None and "holds f32 KV" in note and "f16" in note
    C.save(C.snapshot(kv32, 0, toks.tolist(), fingerprint="fp"), tmp_path / "conv1.caps")
    same = CapsuleCache(tmp_path, fingerprint="fp", kv_type="f32")
    cap, n, note = same.best_for("conv1", toks.tolist() + [1])
    assert cap is not None and n == 9


def test_bug_a_disk_capsule_of_other_numerics_is_re_prefilled_not_restored(tmp_path):
    """Bug guard: capsules on disk were matched by model and KV type only, so an engine that
    computes with other arithmetic (CUDA's int8 decode kernels on a large model where the
    capsule's engine ran float32, or a CPU capsule on CUDA) restored KV its own prefill would
    not have written, and the reply was not the one a fresh prefill gives. Now the header
    names the numerics and the lookup passes a mismatch over, saying why (older capsules,
    without the field, too); the same numerics restore."""
    from aotx.engine.state import capsule as C
    from aotx.engine.state.cache import CapsuleCache

    rng = np.random.default_rng(12)
    cp = CpuProgram(_toy_program(rng))
    toks = rng.integers(0, 50, 9).astype(np.int32)
    kv = cp.new_kv_cache(1, 16, "f32")
    cp.forward(toks, BatchLayout.of([Segment(0, 0, 9)]), kv)
    C.save(C.snapshot(kv, 0, toks.tolist(), fingerprint="fp", numerics="cuda-f32"), tmp_path / "conv1.caps")
    other = CapsuleCache(tmp_path, fingerprint="fp", kv_type="f32", numerics="cuda-int8")
    cap, n, note = other.best_for("conv1", toks.tolist() + [1])
    assert cap is None and "cuda-f32" in note and "cuda-int8" in note and "re-prefilling" in note
    C.save(C.snapshot(kv, 0, toks.tolist(), fingerprint="fp"), tmp_path / "conv1.caps")      # no numerics
    cap, n, note = CapsuleCache(tmp_path, fingerprint="fp", numerics="cpu-int8").best_for("conv1", toks.tolist())
    assert cap is None and "earlier version" in note
    C.save(C.snapshot(kv, 0, toks.tolist(), fingerprint="fp", numerics="cpu-int8"), tmp_path / "conv1.caps")
    cap, n, note = CapsuleCache(tmp_path, fingerprint="fp", numerics="cpu-int8").best_for("conv1", toks.tolist() + [1])
    assert cap is not None and n == 9 and cap.header.numerics == "cpu-int8"


def test_f16_cache_reads_every_finite_half_exactly_and_inf_as_inf():
    """attention over one position returns that position's V: all 63,488 finite float16
    bit patterns (subnormals included) come back as their exact float32 values (-0 as +0:
    the sum starts at +0), and inf as inf."""
    pats = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    halves = pats.view(np.float16)
    keep = np.isfinite(halves)
    vals = np.concatenate([pats[keep], np.array([0x7C00, 0xFC00] * 32, np.uint16)])   # + inf, -inf
    vals = vals[: vals.size // 64 * 64].reshape(-1, 1, 1, 64)                            # (slots, KV, T, hd)
    n = vals.shape[0]
    q = np.ones((n, 1, 64), np.float32)
    out = np.empty_like(q)
    cpu_attention.attention_rows(q, np.zeros_like(vals), vals, np.arange(n, dtype=np.int32), np.ones(n, np.int32),
                                 1.0, 0, out)
    want = vals.reshape(n, 64).view(np.float16).astype(np.float32) + np.float32(0.0)   # -0 -> +0
    assert np.array_equal(out.reshape(n, 64).view(np.uint32), want.view(np.uint32))
