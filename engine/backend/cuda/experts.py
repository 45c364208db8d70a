"""The GPU expert tier of a mixture of experts: the experts a layer keeps on the device.

Owns: ``GpuExperts`` (per moe layer: which experts live on the device, their stacked
weights, placing and swapping them, the grouped GEMVs that run every routed (row, expert)
pair of the tier in one launch per weight, and its calibration), the scratch and pinned
staging it shares across layers (``MoeScratch``, ``MoeStage``), and ``host_matrix`` (a
device weight copied back for the host step). Leaves routing, the CPU tier and the join to
``moe.py`` (``MoeStep``) and ``backend/cpu/experts.py``, the placement plan to
``engine/model/experts.py``, the kernels to ``kernels/moe.cu`` and ``kernels/gemv.cu``.
"""

from __future__ import annotations

import time

import cupy as cp
import numpy as np

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.steps import GEMV_WARPS, NT, Ctx, Gemv, f32, i32, pow2, qname, u64


def host_matrix(dm, int8: bool):
    """A DevMatrix's rows copied back into a CPU QuantMatrix (the host step's router and
    shared-expert weights: small; once, at load)."""
    from aotx.engine.backend.cpu.experts import host_matrix

    return host_matrix(dm.data[:dm.m].get(), dm.qtype, dm.m, dm.k, dm.name, int8=int8)


class MoeScratch:
    """Buffers the GPU expert tiers of one program share, per expert shape (the moe steps
    run one after the other on one thread, each call waiting for its output before the
    next starts): the device table (row indices, tiles), gathered rows (k), hidden rows (fp;
    gpt-oss: gate and up rows too), output rows (d); the pinned host table and output.
    Grown to the next power of two; ``gen`` counts the growths (the tiers' cached launch
    arguments name these buffers)."""

    def __init__(self, k: int, fp: int, d: int, oai: bool):
        self.k, self.fp, self.d, self.oai = k, fp, d, oai
        self.cap = (0, 0)          # (pairs, tiles)
        self.gen = 0
        self.dev: list = []
        self.host: tuple = ()

    def reserve(self, n_pairs: int, n_tiles: int) -> None:
        if n_pairs <= self.cap[0] and n_tiles <= self.cap[1]:
            return
        cp_, ct = max(self.cap[0], pow2(n_pairs)), max(self.cap[1], pow2(n_tiles))
        self.dev = self.host = None         # free the old ones first
        nt = cp_ + 3 * ct
        dev = [cp.empty(nt, cp.int32), cp.empty((cp_, self.k), cp.float32), cp.empty((cp_, self.fp), cp.float32),
               cp.empty((cp_, self.d), cp.float32)]
        if self.oai:
            dev += [cp.empty((cp_, self.fp), cp.float32), cp.empty((cp_, self.fp), cp.float32)]
        mem_t, mem_y = cp.cuda.alloc_pinned_memory(4 * nt), cp.cuda.alloc_pinned_memory(4 * cp_ * self.d)
        self.host = (np.frombuffer(mem_t, np.int32, nt), np.frombuffer(mem_y, np.float32, cp_ * self.d), mem_t, mem_y)
        self.dev, self.cap = dev, (cp_, ct)
        self.gen += 1


class MoeStage:
    """Pinned host rows the moe steps of one program share, per (input, output) width: x's
    rows down before the router, the result up after the join. ``staged``: an event after
    the last upload (the next writer waits on it; the upload is asynchronous)."""

    def __init__(self, wx: int, wy: int):
        self.wx, self.wy = wx, wy
        self.cap = 0
        self.xh = self.yh = self.mem = None
        self.staged = None

    def reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        if self.staged is not None:
            self.staged.synchronize()
        cap = max(pow2(n), self.cap)
        self.xh = self.yh = self.mem = None
        mx, my = cp.cuda.alloc_pinned_memory(4 * cap * self.wx), cp.cuda.alloc_pinned_memory(4 * cap * self.wy)
        self.xh = np.frombuffer(mx, np.float32, cap * self.wx).reshape(cap, self.wx)
        self.yh = np.frombuffer(my, np.float32, cap * self.wy).reshape(cap, self.wy)
        self.mem, self.cap = (mx, my), cap


