"""The MMQ's reduction order is the int8 decode GEMV's, bit for bit (a CPU proof of the kernel's plan).

``engine/backend/cuda/kernels/mmq.cu`` computes each output of the int8 GEMV (``gemv.cu``,
Q8 1) on tensor cores: the exact integer dot products of a block from ``mma.sync``, then
the same float tail, lane sums and butterfly tree, visited in the tree's leaf order with a
stack of pending subtree sums. ``tests/tools/mmq_model.py`` writes both orders in numpy
float32 as the kernels write them; these tests check, on random data of every type with an
integer form and row lengths that give a lane 0, 1, 2, 3 or 4 blocks:

* the model's weight blocks mean what gguf dequantizes (levels, scales, offsets);
* its fused multiply-add rounds once (against exact rational arithmetic);
* the MMQ's order gives every output the GEMV's bits, and the GEMV model's butterfly is
  ``tests/test_cuda_reduction_model.py``'s;
* the check has teeth: plain left-to-right sums, or the lanes visited in their natural order
  with the same stack, give other bits on the same data.

Then the host code on fake CuPy (``tests/tools/gpu_dryrun_mmq.py`` in a subprocess, as
``tests/test_cuda_host.py`` runs the dry run): every Gemv launch of a model, through the int8
GEMV and through the MMQ, emulated with this model, gives the same bits.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.conftest_quant_helpers import make_raw
from tests.test_cuda_reduction_model import warp_sum as reduction_model_warp_sum
from tests.tools import mmq_model as M

ROOT = Path(__file__).resolve().parents[1]
f32 = np.float32
TYPES = tuple(M.Q8_TRAITS)


def _raw(qtype: T, m: int, k: int, rng) -> np.ndarray:
    raw = np.ascontiguousarray(make_raw(qtype, m, k, rng)).view(np.uint8).reshape(m, -1)
    if qtype == T.MXFP4:                       # finite scales (random bytes reach 2^127)
        raw.reshape(m, -1, 17)[:, :, 0] = rng.integers(118, 130, (m, k // 32))
    return raw


def _terms(qtype: T, m: int, k: int, B: int, seed: int, norm: bool = False):
    rng = np.random.default_rng(seed)
    w = M.q8_weights(_raw(qtype, m, k, rng), qtype, k)
    x = (rng.standard_normal((B, k)) * rng.uniform(0.1, 10.0, (B, 1))).astype(f32)
    x[0, 32:64] = 0.0                           # a block of zeros: scale 0, levels 0
    nw = rng.uniform(0.5, 1.5, k).astype(f32) if norm else None
    xq, dx, sx, _ = M.quant_rows(x, nw)
    return M.block_terms(w, qtype, xq, dx, sx)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_q8_blocks_mean_what_gguf_dequantizes(qtype):
    rng = np.random.default_rng(int(qtype))
    k = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 96
    raw = _raw(qtype, 7, k, rng)
    got = M.dequant_from_q8(M.q8_weights(raw, qtype, k))
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(7, k)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(got, ref, rtol=2e-7, atol=1e-30)


def _round_f32(x: Fraction) -> np.float32:
    """The float32 nearest the rational ``x`` (ties to even), exactly."""
    f = np.float32(float(x))
    best = None
    for c in (np.nextafter(f, f32(-np.inf)), f, np.nextafter(f, f32(np.inf))):
        d = abs(Fraction(float(c)) - x)
        even = (int(np.asarray(c, f32).view(np.uint32)) & 1) == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    return best[1]


def test_fma32_rounds_once_like_fmaf():
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(4000) * 10.0 ** rng.integers(-3, 4, 4000)).astype(f32)
    b = (rng.standard_normal(4000) * 10.0 ** rng.integers(-3, 4, 4000)).astype(f32)
    c = (rng.standard_normal(4000) * 10.0 ** rng.integers(-3, 4, 4000)).astype(f32)
    # float64 rounding lands the sum on a float32 tie that the exact value is not on:
    # (1 + 2^-15)(1 - 2^-15) 2^-24 = 2^-24 - 2^-54, plus 1 + 2^-23 (odd): float64 gives
    # 1 + 3 2^-24 (a tie, to even: 1 + 2^-22), the exact value lies below it (1 + 2^-23)
    for i, sgn in enumerate((1.0, -1.0, 1.0, -1.0)):
        a[i], b[i] = f32(sgn * (1 + 2.0 ** -15) * 2.0 ** -24), f32(1 - 2.0 ** -15)
        c[i] = f32(sgn * (1 + 2.0 ** -23) * (2.0 ** (4 * i)))
        a[i] = f32(a[i] * f32(2.0 ** (4 * i)))
    naive = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)
    got = M.fma32(a, b, c)
    assert (naive[:4] != got[:4]).all(), "the constructed ties did not arise"
    for i in range(len(a)):
        want = _round_f32(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        assert got[i].tobytes() == np.float32(want).tobytes(), (i, a[i], b[i], c[i])


@pytest.mark.parametrize("k", (256, 4352, 9216, 14336), ids=lambda k: f"k{k}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_mmq_order_gives_every_output_the_int8_gemvs_bits(qtype, k):
    """256 inputs: lanes 8..127 add nothing; 4352: lanes 0..7 two blocks; 9216: lanes 0..63
    three; 14336 (Llama-3.1-8B's FFN): lanes 0..63 four, the rest three."""
    if k % gguf.GGML_QUANT_SIZES[qtype][0]:
        pytest.skip("not a whole number of blocks")
    m, B = (8, 3) if k > 4352 else (16, 5)
    terms = _terms(qtype, m, k, B, seed=k + int(qtype), norm=bool(k % 2))
    assert np.isfinite(terms).all()
    g = M.gemv_sums(terms)
    assert g.shape == (m, B)
    for split in (1, 2, 4):                     # one warp set, or 2 / 4 sharing each group's leaves
        q = M.mmq_sums(terms, split)
        bad = int((g.view(np.uint32) != q.view(np.uint32)).sum())
        assert bad == 0, f"split {split}: {bad} of {g.size} outputs differ between the GEMV's order and the MMQ's"


def test_the_gemv_models_butterfly_is_the_reduction_models():
    rng = np.random.default_rng(11)
    for _ in range(50):
        vals = (rng.standard_normal(32) * 10.0 ** rng.integers(-4, 5, 32)).astype(f32)
        assert M.warp_sum(vals).tobytes() == reduction_model_warp_sum(vals)[0].tobytes()


def test_the_stack_forms_the_butterfly_tree_with_signed_zeros_and_empty_lanes():
    """Lanes that add nothing push +0; a lane whose only block is -0 pushes +0 (0 + -0), as
    the GEMV's accumulator starts at 0: outputs whose every term is -0 are +0 in both."""
    terms = np.full((2, 3, 8), -0.0, f32)       # k = 256: 8 blocks, lanes 8..127 empty
    terms[1, 1, 3] = 1.5
    g = M.gemv_sums(terms)
    for split in (1, 2, 4):
        assert g.tobytes() == M.mmq_sums(terms, split).tobytes()
    assert g[0, 0].tobytes() == f32(0.0).tobytes() and g[1, 1] == f32(1.5)


def test_other_orders_give_other_bits_on_the_same_data():
    """The check above has teeth: the plain sequential sum, and the MMQ's stack fed the lanes
    in their natural order, each differ from the GEMV's bits on many outputs."""
    terms = _terms(T.Q4_K, 32, 14336, 4, seed=5)
    g = M.gemv_sums(terms)
    seq = np.zeros(g.shape, f32)
    for u in range(terms.shape[-1]):
        seq = (seq + terms[..., u]).astype(f32)
    assert int((seq.view(np.uint32) != g.view(np.uint32)).sum()) > g.size // 4
    saved = M.bitrev5
    try:
        M.bitrev5 = lambda p: p                # natural lane order, same stack
        wrong = M.mmq_sums(terms)
    finally:
        M.bitrev5 = saved
    assert int((wrong.view(np.uint32) != g.view(np.uint32)).sum()) > g.size // 4
    # four warp sets whose subtree sums are added left to right ((P0 + P1) + P2) + P3, not as
    # the tree's top levels: other bits too
    assert int((M.mmq_sums(terms, 4, chain=True).view(np.uint32) != g.view(np.uint32)).sum()) > g.size // 8


def test_host_code_on_fake_cupy_gives_the_int8_gemvs_bits_through_the_mmq():
    """tests/tools/gpu_dryrun_mmq.py: the MMQ and the int8 GEMV launched by the program's own
    launch code (Gemv.launch) on fake CuPy, both emulated from device memory by the model."""
    p = subprocess.run([sys.executable, "-m", "tests.tools.gpu_dryrun_mmq"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "mmq dry run OK" in p.stdout


def test_the_mmq_is_off_unless_aotx_mmq_min_rows_turns_it_on():
    """No card has run the MMQ yet: the backend's default leaves it off, and the variable
    that turns it on takes a row count or 'off' and names itself when it is anything else."""
    from aotx.engine.backend.cuda import mmq as MQ

    assert MQ.min_rows_from_env(None) is None and MQ.min_rows_from_env(" Off ") is None
    assert MQ.min_rows_from_env("") is None
    assert MQ.min_rows_from_env("16") == 16 and MQ.min_rows_from_env("1") == 1
    for bad in ("0", "-4", "sixteen", "1.5"):
        with pytest.raises(ValueError, match="AOTX_MMQ_MIN_ROWS"):
            MQ.min_rows_from_env(bad)
