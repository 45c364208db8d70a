"""Kernel choice for one CudaProgram: its sites, and how a candidate is checked and timed.

Owns: ``resolve_choices(prog)``, called once by ``CudaProgram.__init__``: the sites of the
program (every distinct GEMV shape at every batch bucket of ``choice.TUNE_BUCKETS``,
every distinct prefill GEMM), handed to ``kernel_choice.resolve`` with the backend's
policy, device key and artifact path; the result fills ``prog._gv`` (GEMV variant per
(site, bucket)) and ``prog._pm`` (GEMM mode per prefill site).

When the policy times sites (``auto`` without a valid artifact, ``force``), ``_Tuner``
compiles every candidate once (one NVRTC module, kept in ``prog._tune_k`` so the program
does not compile them again) and, per candidate:
* check: one launch on fixed random inputs; a GEMV variant must give the same bits as
  the site's default variant (output rows and, for QKV, the K/V it writes): batch
  invariance depends on it; a GEMM mode must be within ``choice.PREFILL_TOL`` of
  float32 (relative Frobenius norm);
* measure: a CUDA graph of launches over up to ``TUNE_LAYERS`` of the site's matrices
  (different layers: weights stream from memory as in a forward, not from L2), replayed
  after a warm-up between CUDA events; seconds per launch. GEMMs: 512 rows, events
  around ``GEMM_REPS`` calls.

Leaves the decision and the artifact to ``kernel_choice``, the candidates to
``choice.py``, the launches to ``steps.py`` (``Gemv.launch``) and ``gemm.py``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend import kernel_choice as KC

TUNE_LAYERS = 8          # matrices of one site per timed graph (distinct layers)
GRAPH_BYTES = 96 << 20   # a timed graph reads at least this many weight bytes (repeats the layers when small)
MAX_REPS = 16
GEMM_ROWS = 512          # prefill rows for timing a GEMM mode
CHECK_ROWS = 64          # rows for checking a GEMM mode against float32
GEMM_REPS = 3
# within the timing budget: every site at batch 1 first (decode), then the aggregate buckets, ...
BUCKET_PRIORITY = {1: 8, 64: 7, 16: 6, 128: 5, 32: 4, 8: 3, 2: 2, 4: 1}


def resolve_choices(prog) -> KC.Resolution:
    """Resolve every kernel site of ``prog`` (see the module docstring)."""
    be = prog.backend
    groups: dict[str, list] = {}
    for g in prog.gemvs:
        groups.setdefault(g.site, []).append(g)
    tuner = _Tuner(prog, groups)
    sites: list[KC.Site] = []
    if prog._forced_gemv is None:
        for site, gs in groups.items():
            norm = gs[0].nw is not None
            nbytes = sum(g.weight_bytes for g in gs)
            for b in CC.TUNE_BUCKETS:
                key = CC.at_bucket(site, b)
                dflt = CC.gemv_default(b, norm, gs[0].m_rows, gs[0].k, gs[0].q8)
                sites.append(KC.Site(key, CC.gemv_candidates(b, norm, gs[0].q8), dflt,
                                     measure=tuner.gemv_measure(site, b), check=tuner.gemv_check(site, b),
                                     weight=BUCKET_PRIORITY.get(b, 0) * 1e15 + nbytes))
    if prog._forced_prefill is None:
        for key, d in prog.psites.items():
            nbytes = sum(int(w.nbytes) for w in d["weights"])
            sites.append(KC.Site(key, CC.prefill_candidates(d["bounded"]), CC.prefill_default(d["bounded"]),
                                 measure=tuner.gemm_measure(key), check=tuner.gemm_check(key),
                                 weight=4.5e15 + nbytes))   # after the decode buckets 1, 64, 16, 128
    path = be.artifact_path()
    key = be.device_key() if path is not None else KC.DeviceKey("", "", "", "", "")
    # the candidates compile before the budget's clock starts: NVRTC's time is not the timing's
    res = KC.resolve(sites, key, path, be.tune, budget_s=be.tune_budget_s, prepare=tuner.kernels)
    if prog._forced_gemv is None:
        for site in groups:
            for b in CC.TUNE_BUCKETS:
                prog._gv[(site, b)] = CC.GemvVariant.parse(res.choice[CC.at_bucket(site, b)])
    if prog._forced_prefill is None:
        for k in prog.psites:
            prog._pm[k] = res.choice[k]
    prog._tune_k = tuner.kernels_if_built()
    tuner.close()
    return res


class _Ctx:
    """What ``_Gemv.launch`` reads from a context, for tuning launches."""

    __slots__ = ("kv", "rope", "slot_p", "pos_p", "xs", "xq", "xd")


class _Tuner:
    """Lazily built inputs, kernels and stream for checking and timing candidates."""

    def __init__(self, prog, groups: dict[str, list]):
        self.prog = prog
        self.groups = groups
        self._k: dict | None = None
        self._k_error: Exception | None = None
        self._ready = False
        self._ref: dict = {}

    # ---- set-up -------------------------------------------------------------------------------

    def kernels(self) -> dict:
        if self._k_error is not None:
            raise self._k_error        # compiled once: a failure is not retried for every candidate
        if self._k is None:
            from aotx.engine.backend.cuda.gemm import PrefillGemm
            from aotx.engine.backend.cuda import source as S

            names = {"row_scale", "quant_rows"}
            for site, gs in self.groups.items():
                cands = {c for b in CC.TUNE_BUCKETS for c in CC.gemv_candidates(b, gs[0].nw is not None, gs[0].q8)}
                for g in gs[:1]:
                    for c in cands:
                        v = CC.GemvVariant.parse(c)
                        mode = S.MODE_QKV16 if g.qkv is not None else g.mode
                        names.add(g.name(v, mode))
            qtypes = {int(w.qtype) for d in self.prog.psites.values() for w in d["weights"]}
            if self.prog.psites:
                names |= PrefillGemm.kernel_names(qtypes)
            try:
                self._k = self.prog.backend.module(sorted(names))
            except Exception as e:  # noqa: BLE001 - NVRTC's errors; every candidate is then rejected
                self._k_error = RuntimeError(f"compiling the candidates failed: {type(e).__name__}: {e}")
                raise self._k_error from None
        return self._k

    def kernels_if_built(self) -> dict:
        return dict(self._k) if self._k is not None else {}

    def _setup(self) -> None:
        if self._ready:
            return
        from aotx.engine.backend.cuda.gemm import PrefillGemm
        from aotx.engine.backend.cuda.kv import CudaKVCache
        from aotx.engine.backend.cuda.matrix import q8_buffers

        prog = self.prog
        self.k = self.kernels()
        self.stream = cp.cuda.Stream(non_blocking=True)
        rng = np.random.default_rng(0)
        kmax = max([g.k for gs in self.groups.values() for g in gs] + [d["k"] for d in prog.psites.values()] + [8])
        # output columns: a GEMV writes at most m_rows (+ its pad row), a GEMM its weight's rows
        wmax = max([g.m_rows + 2 for gs in self.groups.values() for g in gs]
                   + [int(w.m) for d in prog.psites.values() for w in d["weights"]] + [8])
        self.ldx = (kmax + 3) // 4 * 4
        self.ldy = (max(wmax, prog.qkv_width, 8) + 3) // 4 * 4
        rows = max(CC.TUNE_BUCKETS[-1], GEMM_ROWS)
        self.x = cp.asarray(rng.standard_normal((rows, self.ldx), np.float32))
        self.y = cp.zeros((rows, self.ldy), cp.float32)
        self.kv = CudaKVCache(prog.n_layers, prog.n_kv, prog.head_dim, 1, CC.TUNE_BUCKETS[-1], "f16")
        c = _Ctx()
        c.kv = self.kv
        c.rope = [tuple(cp.asarray(t) for t in spec.tables(self.kv.n_ctx)) for spec in prog.plan.rope_specs]
        self._slot = cp.zeros(rows, cp.int32)
        self._pos = cp.asarray((np.arange(rows) % self.kv.n_ctx).astype(np.int32))
        c.slot_p, c.pos_p = self._slot.data.ptr, self._pos.data.ptr
        c.xs = cp.zeros(rows, cp.float32)
        c.xq, c.xd = q8_buffers(rows, kmax)
        self.c = c
        self.gemm = PrefillGemm(self.k, prog._blas)
        self._ready = True

    def close(self) -> None:
        for name in ("x", "y", "kv", "c", "gemm"):
            if hasattr(self, name):
                delattr(self, name)
        self._ref.clear()

    # ---- GEMV sites -----------------------------------------------------------------------------

    def prog_launch(self, g, b: int, v: CC.GemvVariant) -> None:
        g.launch(self.prog, self.c, self.x.data.ptr, self.ldx, b, self.y.data.ptr, self.ldy, variant=v,
                 kernels=self.k)

    def gemv_check(self, site: str, b: int):
        def check(cand: str):
            self._setup()
            ref = self._ref.get((site, b))
            g0 = self.groups[site][0]
            default = CC.gemv_default(b, g0.nw is not None, g0.m_rows, g0.k, g0.q8)
            if ref is None:
                ref = self._ref[(site, b)] = self._gemv_out(site, b, CC.GemvVariant.parse(default))
            if cand == default:
                return None
            out = self._gemv_out(site, b, CC.GemvVariant.parse(cand))
            for name, a, r in zip(("output", "K cache", "V cache"), out, ref):
                if a.tobytes() != r.tobytes():
                    d = float(np.max(np.abs(a.astype(np.float64) - r.astype(np.float64))))
                    return f"{name} differs from the default variant {default} (max |diff| {d:.3g})"
            return None
        return check

    def _gemv_out(self, site: str, b: int, v: CC.GemvVariant):
        g = self.groups[site][0]
        with self.stream:
            self.y.fill(0)
            self.kv.k.fill(0)
            self.kv.v.fill(0)
            self.prog_launch(g, b, v)
            out = [self.y[:b].get(stream=self.stream)]
            if g.qkv is not None:
                layer = g.qkv[1].s.layer
                out += [self.kv.k[layer, 0, :, :b].get(stream=self.stream),
                        self.kv.v[layer, 0, :, :b].get(stream=self.stream)]
        self.stream.synchronize()
        return out

    def gemv_measure(self, site: str, b: int):
        graphs: dict = {}

        def measure(cand: str) -> float:
            self._setup()
            v = CC.GemvVariant.parse(cand)
            gs = self.groups[site][:TUNE_LAYERS]
            s = self.stream
            got = graphs.get(cand)
            if got is None:                              # captured once per candidate, replayed per round
                per = max(1, sum(g.weight_bytes for g in gs))
                reps = max(1, min(MAX_REPS, -(-GRAPH_BYTES // per)))
                with s:
                    self.prog_launch(gs[0], b, v)       # loads the kernel
                    s.synchronize()
                    s.begin_capture()
                    for _ in range(reps):
                        for g in gs:
                            self.prog_launch(g, b, v)
                    graph = s.end_capture()
                    graph.upload(s)
                    graph.launch(s)                      # warm-up
                got = graphs[cand] = (graph, reps * len(gs))
            graph, n = got
            with s:
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                graph.launch(s)
                e1.record(s)
                e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / n
        return measure

    # ---- prefill GEMM sites ---------------------------------------------------------------------

    def _gemm_out(self, key: str, mode: str, n: int):
        d = self.prog.psites[key]
        w = d["weights"][0]
        with self.stream:
            cublas.setStream(self.prog._blas, self.stream.ptr)
            cublas.setPointerMode(self.prog._blas, cublas.CUBLAS_POINTER_MODE_HOST)
            self.y[:n].fill(0)
            p = self.gemm.prepare(mode, self.x.data.ptr, self.ldx, w.k, n, d["norm"])
            self.gemm.gemm(p, w, 0, w.m, n, self.y.data.ptr, self.ldy, False)
            out = self.y[:n, :w.m].get(stream=self.stream)
        self.stream.synchronize()
        return out

    def gemm_check(self, key: str):
        def check(mode: str):
            self._setup()
            ref = self._ref.get(key)
            if ref is None:
                ref = self._ref[key] = self._gemm_out(key, "f32", CHECK_ROWS).astype(np.float64)
            out = self._gemm_out(key, mode, CHECK_ROWS).astype(np.float64)
            if not np.isfinite(out).all():
                return "output is not finite"
            rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
            tol = CC.PREFILL_TOL[mode]
            return None if rel <= tol else f"relative error {rel:.3g} against float32 exceeds {tol:g}"
        return check

    def gemm_measure(self, key: str):
        def measure(mode: str) -> float:
            self._setup()
            d = self.prog.psites[key]
            w = d["weights"][0]
            m = w.m
            s = self.stream
            with s:
                cublas.setStream(self.prog._blas, s.ptr)
                cublas.setPointerMode(self.prog._blas, cublas.CUBLAS_POINTER_MODE_HOST)
                p = self.gemm.prepare(mode, self.x.data.ptr, self.ldx, w.k, GEMM_ROWS, d["norm"])
                self.gemm.gemm(p, w, 0, m, GEMM_ROWS, self.y.data.ptr, self.ldy, False)     # warm-up
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                for _ in range(GEMM_REPS):
                    p = self.gemm.prepare(mode, self.x.data.ptr, self.ldx, w.k, GEMM_ROWS, d["norm"])
                    self.gemm.gemm(p, w, 0, m, GEMM_ROWS, self.y.data.ptr, self.ldy, False)
                e1.record(s)
                e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / GEMM_REPS
        return measure