class GpuExperts:
    """The GPU expert tier of one moe step (the plan: engine/model/experts.py): the experts
    the plan puts on "gpu" live on the device, uploaded once by ``place`` (the gate, up and
    down stacks of just those experts, in the file's block layout, and their biases), and
    their routed rows run through the decode GEMV's reduction: gate and up (one SwiGLU GEMV
    for "silu"; two GEMVs and ``swiglu_oai_rows`` for gpt-oss) then down.

    A call (``launch``) is one launch per GEMV for all the experts here (``moe_gemv``: a tile
    table gives each block row its expert slot and rows, the expert's weights lie at a fixed
    stride in the stacks): the host builds one int32 table (the routed rows' indices, then
    the tiles) in pinned memory, copies it with one H2D copy, ``moe_gather`` gathers the rows
    on the device, the GEMVs run into preallocated buffers (``MoeScratch``, shared by the
    program's moe steps, grown on demand), and the output comes back with one D2H copy into
    pinned memory; ``wait`` is the layer's one sync. The
    GEMV reduces each output element in the canonical order of the decode GEMV (kernels/gemv.cu),
    so a row's expert outputs do not depend on the batch, the tiles or the variant and
    equal the bits of ``gemv`` launched on each expert alone (``grouped = False`` runs those
    per-expert launches: the reference of the bit-identity test and of the host-overhead
    timing, tests/tools/moe_gpu_overhead.py). The variant is the kernel choice's default
    for the bucket of the most rows any expert has (these sites are not tuned). ``on[e]``:
    expert e is here. ``ok`` is False (``why`` says why) when the shapes or types do not
    suit the kernels: then every expert stays on the CPU tiers. Not thread-safe; one call
    at a time (``launch`` then ``wait``): the buffers are reused by the next call."""

    MAX_TILES = 65535                    # grid.y of one moe_gemv launch

    def __init__(self, prog, attrs: dict):
        from aotx.engine.backend.cuda.matrix import DevMatrix
        from gguf import GGML_QUANT_SIZES

        self.prog = prog
        self.attrs = attrs
        gate, up, down = attrs["gate"], attrs["up"], attrs["down"]
        self.E, self.ff, self.d, self.k = int(attrs["n_expert"]), int(gate.m), int(down.m), int(gate.k)
        self.act = attrs["act"]
        self.on = np.zeros(self.E, bool)
        self.slot = np.full(self.E, -1, np.int64)
        self.slot_dev = None             # slot as a device int32 array (moe_tiles reads it)
        self.ids: list[int] = []
        self.nbytes = 0
        self.rows = 0                    # (row, expert) pairs computed here since load
        self.calls = 0
        self.w = None                    # (gate, up, down) device stacks of the experts here
        self.b = (None, None, None)      # their biases (n_here, width) or None
        self._x = self._c = None         # the step's device input and context, during its eager run
        self._variants: dict = {}        # (GEMV, bucket) -> its default variant
        self.grouped = True              # False: per-expert gemv launches (the reference)
        self._kern: dict = {}            # (GEMV name, bucket) -> (moe_gemv kernel, pairs per block, nb)
        self._scratch = None             # the program's MoeScratch of this shape (first call)
        self._args: dict = {}            # GEMV name -> its launch arguments on those buffers
        self._args_gen = -1              # the scratch generation they name
        why = ""
        for st in (gate, up, down):
            if int(st.qtype) not in S.TYPES:
                why = f"{st.name}: tensor type {qname(st.qtype)} has no CUDA kernel"
            elif st.m % 2 or st.k % max(GGML_QUANT_SIZES[st.qtype][0], 32):
                why = f"{st.name}: shape {st.m} x {st.k} does not suit the GEMV"
        if up.m != self.ff or down.k != self.ff or up.k != self.k:
            why = "gate, up and down shapes disagree"
        self.ok, self.why = not why, why
        self.rb = []
        mats = []
        for st in (gate, up, down):
            be, bb = GGML_QUANT_SIZES[st.qtype]
            rb = int(st.k) // be * bb
            self.rb.append(rb)
            mats.append(DevMatrix(st.name, int(st.qtype), int(st.m), int(st.k), rb, None))
        self.mats = mats
        if not self.ok:
            self.gemvs = {}
            return
        mg, mu, md = mats
        n0 = len(prog.gemvs)
        if self.act == "silu":
            gv = {"gu": Gemv(prog, S.MODE_SWIGLU, mg, 0, mu, 0, self.ff, 1, 0, None, None, None, self.ff, q8=False)}
        else:
            gv = {"g": Gemv(prog, S.MODE_STORE, mg, 0, mg, 0, self.ff // 2, 2, 1, None, None, None, self.ff, q8=False),
                  "u": Gemv(prog, S.MODE_STORE, mu, 0, mu, 0, self.ff // 2, 2, 1, None, None, None, self.ff, q8=False)}
            prog.need.add("swiglu_oai_rows")
        gv["d"] = Gemv(prog, S.MODE_STORE, md, 0, md, 0, self.d // 2, 2, 1, None, None, None, self.d, q8=False)
        del prog.gemvs[n0:]              # not kernel-choice sites: their variant is the default
        # (q8=False: float activations, as moe_gemv computes; the per-expert launches are its reference)
        self.gemvs = gv
        for g in gv.values():
            for b in CC.TUNE_BUCKETS:
                v = self._variant(g, b)
                prog.need.update((g.name(v), self._grouped_name(g, v)))
        prog.need.add("moe_gather")

    @staticmethod
    def _grouped_name(g: Gemv, v: CC.GemvVariant) -> str:
        return f"moe_gemv<{int(g.wa.qtype)},{int(g.wb.qtype)},{v.nb},{g.mode},{v.wpp}>"

    def _variant(self, g: Gemv, rows: int) -> CC.GemvVariant:
        if self.prog._forced_gemv is not None:
            return self.prog._forced_gemv
        b = CC.tune_bucket(rows)
        v = self._variants.get((id(g), b))
        if v is None:
            v = self._variants[(id(g), b)] = CC.GemvVariant.parse(CC.gemv_default(b, False, g.m_rows, g.k))
        return v

    def place(self, ids) -> int:
        """Hold exactly the experts ``ids`` on the device (those already here are uploaded
        again: placement happens at load). Returns the device bytes they take."""
        ids = sorted({int(e) for e in ids})
        drop = getattr(self.prog, "drop_graphs", None)
        if drop is not None:
            drop()                       # graphs of the device-resident moe step name the old stacks
        self.w, self.b = None, (None, None, None)
        self._args = {}
        self.on[:] = False
        self.slot[:] = -1
        self.slot_dev = None
        self.ids, self.nbytes = [], 0
        if not ids:
            return 0
        if not self.ok:
            raise ValueError(f"moe layer {self.attrs['moe_layer']}: no GPU expert tier ({self.why})")
        st = (self.attrs["gate"], self.attrs["up"], self.attrs["down"])
        self.w = tuple(cp.asarray(np.ascontiguousarray(np.concatenate([s.raw(e) for e in ids]))) for s in st)
        bs = []
        for key in ("gate_bias", "up_bias", "down_bias"):
            v = self.attrs.get(key)
            bs.append(cp.asarray(np.ascontiguousarray(v[ids], np.float32)) if v is not None else None)
        self.b = tuple(bs)
        self.slot[ids] = np.arange(len(ids))
        self.slot_dev = cp.asarray(self.slot.astype(np.int32))
        self.on[ids] = True
        self.ids = ids
        self.nbytes = sum(int(a.nbytes) for a in self.w) + sum(int(a.nbytes) for a in self.b if a is not None)
        return self.nbytes

    def swap(self, promoted: int, evicted: int, stage: np.ndarray, off: int) -> int:
        """The learned cache's move (``CudaProgram._learn_experts``, between ticks): expert
        ``promoted`` takes ``evicted``'s device slot. Its gate, up and down rows (the file's
        bytes) go through ``stage`` (pinned host memory, from byte ``off``) and are copied
        over the slot on the current stream, its biases too; ``on``, ``slot`` and ``ids``
        follow. The stream's later launches read the new weights (stream order); the caller
        makes sure no launch still reads the slot and ``stage`` is not in use. The pinned
        host copies the CPU pool holds are repacked for its kernels, not the file's layout,
        so the source is the memory-mapped file (page cache; a page not resident is read
        from disk here). Returns the offset past the bytes staged."""
        if not (self.on[evicted] and not self.on[promoted]):
            raise RuntimeError(f"moe layer {self.attrs['moe_layer']}: swap {promoted} in for {evicted}, but the tier "
                               f"holds {self.ids}")
        sl = int(self.slot[evicted])
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        for i, key in enumerate(("gate", "up", "down")):
            raw = self.attrs[key].raw(promoted)
            nb = int(raw.nbytes)
            dst = stage[off:off + nb]
            np.copyto(dst.reshape(raw.shape), raw)
            rt.memcpyAsync(self.w[i].data.ptr + sl * self.mats[i].m * self.rb[i], dst.ctypes.data, nb,
                           rt.memcpyHostToDevice, stream.ptr)
            off += nb
        for i, key in enumerate(("gate_bias", "up_bias", "down_bias")):
            v = self.attrs.get(key)
            if v is not None and self.b[i] is not None:
                self.b[i][sl] = cp.asarray(np.ascontiguousarray(v[promoted], np.float32))
        self.on[evicted], self.on[promoted] = False, True
        self.slot[evicted], self.slot[promoted] = -1, sl
        self.slot_dev = cp.asarray(self.slot.astype(np.int32))
        self.ids = sorted(set(self.ids) - {int(evicted)} | {int(promoted)})
        return off

    def expert_nbytes(self, e: int) -> int:
        """Bytes of expert e's gate, up and down rows in the file's layout."""
        return sum(int(self.attrs[k].raw(e).nbytes) for k in ("gate", "up", "down"))

    def _ptrs(self, i: int, e: int, width: int) -> tuple:
        """(weights of expert slot e in stack i, its bias) device addresses."""
        m = self.mats[i].m
        w = self.w[i].data.ptr + e * m * self.rb[i]
        b = self.b[i].data.ptr + 4 * e * width if self.b[i] is not None else 0
        return w, b

    def launch(self, pairs, x=None, c=None):
        """Start the FFNs of ``pairs`` ((expert, rows, slots j) of experts held here, as
        ``cpu.experts.groups`` gives them) on the device rows ``x`` (default: the step's input set
        by ``MoeStep``); returns the handle ``wait`` takes. Its output: (P, d) float32, pairs
        in order, rows in order within."""
        if not self.grouped:
            return self._launch_each(pairs, x, c)
        if not pairs:
            return 0
        counts = [int(r.shape[0]) for _, r, _ in pairs]
        return self.launch_routed(np.repeat(np.array([e for e, _, _ in pairs], np.int64), counts),
                                  np.concatenate([r for _, r, _ in pairs]), x)

    def launch_routed(self, experts: np.ndarray, rows: np.ndarray, x=None):
        """``launch`` for pairs given as two (P,) int64 arrays (``cpu.experts.moe_rows``): each
        pair's expert (held here; grouped by expert, in increasing id) and row of x."""
        P_ = int(rows.shape[0])
        if P_ == 0:
            return 0
        cut = np.flatnonzero(np.diff(experts)) + 1
        first = np.concatenate(([0], cut))                   # each expert's first pair
        if not self.grouped:
            return self._launch_each([(int(experts[f]), r, None) for f, r in zip(first, np.split(rows, cut))], x)
        x = self._x if x is None else x
        prog = self.prog
        n_e = int(first.shape[0])
        counts = np.diff(np.append(first, P_))
        bucket = CC.tune_bucket(int(counts.max()))
        kerns = [self._kernel(name, bucket) for name in self.gemvs]
        nb = min(kk[2] for kk in kerns)   # tiles of at most every kernel's NB (one NB per bucket today)
        # the table: the rows' indices into x (P), then the tiles (T, 3): slot, first row, rows
        ntile = (counts + nb - 1) // nb
        T = int(ntile.sum())
        sc = self._reserve(P_, T)
        tab = sc.host[0]
        tab[:P_] = rows
        tiles = tab[P_:P_ + 3 * T].reshape(T, 3)
        rep_first = np.repeat(first, ntile)
        tiles[:, 0] = np.repeat(self.slot[experts[first]], ntile)
        b0 = rep_first + nb * (np.arange(T) - np.repeat(np.cumsum(ntile) - ntile, ntile))
        tiles[:, 1] = b0
        tiles[:, 2] = np.minimum(nb, np.repeat(first + counts, ntile) - b0)
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        dev = sc.dev
        dtab = dev[0]
        rt.memcpyAsync(dtab.data.ptr, tab.ctypes.data, 4 * (P_ + 3 * T), rt.memcpyHostToDevice, stream.ptr)
        xg = dev[1]
        prog.k["moe_gather"]((P_,), (128,), (np.uint64(x.data.ptr), i32(x.strides[0] // 4), dtab, i32(self.k), xg,
                                             i32(self.k)))
        self.run_gemvs(kerns, self._args, dtab.data.ptr + 4 * P_, T, P_, dev[2], (dev[4], dev[5]) if sc.oai else None)
        rt.memcpyAsync(sc.host[1].ctypes.data, dev[3].data.ptr, 4 * P_ * self.d, rt.memcpyDeviceToHost, stream.ptr)
        self.rows += P_
        self.calls += n_e
        return P_

    def _kernel(self, name: str, bucket: int) -> tuple:
        """(moe_gemv kernel, row pairs per block, NB) of GEMV ``name`` at ``bucket``."""
        got = self._kern.get((name, bucket))
        if got is None:
            g = self.gemvs[name]
            v = self._variant(g, bucket)
            got = self._kern[(name, bucket)] = (self.prog.k[self._grouped_name(g, v)], GEMV_WARPS // v.wpp, v.nb)
        return got

    def _reserve(self, P_: int, T: int) -> MoeScratch:
        """The program's scratch for this shape, holding ``P_`` pairs and ``T`` tiles, and
        each GEMV's launch arguments on it but the tile table's address."""
        sc = self._scratch
        if sc is None:
            fp = P._pad4(self.ff)
            key = (self.k, fp, self.d, self.act != "silu")
            sc = self._scratch = self.prog.moe_scratch.setdefault(key, MoeScratch(*key))
        sc.reserve(P_, T)
        if self._args and self._args_gen == sc.gen:
            return sc
        dev = sc.dev
        self._args = self.launch_args(dev[1], dev[2], dev[3], (dev[4], dev[5]) if sc.oai else None)
        self._args_gen = sc.gen
        return sc

    def launch_args(self, xg, h, y, gu=None) -> dict:
        """Each GEMV's ``moe_gemv`` arguments (head, tail: all but the tile table's address)
        on the buffers xg (P, k) gathered rows -> h (P, fp) hidden rows -> y (P, d) outputs;
        ``gu``: gpt-oss's (gate, up) rows (P, fp)."""
        fp, d = int(h.shape[1]), int(y.shape[1])
        io = {"gu": (xg, self.k, h, fp), "d": (h, fp, y, d)}
        if gu is not None:
            io.update({"g": (xg, self.k, gu[0], fp), "u": (xg, self.k, gu[1], fp)})
        stack = {"gu": (0, 1), "g": (0, 0), "u": (1, 1), "d": (2, 2)}
        args = {}
        for name, g in self.gemvs.items():
            ia, ib = stack[name]
            xin, ldx, out, ldy = io[name]
            wa, wb = self.w[ia], self.w[ib]
            head = (np.uint64(wa.data.ptr), np.uint64(wb.data.ptr), np.int64(self.mats[ia].m * self.rb[ia]),
                    np.int64(self.mats[ib].m * self.rb[ib]), np.int64(self.rb[ia]), np.int64(self.rb[ib]),
                    i32(g.a_stride), i32(g.b_off), i32(g.n_pairs), i32(g.k), np.uint64(xin.data.ptr), i32(ldx))
            tail = (u64(self.b[ia]), u64(self.b[ib]), i32(self.mats[ia].m), np.uint64(out.data.ptr), i32(ldy))
            args[name] = (head, tail)
        return args

    def run_gemvs(self, kerns: list, args: dict, tiles_ptr: int, T: int, P_: int, h, gu=None) -> None:
        """The GEMVs over ``T`` tiles of the table at ``tiles_ptr`` (device), with ``kerns``
        (``_kernel`` per GEMV) and ``args`` (``launch_args``); gpt-oss's clamped SwiGLU of
        ``gu`` into h between its gate/up and down GEMVs."""
        prog = self.prog
        for (kern, ppb, _), name in zip(kerns, self.gemvs):
            g = self.gemvs[name]
            if name == "d" and self.act != "silu":
                n_el = P_ * self.ff
                fp = int(h.shape[1])
                prog.k["swiglu_oai_rows"](((n_el + NT - 1) // NT,), (NT,),
                                          (gu[0], i32(fp), gu[1], i32(fp), i32(P_), i32(self.ff),
                                           f32(self.attrs["alpha"]), f32(self.attrs["limit"]), h, i32(fp)))
            head, tail = args[name]
            gx = (g.n_pairs + ppb - 1) // ppb
            for t0 in range(0, T, self.MAX_TILES):
                kern((gx, min(self.MAX_TILES, T - t0)), (GEMV_WARPS * 32,),
                     head + (np.uint64(tiles_ptr + 12 * t0),) + tail)

    def _launch_each(self, pairs, x=None, c=None):
        """The per-expert launches (``grouped = False``): the rows gathered by an index
        array, per expert a ``gemv`` launch per GEMV on its rows. The reference of the
        grouped path (bit-identical) and of its host-overhead timing."""
        x = self._x if x is None else x
        c = self._c if c is None else c
        prog = self.prog
        rows = np.concatenate([r for _, r, _ in pairs])
        P_ = int(rows.shape[0])
        xg = cp.ascontiguousarray(x[cp.asarray(rows.astype(np.int64))])
        fp, dp = P._pad4(self.ff), P._pad4(self.d)
        h = cp.empty((P_, fp), cp.float32)
        y = cp.empty((P_, dp), cp.float32)
        keep = [xg, h, y]
        k, xp = self.k, xg.data.ptr
        r0 = 0
        if self.act != "silu":
            gt, ut = cp.empty((P_, fp), cp.float32), cp.empty((P_, fp), cp.float32)
            keep += [gt, ut]
        for e, r, _ in pairs:
            n, sl = int(r.shape[0]), int(self.slot[e])
            xr = xp + 4 * r0 * k
            if self.act == "silu":
                g = self.gemvs["gu"]
                (wg, bg), (wu, bu) = self._ptrs(0, sl, self.ff), self._ptrs(1, sl, self.ff)
                g.launch(prog, c, xr, k, n, h.data.ptr + 4 * r0 * fp, fp, variant=self._variant(g, n),
                         ptrs=(wg, wu, bg, bu))
            else:
                for i, name, out in ((0, "g", gt), (1, "u", ut)):
                    g = self.gemvs[name]
                    w, b = self._ptrs(i, sl, self.ff)
                    g.launch(prog, c, xr, k, n, out.data.ptr + 4 * r0 * fp, fp, variant=self._variant(g, n),
                             ptrs=(w, w, b, b))
            r0 += n
        if self.act != "silu":
            n_el = P_ * self.ff
            prog.k["swiglu_oai_rows"](((n_el + NT - 1) // NT,), (NT,),
                                      (gt, i32(fp), ut, i32(fp), i32(P_), i32(self.ff), f32(self.attrs["alpha"]),
                                       f32(self.attrs["limit"]), h, i32(fp)))
        r0 = 0
        g = self.gemvs["d"]
        for e, r, _ in pairs:
            n, sl = int(r.shape[0]), int(self.slot[e])
            w, b = self._ptrs(2, sl, self.d)
            g.launch(prog, c, h.data.ptr + 4 * r0 * fp, fp, n, y.data.ptr + 4 * r0 * dp, dp,
                     variant=self._variant(g, n), ptrs=(w, w, b, b))
            r0 += n
        self.rows += P_
        self.calls += len(pairs)
        return y, keep

    def wait(self, handle) -> np.ndarray:
        """The (P, d) float32 outputs of ``launch``'s handle on the host: the call's one sync.
        Grouped: a view of the pinned buffer, valid until the next ``launch``."""
        if isinstance(handle, tuple):
            y, _ = handle
            return np.ascontiguousarray(y[:, :self.d].get())
        cp.cuda.get_current_stream().synchronize()
        if handle == 0:
            return np.empty((0, self.d), np.float32)
        return self._scratch.host[1][:handle * self.d].reshape(handle, self.d)

    def measure(self, rows: tuple[int, ...], n_used: int, reps: int = 5) -> dict:
        """Calibration timings of this tier's call (``launch`` then ``wait``, as a layer makes
        it: the table built and copied, the gather, the GEMVs, the copy down, the sync), the
        best of ``reps`` after a warm-up: "gpu_one", one expert (0) on rows[0] rows;
        "gpu_layer" {n: s}, n rows each routed to the same "gpu_k" = max(2, n_used) experts
        (0 .. gpu_k - 1, at most n_expert; a layer's experts have one shape and type), for n
        in ``rows`` (experts.gpu_split takes the call's fixed part and each expert's share
        from them; one expert's call alone, times n_used, counted the fixed part n_used
        times); "copy", seconds to copy one expert (gate, up and down) from pinned host
        memory to the device. The experts timed are uploaded for it when not here; the
        tier's counters are left as they were."""
        k = max(1, min(self.E, max(2, int(n_used))))
        held = list(self.ids)
        missing = [e for e in range(k) if not self.on[e]]
        if missing:
            self.place(held + missing)
        rng = np.random.default_rng(0)
        c = Ctx()
        counters = (self.rows, self.calls)

        def best_of(n: int, n_exp: int) -> float:
            x = cp.asarray(rng.standard_normal((n, self.k)).astype(np.float32))
            pairs = [(e, np.arange(n, dtype=np.int64), np.full(n, e, np.int64)) for e in range(n_exp)]
            self.wait(self.launch(pairs, x, c))
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                self.wait(self.launch(pairs, x, c))
                best = min(best, time.perf_counter() - t0)
            return best

        try:
            one = best_of(int(rows[0]), 1)
            layer = {int(n): best_of(int(n), k) for n in rows}
            raw = [st.raw(0) for st in (self.attrs["gate"], self.attrs["up"], self.attrs["down"])]
            nb = sum(int(r.nbytes) for r in raw)
            mem = cp.cuda.alloc_pinned_memory(nb)
            host = np.frombuffer(mem, np.uint8, nb)
            host[:] = np.concatenate([r.reshape(-1) for r in raw])
            dev = cp.empty(nb, cp.uint8)
            stream = cp.cuda.get_current_stream()
            copy = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nb, cp.cuda.runtime.memcpyHostToDevice,
                                            stream.ptr)
                stream.synchronize()
                copy = min(copy, time.perf_counter() - t0)
        finally:
            self.rows, self.calls = counters
            if list(self.ids) != held:
                self.place(held)
        return {"gpu_one": one, "gpu_layer": layer, "gpu_k": k, "copy": copy}
