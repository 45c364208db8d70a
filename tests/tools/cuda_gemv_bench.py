"""Decode GEMV bandwidth on this GPU at the 7B/8B shapes (issue 19, item 1): the variant
the kernel choice runs by default next to the other variants (warps per pair, pairs per warp), in GB/s of weight bytes
read, against the copy bandwidth measured in the same process; and a bit comparison of the
two on every site (batch invariance: they must agree exactly); then the same for the
int8-activation form (``quant_rows`` + gemv Q8, both in the timing), its best against the
float best, and its relative distance from the float outputs. ``--fp16``: also the fp16 form
(``quant_rows_h`` + ``gemv_h``, half2 weights dequantized in registers, HFMA2; both in the
timing) next to the float and int8 bests, its relative distance from the float outputs, and a
table of the three forms last; the float and int8 candidates are then the kernel choice's
(``gemv_candidates``: no four-pairs-per-warp forms) to keep the compile short.

Each site's weight is replicated into enough copies (>= 256 MB in all) that one timed pass
over the copies reads from HBM, not the 60 MB L2; the pass is one captured CUDA graph (as
the decode tick runs them), so host launch cost is not in the figures. Random blocks with
sane float16 scales (the values do not matter for timing). ``--src FILE``: also time the
kernels of another cuda_src.py (e.g. ``git show HEAD~1:engine/backend/cuda/source.py``) in
the same process, the default variant of each site, and compare their bits. A
device-machine script, never run by CI:
``python -m tests.tools.cuda_gemv_bench [--quick] [--batches 1,4] [--src FILE] [--fp16]``.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.backend import CudaBackend, _u64
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
H_PPW = (1, 2)           # gemv_h's pairs per warp (PPW 2 only at NB <= 4)


def h_buffers(rows: int, k: int) -> tuple:
    """Scratch for ``rows`` rows of fp16 activations of ``k`` inputs (``quant_rows_h``): xh
    (rows, ldh) uint16, ldh = k rounded up to 1024 (the lane-interleaved layout of 32 blocks
    of 32), and xd (rows, 4 ldd) float32 (a float4 per block: scale, two half sums, 0),
    ldd = ldh / 32."""
    ldh = max(1024, (int(k) + 1023) // 1024 * 1024)
    return cp.zeros((max(1, rows), ldh), cp.uint16), cp.zeros((max(1, rows), ldh // 8), cp.float32)


def h_instance(ta: int, tb: int, mode: int, v: CC.GemvVariant) -> str:
    return f"gemv_h<{ta},{tb},{v.nb},{mode},{v.wpp},{v.ppw}>"


def h_variants(B: int, norm: bool, m: int, k: int) -> list[CC.GemvVariant]:
    """gemv_h variants at batch B: the int8 form's default first (the norm scale precomputed),
    then every WPP and PPW of that NB."""
    d = CC.GemvVariant.parse(CC.gemv_default(B, norm, m, k, True))
    d = CC.GemvVariant(d.nb, d.wpp, d.pre, 1)
    return [d] + [CC.GemvVariant(d.nb, w, d.pre, p) for w in CC.GEMV_GRID[d.nb]
                  for p in (H_PPW if d.nb <= 4 else (1,)) if (w, p) != (d.wpp, 1)]


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


def candidates(B: int, norm: bool, m: int, k: int, lean: bool = False) -> tuple[CC.GemvVariant, list[CC.GemvVariant]]:
    """The default variant at batch B and the others worth comparing (same NB and norm place;
    ``lean``: the pairs per warp the kernel choice times, 1 and 2)."""
    d = CC.GemvVariant.parse(CC.gemv_default(B, norm, m, k))
    out = []
    for wpp in CC.GEMV_GRID[d.nb]:
        for ppw in CC.PPW_GRID[d.nb]:
            if lean and ppw > 2:
                continue
            v = CC.GemvVariant(d.nb, wpp, d.pre, ppw)
            if v != d:
                out.append(v)
    return d, out


def main() -> int:
    quick = "--quick" in sys.argv
    fp16 = "--fp16" in sys.argv
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
    names, plan = plan_names(batches, fp16)
    t0 = time.perf_counter()
    kern = compile_all(be, names)
    print(f"{len(names)} kernels compiled (or loaded from CuPy's cache) in {time.perf_counter() - t0:.1f} s")
    if other is not None:
        from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS

        onames = sorted({CC.gemv_instance(int(site[1]), int(site[2] or site[1]), site[3], vs[0])
                         for site, _, vs, *_ in plan}
                        | {"row_scale"})
        omod = cp.RawModule(code=other.SRC, options=NVRTC_OPTIONS, name_expressions=onames)
        okern = {n: omod.get_function(n) for n in onames}
    gbs_copy = copy_gbs()
    print(f"copy bandwidth {gbs_copy:,.0f} GB/s (read + write of 1 GiB, 10 copies)")
    print("GB/s of weights read per variant (first: the default); * = fastest; bits: every variant equals the default")
    cache = {}
    table = []
    for (name, ta, tb, mode, m, k, norm), B, vs, vs8, vsh in plan:
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

        from aotx.engine.backend.cuda.matrix import q8_buffers

        xq, xd = q8_buffers(B, k)
        ldq = xq.shape[1]
        xh, xhd = h_buffers(B, k)
        ldh = xh.shape[1]

        def go(v, w, y, kern=kern, q8=False, h=False):
            wa = w[0]
            wb = w[1] if len(w) > 1 else w[0]
            if mode == S.MODE_SWIGLU:
                n_pairs, a_stride, b_off = m, 1, 0
            else:
                n_pairs, a_stride, b_off = (m + 1) // 2, 2, 1
            z = np.int32(0)
            ppb = v.pairs_per_block
            if h:        # fp16: quant_rows_h, then gemv_h (both timed)
                kern["quant_rows_h"]((B, (k + 127) // 128), (128,),
                                     (_u64(x), np.int32(k), np.int32(k), _u64(nw), np.float32(1e-5), _u64(xs),
                                      _u64(xh), np.int32(ldh), _u64(xhd), np.int32(ldh // 32)))
                kern[h_instance(int(ta), int(wb.qtype), mode, v)](
                    ((n_pairs + ppb - 1) // ppb, (B + v.nb - 1) // v.nb), (128,),
                    (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes),
                     np.int32(a_stride), np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(xh), np.int32(ldh),
                     np.int32(B), _u64(nw), np.float32(1e-5), _u64(xs if norm else None), _u64(None),
                     _u64(None), _u64(y), np.int32(width)) + (z,) * 8 + (_u64(None),) * 6
                    + (_u64(xhd), np.int32(ldh // 32)))
                return
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

        def timed(v, kern=kern, q8=False, h=False):
            st = cp.cuda.Stream(non_blocking=True)
            with st:
                go(v, mats[0], y, kern, q8, h)
                st.begin_capture()
                for w in mats:
                    go(v, w, y, kern, q8, h)
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
        if not vsh:
            continue
        # fp16 (quant_rows_h + gemv_h): every variant's bits against its default's
        outsh = []
        for v in vsh:
            y[...] = 0
            go(v, mats[0], y, kern, h=True)
            outsh.append(y.copy())
        sameh = all(bool((o.view(cp.uint32) == outsh[0].view(cp.uint32)).all()) for o in outsh[1:])
        relh = float(cp.linalg.norm(outsh[0] - outs[0]) / cp.linalg.norm(outs[0]))
        gh = [timed(v, kern, h=True) for v in vsh]
        bh = max(range(len(vsh)), key=lambda i: gh[i])
        cellsh = " ".join(f"{v.name}{'*' if i == bh else ''} {gh[i]:,.0f}" for i, v in enumerate(vsh))
        print(f"{name} b{B} fp16: {cellsh} | best {gh[bh] / g[best]:.2f}x the float best, {gh[bh] / g8[b8]:.2f}x the "
              f"int8 best, {100 * gh[bh] / gbs_copy:.0f}% of copy | {'same' if sameh else 'DIFFER'} | "
              f"rel to float {relh:.2e}", flush=True)
        table.append((f"{name} b{B}", g[best], vs[best].name, g8[b8], vs8[b8].name, gh[bh], vsh[bh].name, rel, relh,
                      same and same8 and sameh))
    if table:
        print(f"\nbest GB/s per form (copy {gbs_copy:,.0f} GB/s); rel = ||y - y_float|| / ||y_float||; "
              "bits: every variant of each form equals its default")
        print(f"{'site':<20} {'float32':>16} {'int8':>16} {'fp16':>18} {'%copy':>6} {'/f32':>5} {'/int8':>5} "
              f"{'rel int8':>9} {'rel fp16':>9} bits")
        for site, gf, nf, g8_, n8, gh_, nh, r8, rh, ok in table:
            pct = 100 * gh_ / gbs_copy
            print(f"{site:<20} {gf:>7,.0f} {nf:<8} {g8_:>7,.0f} {n8:<8} {gh_:>7,.0f} {nh:<10} {pct:>5.0f}% "
                  f"{gh_ / gf:>5.2f} {gh_ / g8_:>5.2f} {r8:>9.1e} {rh:>9.1e} {'same' if ok else 'DIFFER'}")
    return 0


def _compile_part(args) -> tuple:
    """One NVRTC program (in a worker process): (cubin or PTX, {instance: lowered name})."""
    src, names, options, kind = args
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(src, "cuda_gemv_bench.cu", [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    nvrtc.compileProgram(prog, list(options))
    code = nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
    return code, {n: nvrtc.getLoweredName(prog, n) for n in names}


_PARTS: list = []        # the modules compile_all loaded (kept alive with their kernels)


def compile_all(be, names, jobs: int = 0) -> dict:
    """name -> kernel for these instances, compiled as ``jobs`` NVRTC programs in worker
    processes (NVRTC is single-threaded: the ~230 instances of ``--fp16`` take about 2 minutes
    as one program on one core), with the options and -arch CuPy itself would use; on any
    failure, one ``compile_module`` (CuPy's own compile and disk cache). The module: the
    engine's kernels, and ``tests/tools/gemv_h.cu`` after them (``gemv_h.module()``)."""
    import multiprocessing as mp
    import os
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    from aotx.engine.backend.cuda.backend import compile_module
    from tests.tools import gemv_h

    names = sorted(names)
    module = gemv_h.module()
    src = module.text
    jobs = jobs or max(1, min(12, (os.cpu_count() or 1) - 1))
    try:
        from cupy.cuda import compiler

        from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS

        arch, kind = compiler._get_arch_for_options_for_nvrtc()
        parts = [names[i::jobs] for i in range(jobs) if names[i::jobs]]
        with ProcessPoolExecutor(len(parts), mp_context=mp.get_context("spawn")) as ex:
            res = list(ex.map(_compile_part, [(src, p, tuple(NVRTC_OPTIONS) + (arch,), kind) for p in parts]))
        tmp = tempfile.mkdtemp(prefix="gemv_bench_")
        kern = {}
        for i, (code, lowered) in enumerate(res):
            path = os.path.join(tmp, f"part{i}.{kind}")
            with open(path, "wb") as f:
                f.write(code if isinstance(code, bytes) else code.encode())
            mod = cp.RawModule(path=path)
            _PARTS.append(mod)
            for n, low in lowered.items():
                kern[n] = mod.get_function(low)
        return kern
    except Exception as e:  # noqa: BLE001 - any failure of the parallel path: the plain one
        print(f"parallel compile failed ({type(e).__name__}: {e}); one NVRTC program instead", flush=True)
        return compile_module(module, names)


def plan_names(batches, fp16: bool) -> tuple[set, list]:
    """The template instances to compile and the plan: (site, B, float variants, int8
    variants, fp16 variants (empty without ``fp16``)) per site and batch."""
    names = {"row_scale", "quant_rows"} | ({"quant_rows_h"} if fp16 else set())
    plan = []
    for site in SITES:
        name, ta, tb, mode, m, k, norm = site
        tb = tb or ta
        for B in batches:
            d, others = candidates(B, norm, m, k, lean=fp16)
            vs = [d] + others
            for v in vs:
                names.add(CC.gemv_instance(int(ta), int(tb), mode, v))
            d8 = CC.GemvVariant.parse(CC.gemv_default(B, norm, m, k, True))
            vs8 = [d8] + [CC.GemvVariant(d8.nb, w, True, p) for w in CC.GEMV_GRID[d8.nb] for p in CC.PPW_GRID[d8.nb]
                          if (w, p) != (d8.wpp, d8.ppw) and not (fp16 and p > 2)]
            for v in vs8:
                names.add(CC.gemv_instance(int(ta), int(tb), mode, v, True))
            vsh = h_variants(B, norm, m, k) if fp16 else []
            for v in vsh:
                names.add(h_instance(int(ta), int(tb), mode, v))
            plan.append((site, B, vs, vs8, vsh))
    return names, plan


if __name__ == "__main__":
    sys.exit(main())
