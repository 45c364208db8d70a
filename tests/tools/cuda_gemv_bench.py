"""Decode GEMV bandwidth on this GPU at the 7B/8B shapes (issue 19, item 1): the variant
the kernel choice runs by default next to the other variants (warps per pair, pairs per warp), in GB/s of weight bytes
read, against the copy bandwidth measured in the same process; and a bit comparison of the
two on every site (batch invariance: they must agree exactly); then the same for the
int8-activation form (``quant_rows`` + gemv Q8, both in the timing), its best against the
float best, and its relative distance from the float outputs.

Each site's weight is replicated into enough copies (>= 256 MB in all) that one timed pass
over the copies reads from HBM, not the 60 MB L2; the pass is one captured CUDA graph (as
the decode tick runs them), so host launch cost is not in the figures. Random blocks with
sane float16 scales (the values do not matter for timing). ``--src FILE``: also time the
kernels of another cuda_src.py (e.g. ``git show HEAD~1:engine/backend/cuda_src.py``) in
the same process, the default variant of each site, and compare their bits. A
device-machine script, never run by CI:
``python -m tests.tools.cuda_gemv_bench [--quick] [--batches 1,4] [--src FILE]``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import cuda_choice as CC
from aotx.engine.backend import cuda_src as S
from aotx.engine.backend.cuda import CudaBackend, _u64
from tests.conftest_quant_helpers import random_blocks

# (name, type A, type B (SwiGLU), mode, output rows m, inputs k, norm)
SITES = (
    ("qkv Q4_K", T.Q4_K, None, S.MODE_STORE, 6144, 4096, True),
    ("attn_out Q4_K", T.Q4_K, None, S.MODE_ADD, 4096, 4096, False),
    ("gate/up Q4_K", T.Q4_K, T.Q4_K, S.MODE_SWIGLU, 14336, 4096, True),
    ("down Q4_K", T.Q4_K, None, S.MODE_ADD, 4096, 14336, False),
    ("down Q6_K", T.Q6_K, None, S.MODE_ADD, 4096, 14336, False),
    ("head Q6_K", T.Q6_K, None, S.MODE_STORE, 49152, 4096, True),
)
POOL = 256 << 20


def copy_gbs() -> float:
    a = cp.empty(1 << 30, cp.uint8)
    b = cp.empty_like(a)
    cp.copyto(b, a)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(10):
        cp.copyto(b, a)
    e1.record()
    e1.synchronize()
    return 2 * 10 * a.nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9


def candidates(B: int, norm: bool, m: int, k: int) -> tuple[CC.GemvVariant, list[CC.GemvVariant]]:
    """The default variant at batch B and the others worth comparing (same NB and norm place)."""
    d = CC.GemvVariant.parse(CC.gemv_default(B, norm, m, k))
    out = []
    for wpp in CC.GEMV_GRID[d.nb]:
        for ppw in CC.PPW_GRID[d.nb]:
            v = CC.GemvVariant(d.nb, wpp, d.pre, ppw)
            if v != d:
                out.append(v)
    return d, out


def main() -> int:
    quick = "--quick" in sys.argv
    other = None
    if "--src" in sys.argv:
        import importlib.util

        spec = importlib.util.spec_from_file_location("other_src", sys.argv[sys.argv.index("--src") + 1])
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    be = CudaBackend()
    rng = np.random.default_rng(0)
    batches = (1, 4) if quick else (1, 4, 16)
    if "--batches" in sys.argv:
        batches = tuple(int(b) for b in sys.argv[sys.argv.index("--batches") + 1].split(","))
    names = {"row_scale", "quant_rows"}
    plan = []
    for site in SITES:
        name, ta, tb, mode, m, k, norm = site
        tb = tb or ta
        for B in batches:
            d, others = candidates(B, norm, m, k)
            vs = [d] + others
            for v in vs:
                names.add(CC.gemv_instance(int(ta), int(tb), mode, v))
            d8 = CC.GemvVariant.parse(CC.gemv_default(B, norm, m, k, True))
            vs8 = [d8] + [CC.GemvVariant(d8.nb, w, True, p) for w in CC.GEMV_GRID[d8.nb] for p in CC.PPW_GRID[d8.nb]
                          if (w, p) != (d8.wpp, d8.ppw)]
            for v in vs8:
                names.add(CC.gemv_instance(int(ta), int(tb), mode, v, True))
            plan.append((site, B, vs, vs8))
    kern = be.module(sorted(names))
    if other is not None:
        from aotx.engine.backend.cuda import NVRTC_OPTIONS

        onames = sorted({CC.gemv_instance(int(site[1]), int(site[2] or site[1]), site[3], vs[0]) for site, _, vs, _ in plan}
                        | {"row_scale"})
        omod = cp.RawModule(code=other.SRC, options=NVRTC_OPTIONS, name_expressions=onames)
        okern = {n: omod.get_function(n) for n in onames}
    gbs_copy = copy_gbs()
    print(f"copy bandwidth {gbs_copy:,.0f} GB/s (read + write of 1 GiB, 10 copies)")
    print("GB/s of weights read per variant (first: the default); * = fastest; bits: every variant equals the default")
    cache = {}
    for (name, ta, tb, mode, m, k, norm), B, vs, vs8 in plan:
        if name not in cache:
            tb2 = tb or ta
            one = []
            for t in ((ta, tb2) if mode == S.MODE_SWIGLU else (ta,)):
                raw = random_blocks(t, m, k, rng)
                one.append(be.matrix(SimpleNamespace(name="w", qtype=t, shape=(k, m), data=raw)))
            per = sum(int(w.m * w.row_bytes) for w in one)
            n = max(2, -(-POOL // per))
            mats = [[SimpleNamespace(data=w.data.copy(), row_bytes=w.row_bytes, m=w.m, qtype=w.qtype) for w in one]
                    for _ in range(n)]
            nw = cp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32)) if norm else None
            cache[name] = (mats, per, nw)
        mats, per, nw = cache[name]
        x = cp.asarray(rng.standard_normal((B, k)).astype(np.float32))
        width = m if mode == S.MODE_SWIGLU else m + 1
        xs = cp.empty(B, cp.float32)
        if norm:
            kern["row_scale"]((B,), (128,), (_u64(x), np.int32(k), np.int32(k), np.float32(1e-5), _u64(xs)))
        y = cp.zeros((B, width), cp.float32)

        from aotx.engine.backend.cuda_matrix import q8_buffers

        xq, xd = q8_buffers(B, k)
        ldq = xq.shape[1]

        def go(v, w, y, kern=kern, q8=False):
            wa = w[0]
            wb = w[1] if len(w) > 1 else w[0]
            if mode == S.MODE_SWIGLU:
                n_pairs, a_stride, b_off = m, 1, 0
            else:
                n_pairs, a_stride, b_off = (m + 1) // 2, 2, 1
            z = np.int32(0)
            ppb = v.pairs_per_block
            if q8:       # int8 activations: quant_rows, then the Q8 GEMV (both timed, as the engine runs them)
                kern["quant_rows"]((B, (k + 127) // 128), (128,),
                                   (_u64(x), np.int32(k), np.int32(k), _u64(nw), np.float32(1e-5), _u64(xs), _u64(xq),
                                    np.int32(ldq), _u64(xd), np.int32(ldq // 32)))
                kern[CC.gemv_instance(int(ta), int(wb.qtype), mode, v, True)](
                    ((n_pairs + ppb - 1) // ppb, (B + v.nb - 1) // v.nb), (128,),
                    (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes),
                     np.int32(a_stride), np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(xq), np.int32(ldq),
                     np.int32(B), _u64(nw), np.float32(1e-5), _u64(xs if norm else None), _u64(None),
                     _u64(None), _u64(y), np.int32(width)) + (z,) * 8 + (_u64(None),) * 6
                    + (_u64(xd), np.int32(ldq // 32)))
                return
            kern[CC.gemv_instance(int(ta), int(wb.qtype), mode, v)](
                ((n_pairs + ppb - 1) // ppb, (B + v.nb - 1) // v.nb), (128,),
                (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes),
                 np.int32(a_stride), np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(x), np.int32(k),
                 np.int32(B), _u64(nw), np.float32(1e-5), _u64(xs if (norm and v.pre) else None), _u64(None),
                 _u64(None), _u64(y), np.int32(width)) + (z,) * 8 + (_u64(None),) * 6 + (_u64(None), z))

        outs = []
        for v in vs:
            y[...] = 0
            go(v, mats[0], y)
            outs.append(y.copy())
        same = all(bool((o.view(cp.uint32) == outs[0].view(cp.uint32)).all()) for o in outs[1:])

        def timed(v, kern=kern, q8=False):
            st = cp.cuda.Stream(non_blocking=True)
            with st:
                go(v, mats[0], y, kern, q8)
                st.begin_capture()
                for w in mats:
                    go(v, w, y, kern, q8)
                graph = st.end_capture()
                graph.launch(st)
                st.synchronize()
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(st)
                for _ in range(5):
                    graph.launch(st)
                e1.record(st)
                e1.synchronize()
            return per / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / (5 * len(mats))) / 1e9

        g = [timed(v) for v in vs]
        if other is not None:
            y[...] = 0
            go(vs[0], mats[0], y, okern)
            osame = bool((y.view(cp.uint32) == outs[0].view(cp.uint32)).all())
            go_ = timed(vs[0], okern)
            print(f"{name} b{B}: --src {vs[0].name} {go_:,.0f} GB/s, this source {g[0]:,.0f} ({g[0] / go_:.2f}x),"
                  f" {'same bits' if osame else 'BITS DIFFER'}")
        best = max(range(len(vs)), key=lambda i: g[i])
        cells = " ".join(f"{v.name}{'*' if i == best else ''} {g[i]:,.0f}" for i, v in enumerate(vs))
        print(f"{name} b{B}: {cells} | best {g[best] / g[0]:.2f}x default, {100 * g[best] / gbs_copy:.0f}% of copy"
              f" | {'same' if same else 'DIFFER'}", flush=True)
        # int8 activations (quant_rows + Q8 GEMV): every variant's bits against its default's
        f32 = y.copy()
        outs8 = []
        for v in vs8:
            y[...] = 0
            go(v, mats[0], y, kern, True)
            outs8.append(y.copy())
        same8 = all(bool((o.view(cp.uint32) == outs8[0].view(cp.uint32)).all()) for o in outs8[1:])
        rel = float(cp.linalg.norm(outs8[0] - outs[0]) / cp.linalg.norm(outs[0]))
        g8 = [timed(v, kern, True) for v in vs8]
        b8 = max(range(len(vs8)), key=lambda i: g8[i])
        cells8 = " ".join(f"{v.name}{'*' if i == b8 else ''} {g8[i]:,.0f}" for i, v in enumerate(vs8))
        print(f"{name} b{B} int8: {cells8} | best {g8[b8] / g[best]:.2f}x the float best, "
              f"{100 * g8[b8] / gbs_copy:.0f}% of copy | {'same' if same8 else 'DIFFER'} | rel to float {rel:.2e}",
              flush=True)
        del f32
    return 0


if __name__ == "__main__":
    sys.exit(main())
