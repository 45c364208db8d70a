"""The moe steps of a CUDA program, and the program's expert tiers.

Owns: ``MoeStep``, a moe layer run one of two ways: the **host step** (rows to the host, the
router, routing and CPU expert tier there (``cpu.experts.moe_rows``), the layer's GPU experts
(``experts.GpuExperts``) launched meanwhile, the join, the result back), which keeps a tick
on the eager path, or with ``CudaBackend(moe_graphs=True)`` runs between captured graphs
(``Segments``); and, once every expert of the layer is on the GPU tier, the **device step**
(router GEMV, ``moe_route``, ``moe_tiles``, ``moe_gather``, ``moe_gemv``, ``moe_join``: no
host work), which the tick's graph captures like any other step. Also the program's side of
the expert tiers (``measure_experts``, ``place_experts``, ``attach_expert_cache``,
``learn_experts``, ``expert_stats``: ``CudaProgram`` delegates to them). Leaves the GPU tier
to ``experts.py``, the CPU tier to ``backend/cpu/experts.py`` (the one module of the CPU
backend this one imports), the plan and the learned cache's policy to
``engine/model/experts.py``.
"""

from __future__ import annotations

import time

import cupy as cp
import numpy as np

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.attention import SHORT_SEGMENT
from aotx.engine.backend.cuda.experts import GpuExperts, MoeStage, host_matrix
from aotx.engine.backend.cuda.kv import CudaKVCache
from aotx.engine.backend.cuda.steps import NT, Ctx, Gemv, f32, i32, pow2, u64

# an allocation the device refused (CuPy's class; MemoryError where it has none)
OOM = getattr(getattr(cp.cuda, "memory", None), "OutOfMemoryError", MemoryError)


