"""The CUDA backend's ``deq8<T>`` specializations, compiled as host C++ and run on the CPU,
against gguf.quants.dequantize bit for bit (every type in ``cuda_src.TYPES``).

Why: CI and most development machines have no GPU, while ``deq8`` is plain integer and
float code. The test takes ``cuda_src.SRC`` up to the end of the deq8 section, as text,
and compiles it with g++ under a few host stand-ins for the CUDA pieces it uses:
``h2f`` (PTX ``cvt.f32.f16`` there, decoded from the bits here), ``__byte_perm`` (PTX
``prmt`` in its default mode, sign replication of a selector's bit 3 included),
``__uint_as_float`` and the vector types ``uint2``/``uint4``/``float4`` with CUDA's
alignments (8, 16, 16). The program runs under UndefinedBehaviorSanitizer's alignment
check on a 256-byte aligned buffer, as CuPy allocates: a load wider than its block's
alignment allows (an error on the GPU) fails here too. Every deq8 product is exact in
float32, so the values must equal gguf's exactly.

What it cannot see: the GPU's own compiler and scheduling, and the kernels around deq8
(tests/test_cuda_quants.py checks those on a GPU). Skips without g++.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cuda import source as cuda_src
from tests.conftest_quant_helpers import make_raw, random_blocks

END = "// ---- end of the deq8 specializations ----"

SHIMS = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
// PTX prmt.b32 (default mode): byte n of the result is byte (s >> 4n) & 7 of {y, x}; where
// bit 3 of that selector nibble is set, the byte's sign bit replicated instead
static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int n = 0; n < 4; n++) {
        unsigned int c = (s >> (4 * n)) & 15, b = (unsigned int)(v >> (8 * (c & 7))) & 255;
        if (c & 8) b = (b & 128) ? 255 : 0;
        r |= b << (8 * n);
    }
    return r;
}
static inline float host_h2f(unsigned short h) {   // IEEE binary16 -> float, exact
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}
"""

MAIN = r"""
int main(int argc, char** argv) {
    // deq <type> <row_bytes> <m> <k> <in> <out>: every row of W dequantized, 8 inputs per deq8 call
    int t = atoi(argv[1]); long long rb = atoll(argv[2]); int m = atoi(argv[3]), k = atoi(argv[4]);
    size_t nbytes = (size_t)rb * m;
    u8* W = (u8*)aligned_alloc(256, (nbytes + 255) / 256 * 256);
    float* out = (float*)malloc(sizeof(float) * (size_t)m * k);
    FILE* f = fopen(argv[5], "rb");
    if (fread(W, 1, nbytes, f) != nbytes) return 3;
    fclose(f);
    for (int r = 0; r < m; r++)
        for (int u = 0; u < k / 8; u++) {
            float* w = out + (size_t)r * k + 8 * u;
            switch (t) {
%CASES%
            default: return 4;
            }
        }
    f = fopen(argv[6], "wb");
    fwrite(out, sizeof(float), (size_t)m * k, f);
    fclose(f);
    return 0;
}
"""


def host_source() -> str:
    """cuda_src.SRC up to the end of the deq8 section, with the host stand-ins."""
    src = cuda_src.SRC
    assert END in src, "cuda_src.SRC lost its end-of-deq8 marker"
    dev = src[:src.index(END)]
    dev, n = re.subn(r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(f\) : "h"\(h\)\);', "f = host_h2f(h);", dev)
    assert n == 1, "h2f in cuda_src.SRC changed: update the host stand-in here"
    cases = "\n".join(f"            case {c}: deq8<{c}>(W + r * rb, u, w); break;" for c in cuda_src.TYPES)
    return SHIMS + dev + MAIN.replace("%CASES%", cases)


@pytest.fixture(scope="module")
def deq_exe(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on PATH: the host build of the CUDA deq8 source needs a C++ compiler")
    d = tmp_path_factory.mktemp("deq8")
    (d / "deq.cpp").write_text(host_source())
    cmd = [gxx, "-std=c++17", "-O1", "-w", "-fsanitize=alignment,undefined", "-fno-sanitize-recover=all",
           str(d / "deq.cpp"), "-o", str(d / "deq")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode and "sanitize" in r.stderr and "cannot find" in r.stderr:
        pytest.skip(f"g++ has no UBSan runtime: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def run_deq(d, qtype: T, raw: np.ndarray, m: int, k: int) -> np.ndarray:
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    (d / "in.bin").write_bytes(b.tobytes())
    rb = b.size // m
    r = subprocess.run([str(d / "deq"), str(int(qtype)), str(rb), str(m), str(k), str(d / "in.bin"),
                        str(d / "out.bin")], capture_output=True, text=True)
    assert r.returncode == 0, f"deq8<{int(qtype)}> ({qtype.name}): exit {r.returncode}\n{r.stderr[-3000:]}"
    return np.fromfile(d / "out.bin", np.float32).reshape(m, k)


def _reference(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    if qtype == T.F32:
        return np.asarray(raw, np.float32)
    with np.errstate(over="ignore"):
        return gguf.quants.dequantize(raw, qtype).reshape(-1, k)


CUDA_TYPES = [T(c) for c in cuda_src.TYPES]


def test_cuda_types_include_the_k_quants_iq4_and_mxfp4():
    assert {T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4} <= set(CUDA_TYPES)


@pytest.mark.parametrize("qtype", CUDA_TYPES, ids=lambda t: t.name)
def test_deq8_equals_gguf(deq_exe, qtype):
    rng = np.random.default_rng([qtype.value, 11])
    be = gguf.GGML_QUANT_SIZES[qtype][0]
    # an odd number of blocks per row, so rows of 18-, 22-, 110- and 17-byte blocks start
    # at the weakest alignment the type allows
    k = 768 if be == 256 else 32 * 13
    m = 6
    raw = make_raw(qtype, m, k, rng)
    np.testing.assert_array_equal(run_deq(deq_exe, qtype, raw, m, k), _reference(raw, qtype, k))


def test_deq8_mxfp4_every_exponent(deq_exe):
    """Random bytes: e = 0, 1 give float32 subnormal scales, e = 255 gives 2^127 (inf after
    the level), as ggml_e8m0_to_fp32_half."""
    seed = np.random.SeedSequence().entropy                  # fresh each run, named on failure
    rng = np.random.default_rng(seed)
    raw = random_blocks(T.MXFP4, 16, 32 * 33, rng)
    raw.reshape(16, 33, 17)[0, :, 0] = list(range(0, 4)) + list(range(126, 131)) + list(range(231, 255))
    raw.reshape(16, 33, 17)[1, :4, 0] = [255, 0, 1, 254]
    got = run_deq(deq_exe, T.MXFP4, raw, 16, 32 * 33)
    ref = _reference(raw, T.MXFP4, 32 * 33)
    np.testing.assert_array_equal(got, ref, err_msg=f"seed {seed}")
    assert np.isinf(got[1, :32]).any() and 0 < np.abs(got[1, 32:64]).max() < 2.0 ** -124