class MoeStep:
    """The moe op (``plan.MoeHost``): x's rows to the host, the router, routing, the
    CPU tier's experts (``cpu.experts.moe_rows``) and the shared expert there; the experts the
    plan put on the GPU tier (``GpuExperts``) run on the device meanwhile, their outputs
    joined with the CPU's before the weighted sum; the result back. Both copies go through
    pinned buffers the program's moe steps share (``MoeStage``: one D2H and its sync
    before the router, one asynchronous H2D after the join; no allocation per call). Eager only:
    ``CudaProgram._graph_ok`` keeps a program with one off the graph path.

    Except when every expert of the layer is on the GPU tier (``device_ready``): then the
    step runs on the device alone, in launches a CUDA graph captures (``_device``): the
    router's GEMV, ``moe_route`` (top-k by ``cpu.experts.route``'s rules), ``moe_tiles`` (the
    pairs by expert and the tile table, built on the device), ``moe_gather``, the tier's
    ``moe_gemv`` launches over a fixed grid of tiles, ``moe_join``. Each row's numbers
    depend on that row alone (batch-invariant); the router's logits are the device GEMV's,
    so they differ from the host step's in the last bits."""

    def __init__(self, prog, s: P.MoeHost):
        from aotx.engine.backend.cpu import experts as cpu_moe

        self.s = s
        self.prog = prog
        self.gpu = GpuExperts(prog, s.attrs)
        self.worker = prog.moe_worker
        self.router_dev = s.attrs["router"]             # the device step's router (DevMatrix) and bias
        rb = s.attrs.get("router_bias")
        self.router_bias_dev = cp.ascontiguousarray(cp.asarray(rb, cp.float32).reshape(-1)) if rb is not None else None
        self.dev_why = self._device_check(prog, s.attrs)
        self.router_gemv = None
        if self.dev_why is None:
            r = self.router_dev
            n0 = len(prog.gemvs)
            self.router_gemv = Gemv(prog, S.MODE_STORE, r, 0, r, 0, (r.m + 1) // 2, 2, 1, None, None, None, r.m,
                                     q8=False)
            del prog.gemvs[n0:]         # not a kernel-choice site: the default variant per bucket
            for b in CC.TUNE_BUCKETS:
                prog.need.add(self.router_gemv.name(self._router_variant(b)))
            prog.need.update(("moe_route", "moe_tiles", "moe_join"))
        self.dev_traffic = None         # (E,) uint64 on the device: pairs per expert the device step routed
        a = dict(s.attrs)
        int8 = bool(getattr(prog.backend, "expert_int8", True))
        a["router"] = host_matrix(a["router"], int8)
        if a.get("router_bias") is not None:
            a["router_bias"] = a["router_bias"].get()
        if a.get("shared") is not None:
            a["shared"] = tuple(host_matrix(w, int8) for w in a["shared"])
        if a.get("shared_gate") is not None:
            a["shared_gate"] = host_matrix(a["shared_gate"], int8)
        self.attrs = a
        self.pool = cpu_moe.ExpertPool.shared()
        self.host_traffic = np.zeros(a["n_expert"], np.int64)
        self._moe_rows = cpu_moe.moe_rows
        self.stages = prog.moe_stages   # the program's MoeStage per (input, output) width

    @property
    def traffic(self) -> np.ndarray:
        """(E,) int64: the (row, expert) pairs routed to each expert since load, by the host
        step and the device step (whose counters this reads back: a sync)."""
        if self.dev_traffic is None:
            return self.host_traffic
        return self.host_traffic + self.dev_traffic.get().astype(np.int64)

    def device_pairs(self) -> int:
        """(row, expert) pairs of real rows the device step computed since load (its graph
        replays included: the device counters, read back; the GPU tier's ``rows`` counts
        the host step's calls only)."""
        return int(self.dev_traffic.sum().get()) if self.dev_traffic is not None else 0

    @staticmethod
    def _device_check(prog, attrs: dict) -> str | None:
        """None when the layer can run as a device step once all its experts are on the
        GPU tier, else why not."""
        r = attrs["router"]
        if not getattr(prog.backend, "moe_device", True):
            return "turned off (CudaBackend(moe_device=False))"
        if attrs.get("shared") is not None:
            return "a shared expert (host step)"
        if int(attrs["n_used"]) > 32 or int(attrs["n_expert"]) > 1024:
            return f"{attrs['n_used']} of {attrs['n_expert']} experts per token (at most 32 of 1024)"
        if int(getattr(r, "qtype", -1)) not in S.TYPES or int(r.k) != int(attrs["gate"].k):
            return "the router's type or shape"
        return None

    def device_ready(self) -> bool:
        """True when this step runs on the device (every expert of the layer on the GPU tier)."""
        g = self.gpu
        return self.dev_why is None and g.ok and g.slot_dev is not None and len(g.ids) == g.E

    def _router_variant(self, rows: int) -> CC.GemvVariant:
        if self.prog._forced_gemv is not None:
            return self.prog._forced_gemv
        b = CC.tune_bucket(rows)
        return CC.GemvVariant.parse(CC.gemv_default(b, False, self.router_dev.m, self.router_dev.k))

    def _device_buffers(self, prog, c: Ctx, n: int, P_: int, tmax: int) -> dict:
        """The device step's buffers for n rows, shared by the program's moe steps of one shape
        (they run one after the other on one stream): the graph path's by row count (fixed
        addresses: a graph names them); the eager path's one set per shape, grown to the next
        power of two when a forward needs more (views of it are returned; the old set goes
        back to CuPy's pool, reused on the same stream only)."""
        g = self.gpu
        E = g.E
        fp = P._pad4(g.ff)
        shape = (E, int(self.attrs["n_used"]), g.k, fp, g.d, g.act != "silu")
        if not c.eager:
            got = prog.moe_device_scratch.get((n,) + shape)
            if got is None:
                got = prog.moe_device_scratch[(n,) + shape] = self._new_buffers(n, P_, tmax, fp)
            return got
        have = prog.moe_eager_scratch.get(shape)
        if have is None or have["cap"][0] < n or have["cap"][1] < P_ or have["cap"][2] < tmax:
            cap = tuple(pow2(max(a, b)) for a, b in zip((n, P_, tmax), have["cap"] if have else (1, 1, 1)))
            prog.moe_eager_scratch[shape] = None       # the old set back to the pool first
            have = prog.moe_eager_scratch[shape] = self._new_buffers(*cap, fp)
            have["cap"] = cap
        b = {"lg": have["lg"][:n], "tab": have["tab"][:P_ + 3 * tmax]}
        for key in ("sel", "w", "pos", "xg", "h", "y"):
            b[key] = have[key][:P_]
        b["gu"] = (have["gu"][0][:P_], have["gu"][1][:P_]) if have["gu"] is not None else None
        return b

    def _new_buffers(self, n: int, P_: int, tmax: int, fp: int) -> dict:
        g = self.gpu
        E = g.E
        b = {"lg": cp.empty((n, P._pad4(E + (E & 1))), cp.float32), "sel": cp.empty(P_, cp.int32),
             "w": cp.empty(P_, cp.float32), "tab": cp.empty(P_ + 3 * tmax, cp.int32), "pos": cp.empty(P_, cp.int32),
             "xg": cp.empty((P_, g.k), cp.float32), "h": cp.empty((P_, fp), cp.float32),
             "y": cp.empty((P_, g.d), cp.float32)}
        b["gu"] = (cp.empty((P_, fp), cp.float32), cp.empty((P_, fp), cp.float32)) if g.act != "silu" else None
        return b

    def _device(self, prog, c: Ctx) -> None:
        """The step on the device (``device_ready``): no host work but the launches."""
        x = c.arr(self.s.x)
        n = int(x.shape[0])
        if n == 0:
            return
        out = c.arr(self.s.out)
        g, a = self.gpu, self.attrs
        E, k = g.E, int(a["n_used"])
        P_ = n * k
        bucket = CC.tune_bucket(n)
        kerns = [g._kernel(name, bucket) for name in g.gemvs]
        nb = min(kk[2] for kk in kerns)
        # tiles: sum over the experts with rows of ceil(c_e / nb) <= (P + (nb - 1) m) / nb, m = min(E, P) of them
        tmax = (P_ + (nb - 1) * min(E, P_)) // nb
        b = self._device_buffers(prog, c, n, P_, tmax)
        if self.dev_traffic is None:
            self.dev_traffic = cp.zeros(E, cp.uint64)
        lg = b["lg"]
        ldl = int(lg.shape[1])
        self.router_gemv.launch(prog, c, x.data.ptr, int(x.strides[0]) // 4, n, lg.data.ptr, ldl,
                                variant=self._router_variant(n))
        rw = 4                                       # MOE_ROUTE_WARPS
        prog.k["moe_route"](((n + rw - 1) // rw,), (32 * rw,),
                            (lg, i32(ldl), u64(self.router_bias_dev), i32(n), i32(E), i32(k),
                             i32(a["gating"] == "softmax_weight"), i32(bool(a["norm_w"])), f32(a["w_scale"]),
                             b["sel"], b["w"]), shared_mem=4 * rw * E)
        # padding rows (the scratch slot) are not counted as traffic. Known gap: on logits rows (the last
        # layer's FFN after take_rows) in a graph bucket with fewer logits rows than tokens, a padding logits
        # row is checked against a real token row's slot and counted (statistics only; decode is exact)
        kv = getattr(c, "kv", None)
        prog.k["moe_tiles"]((1,), (1024,), (b["sel"], i32(P_), i32(k), i32(E), g.slot_dev, i32(nb), i32(tmax), b["tab"],
                                           b["pos"], self.dev_traffic, np.uint64(getattr(c, "slot_p", 0) or 0),
                                           i32(kv.scratch_slot if kv is not None else -1)))
        prog.k["moe_gather"]((P_,), (128,), (np.uint64(x.data.ptr), i32(int(x.strides[0]) // 4), b["tab"], i32(g.k),
                                             b["xg"], i32(g.k)))
        g.run_gemvs(kerns, g.launch_args(b["xg"], b["h"], b["y"], b["gu"]), b["tab"].data.ptr + 4 * P_, tmax, P_,
                    b["h"], b["gu"])
        prog.k["moe_join"]((n,), (NT,), (b["y"], i32(g.d), b["pos"], b["w"], i32(k), i32(g.d), np.uint64(out.data.ptr),
                                         i32(int(out.strides[0]) // 4)))

    def graph(self, prog, c: Ctx) -> None:
        if not self.device_ready():
            raise RuntimeError("this moe step runs on the host (not every expert is on the GPU): no CUDA graph")
        self._device(prog, c)

    def eager(self, prog, c: Ctx) -> None:
        """The host step (or the device step when ``device_ready``). Also run between the
        graphs of a tick cut at the host steps (``Segments``): there on the layout's real
        rows only (the bucket's padding rows are left as they are)."""
        if self.device_ready():
            self._device(prog, c)
            return
        x = c.arr(self.s.x)
        out = c.arr(self.s.out)
        if not c.eager and c.layout is not None:     # a graph's bucket: its real rows (tokens, or logits rows)
            real = int(c.layout.n_rows) if c.plan_rows(self.s.x) == P.ROWS_N else int(len(c.layout.out_rows))
            x, out = x[:real], out[:real]
        n = int(x.shape[0])
        if n == 0:
            return
        wx, wy = int(x.shape[1]), int(out.shape[1])
        sg = self.stages.get((wx, wy))
        if sg is None:
            sg = self.stages[(wx, wy)] = MoeStage(wx, wy)
        sg.reserve(n)
        # x's rows into pinned memory by one 2-D copy, then the stream's sync (the router and
        # the CPU tier read them; the steps before on this stream are done)
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        xh = sg.xh[:n]
        rt.memcpy2DAsync(xh.ctypes.data, 4 * wx, x.data.ptr, int(x.strides[0]), 4 * wx, n, rt.memcpyDeviceToHost,
                         stream.ptr)
        stream.synchronize()
        small = None                # rows of long segments take the CPU's prefill path
        segs = c.layout.segments if c.layout is not None else ()
        if sum(seg.n for seg in segs) == xh.shape[0] and any(seg.n > SHORT_SEGMENT for seg in segs):
            small = np.zeros(xh.shape[0], bool)
            row = 0
            for seg in segs:
                if seg.n <= SHORT_SEGMENT:
                    small[row:row + seg.n] = True
                row += seg.n
        gpu = None
        if self.gpu.ids:
            gpu = self.gpu
            gpu._x, gpu._c = x, c
        try:
            y = self._moe_rows(self.attrs, xh, self.pool, self.host_traffic, small, gpu, self.worker)
        finally:
            self.gpu._x = self.gpu._c = None
        # the result back by one 2-D copy from pinned memory (asynchronous: the event keeps
        # the next call from overwriting the buffer before the copy has read it)
        if sg.staged is None:
            sg.staged = cp.cuda.Event()
        sg.staged.synchronize()
        yh = sg.yh[:n]
        np.copyto(yh, y)
        rt.memcpy2DAsync(out.data.ptr, int(out.strides[0]), yh.ctypes.data, 4 * wy, 4 * wy, n, rt.memcpyHostToDevice,
                         stream.ptr)
        sg.staged.record(stream)



def measure_experts(prog, layer: int, rows: tuple[int, ...]) -> dict:
    """Calibration of moe layer ``layer``: "cpu" {n: s}, seconds per expert on n rows on
    the CPU tier (``cpu.experts.measure``); the GPU tier's call of one expert ("gpu_one") and
    of a layer's n_used experts ("gpu_layer" {n: s}, "gpu_k" experts), and the copy of one
    expert to the GPU ("copy"; ``GpuExperts.measure``; these absent when this layer's
    experts cannot run on the GPU tier)."""
    from aotx.engine.backend.cpu import experts as cpu_moe

    st = prog.moe_steps[layer]
    out = cpu_moe.measure(st.attrs, rows, st.pool)
    if st.gpu.ok:
        out.update(st.gpu.measure(rows, int(st.attrs["n_used"])))
    return out

def place_experts(prog, plan) -> dict:
    """Apply an expert-tier plan: each layer's "gpu" experts uploaded to the device (the
    others' device copies freed), "host" ones materialized and their pages touched by
    the pinned CPU pool, "mmap" ones left in the file's map. A layer whose experts do
    not fit in the device's free memory keeps them on the CPU tier (its "gpu" experts
    become "host"), which the returned ``gpu_bytes`` reflects. Raises ValueError for a
    plan of the wrong shape, or "gpu" experts in a layer the GPU tier cannot run."""
    from aotx.engine.backend.cpu import experts as cpu_moe

    if not prog.moe_steps:
        return {"gpu_bytes": 0, "host_bytes": 0, "recalibrate": False}
    if len(plan.tiers) != len(prog.moe_steps):
        raise ValueError(f"an expert plan of {len(plan.tiers)} layers for {len(prog.moe_steps)} moe layers")
    gpu_bytes = host_bytes = 0
    pool = prog.moe_steps[0].pool
    prog.expert_cache = None       # its residents were the old placement's (experts.setup attaches anew)
    for st, tiers in zip(prog.moe_steps, plan.tiers):
        a = st.attrs
        if len(tiers) != a["n_expert"] or any(t not in ("gpu",) + cpu_moe.CPU_TIERS for t in tiers):
            raise ValueError(f"moe layer {a['moe_layer']}: tiers {sorted(set(tiers))} for {a['n_expert']} "
                             f"experts (tiers: gpu, {', '.join(cpu_moe.CPU_TIERS)})")
        on_gpu = [e for e, t in enumerate(tiers) if t == "gpu"]
        host = [e for e, t in enumerate(tiers) if t == "host"]
        try:
            gpu_bytes += st.gpu.place(on_gpu)
        except OOM:
            st.gpu.place([])
            host += on_gpu
        host_bytes += pool.warm([a["gate"], a["up"], a["down"]], sorted(host))
    return {"gpu_bytes": gpu_bytes, "host_bytes": host_bytes, "recalibrate": True}

def attach_expert_cache(prog, cache) -> None:
    """Run the learned GPU expert cache ``cache`` (``experts.LearnedCache``, whose
    residents must be the GPU tier's experts now) from the next tick on, or none
    (None: the placement stays as it is). The GPU tier's experts are materialized on
    the CPU pool too, so an expert evicted later costs no repacking inside a tick.
    Raises ValueError when the residents are not the tier's."""
    if cache is None:
        prog.expert_cache = None
        return
    if len(cache.resident) != len(prog.moe_steps):
        raise ValueError(f"an expert cache of {len(cache.resident)} layers for {len(prog.moe_steps)} moe layers")
    for st, on in zip(prog.moe_steps, cache.resident):
        if not np.array_equal(np.asarray(on, bool), st.gpu.on):
            raise ValueError(f"moe layer {st.attrs['moe_layer']}: the cache's residents are not the GPU tier's "
                             f"experts {st.gpu.ids}")
    for st in prog.moe_steps:
        if st.gpu.ids and len(st.gpu.ids) < st.gpu.E:   # a whole GPU layer never evicts (rebalance skips it)
            a = st.attrs
            st.pool.warm([a["gate"], a["up"], a["down"]], list(st.gpu.ids))
    cache.tick(cache_traffic(prog))      # its baseline: the counters now
    prog.expert_cache = cache

def cache_traffic(prog) -> list:
    """The learned cache's counters per moe layer: the host step's (a device-step layer, every
    expert on the GPU, has nothing to move: its device counters are not read back each tick)."""
    return [b.host_traffic if b.device_ready() else b.traffic for b in prog.moe_steps]

def learn_experts(prog) -> None:
    """The learned cache's step, BETWEEN ticks: called first thing in a forward (``_eager``,
    or ``_replay`` on the cache's stream for a tick of graphs between host steps), before
    this tick launches anything. The
    tick before is over by then: each moe step waited for its GPU tier's output (a
    stream sync) before its layer's join, so no launch still reads a slot about to be
    overwritten, and moe_rows reads ``on`` on this thread, so every row of this tick sees
    one placement. The copies go on the current stream ahead of this tick's launches (its
    first moe_gemv reads the new weights by stream order); at most the policy's
    ``copies_per_tick`` experts, through one pinned staging buffer (grown on demand),
    whose previous copies are waited for (an event) before it is rewritten."""
    cache = prog.expert_cache
    t0 = time.perf_counter()
    moves = cache.tick(cache_traffic(prog))
    if not moves:
        return
    need = sum(prog.moe_steps[li].gpu.expert_nbytes(e) for li, e, _ in moves)
    mem, stage, ev = prog._cache_stage or (None, np.empty(0, np.uint8), None)
    if ev is not None:
        ev.synchronize()
    if stage.shape[0] < need:
        mem = cp.cuda.alloc_pinned_memory(pow2(need))
        stage = np.frombuffer(mem, np.uint8, pow2(need))
        ev = None
    off = 0
    for li, e, v in moves:
        off = prog.moe_steps[li].gpu.swap(e, v, stage, off)
    if ev is None:
        ev = cp.cuda.Event()
    ev.record(cp.cuda.get_current_stream())
    prog._cache_stage = (mem, stage, ev)
    prog.expert_copy["bytes"] += off
    prog.expert_copy["seconds"] += time.perf_counter() - t0

def expert_stats(prog) -> dict:
    """Rows routed to each expert of each moe layer since load; (row, expert) pairs the
    GPU tier computed per layer; the CPU pool's counters; with a learned cache, its
    counters and the bytes and host seconds of its copies ("cache")."""
    out = {"traffic": [b.traffic.tolist() for b in prog.moe_steps],
           "gpu_rows": [b.gpu.rows + b.device_pairs() for b in prog.moe_steps],
           "gpu_experts": [len(b.gpu.ids) for b in prog.moe_steps],
           "pool": prog.moe_steps[0].pool.stats() if prog.moe_steps else {}}
    if prog.expert_cache is not None:
        out["cache"] = {**prog.expert_cache.stats(), "copied_bytes": prog.expert_copy["bytes"],
                        "copy_s": round(prog.expert_copy["seconds"], 4)}
    return out


class Segments:
    """A tick's launches cut at the host moe steps (``CudaBackend(moe_graphs=True)``):
    ``graphs[i]`` (a captured CUDA graph, or None for no steps) runs the steps between host
    steps i - 1 and i, the last one the sampler too; each host step runs on the host in
    between, on the layout's real rows, on the cache's stream (its copies and its sync
    order it after the graph before it and before the graph after it). ``st``: the cache's
    ``program.CacheState``."""

    def __init__(self, graphs: list, hosts: list):
        self.graphs, self.hosts = graphs, hosts

    def launch(self, prog, kv: CudaKVCache, st, b: int, r: int, layout, s) -> None:
        with s:
            for i, g in enumerate(self.graphs):
                if g is not None:
                    g.launch(s)
                if i < len(self.hosts):
                    c = prog._ctx(kv, st, b, r)
                    c.layout = layout
                    self.hosts[i].eager(prog, c)
