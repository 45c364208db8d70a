"""A Program on the CUDA backend: its plan's steps run as a captured CUDA graph or eagerly.

Owns: ``CudaProgram`` (``CudaBackend.compile(program)``; the interface of
engine/backend/IR.md section 6: ``forward``, ``sample``, ``greedy``, ``last_logits``,
``new_kv_cache``, ``kv_cache_bytes``), binding each step of ``plan.plan`` to its executor,
and per KV cache the activation buffers, RoPE tables and captured graphs (``CacheState``);
graph capture and replay, the eager path. Leaves the order of ops to the Program (the
architecture's), the fusions to ``plan.py``, each step's launches to ``steps.py``,
``attention.py`` and ``moe.py`` (the GPU expert tier: ``experts.py``), a hybrid model's recurrent
steps and state (``kv.state``) to ``recurrent.py``, K and V to ``kv.py``,
the device tables to ``tables.py``, the kernels to ``kernels/`` (``source.py``) and the
sampler to ``sampling.py``, the prefill GEMM to ``gemm.py``, the kernel sites and their
candidates to ``choice.py`` and ``tune.py``, the artifact to ``kernel_choice``.

Two paths, one Program:
* **graph**: a batch of at most ``b_max`` rows in all (decode steps of many slots, verify
  windows, a short prefill) with at most one segment per slot replays a CUDA graph
  captured once per (row bucket, logits-row bucket) and KV cache: rows 1, 2, 4, ...
  b_max. Every kernel reads each row's token, slot and position from the row table;
  padding rows point at the scratch slot. The steps are GEMVs over the quantized weights
  with the plan's fusions in their prologues and epilogues (for llama, per layer: QKV with
  RMSNorm, RoPE and the KV write; split-context attention; O + residual; gate/up with
  RMSNorm and SwiGLU; down + residual), then ``sample_rows``, which writes a publication
  record per logits row. No cuBLAS inside. Rows of one slot at consecutive positions are
  causal without a mask: a layer's K and V rows are all written before its attention reads.
  Each GEMV launch runs the variant (rows per block, warps per row pair, where the norm
  scale is computed) the kernel choice recorded for its (site, bucket); int8 GEMVs of
  ``mmq_min_rows`` rows and more run as the MMQ (``mmq.py``: int8 tensor cores, its bits).
* **eager**: anything larger (prefill chunks) and batches with image rows. Steps on batch
  rows run ``gemm.PrefillGemm`` (cuBLAS on tensor cores: float16 or TF32 inputs, float32
  accumulation; the mode per weight is the kernel choice's; dense dequantized weight copies
  when they fit a budget, else one tile at a time); attention as ``attention.py`` says;
  steps on the logits rows (after ``take_rows``) run the graph's GEMVs. With
  ``prefill="gemv"`` every eager step runs the graph's kernels instead (batch-invariant
  prefill: the MMQ with int8 activations, else slow on large models).

Batch invariance: every GEMV variant, and the MMQ (``kernels/mmq.cu``), reduce each output
element in one canonical order (``kernels/gemv.cu``), so through the graph a row's numbers do
not depend on the other rows, the bucket, the variant or the MMQ, and the eager path's GEMVs
(logits rows) agree with the graph's.
The eager path's cuBLAS GEMMs and attention round differently: a prefill chunk of more
rows than a graph takes gives logits within about 1e-3 (relative) of the same rows run
through the graph, not the same bits; ``prefill="gemv"`` gives the same bits at the cost
BENCHMARKS.md and tests/tools/GPU_NOTES.md show.

Not thread-safe: one engine thread drives a program and its caches.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import mmq as MQ
from aotx.engine.backend.cuda import moe
from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import recurrent as RS
from aotx.engine.backend.cuda import sampling as CS
from aotx.engine.backend.cuda.attention import ATT_NSMAX, AttendStep, EagerBatch
from aotx.engine.backend.cuda.gemm import PrefillGemm
from aotx.engine.backend.cuda.kv import CudaKVCache, check_kv_type
from aotx.engine.backend.cuda.matrix import q8_buffers
from aotx.engine.backend.cuda.moe import MoeStep, Segments
from aotx.engine.backend.cuda.steps import (NT, Z64, Ctx, ElementwiseStep, EmbedStep, Gemv, GluRowsStep, GluStep,
                                            HeadOpStep, KVStoreStep, LinearStep, NormStep, QKVStep, TakeRowsStep, i32,
                                            pow2, qname, weights_of)
from aotx.engine.backend.cuda.tables import DeviceTables, rows_for
from aotx.engine.errors import ModelError

PREFILL_FORCED = ("f16", "tf32", "f32", "gemv")


class CacheState:
    """What the graphs of one KV cache use: device tables, activation buffers (b_max rows),
    attention scratch, RoPE tables, and the graphs themselves by (rows, logits rows)."""

    def __init__(self, prog: "CudaProgram", kv: CudaKVCache):
        b = rows_for(kv.n_slots)
        self.b_max = b
        self.tables = DeviceTables(b)
        self.bufs = [cp.zeros((b, w), cp.float32) for _, w in prog.plan.buffers]
        self.qkv = cp.zeros((b, prog.qkv_width), cp.float32) if prog.qkv_width else None
        self.xs = cp.zeros(b, cp.float32)
        self.xq, self.xd = q8_buffers(b, prog.q8_k)
        self.part = cp.zeros(b * prog.max_heads * ATT_NSMAX * (prog.max_hd + 2), cp.float32)
        self.counters = cp.zeros(b * prog.max_heads, cp.int32)
        self.rope = [tuple(cp.asarray(t) for t in spec.tables(kv.n_ctx)) for spec in prog.plan.rope_specs]
        self.graphs: dict[tuple[int, int], object] = {}
        # the zeros above are queued on the current stream; the graphs run on the cache's
        # non-blocking stream, which does not wait for it (the split attention's counters
        # must be zero before its first replay, or the first tick can read stale counts)
        cp.cuda.get_current_stream().synchronize()

    @property
    def nbytes(self) -> int:
        n = sum(int(a.nbytes) for a in self.bufs) + self.tables.nbytes + int(self.part.nbytes + self.counters.nbytes)
        n += int(self.xq.nbytes + self.xd.nbytes)
        return n + int(self.xs.nbytes) + (int(self.qkv.nbytes) if self.qkv is not None else 0)


_BIND = {P.Embed: EmbedStep, P.QKV: QKVStep, P.Attend: AttendStep, P.KVStore: KVStoreStep, P.TakeRows: TakeRowsStep,
         P.Norm: NormStep, P.HeadOp: HeadOpStep, P.Elementwise: ElementwiseStep, P.GluRows: GluRowsStep,
         P.MoeHost: MoeStep, **RS.BIND}


class CudaProgram:
    """A Program compiled for a CudaBackend. See the module docstring.

    ``prefill``: None (each eager weight's GEMM mode from the kernel choice) or one of
    ``PREFILL_FORCED`` for every weight ("gemv": the graph's kernels, batch-invariant);
    ``gemv``: None (the kernel choice's variant per site and bucket) or one variant name
    (``choice.GemvVariant``) for every GEMV. ``kernel_choice``: the
    ``kernel_choice.Resolution`` of this load (its ``summary()`` goes to the startup
    profile)."""

    device_sampling = True

    def __init__(self, program, backend, *, fuse: bool = True, prefill: str | None = None, gemv: str | None = None):
        self.backend = backend
        if prefill is not None and prefill not in PREFILL_FORCED:
            raise ValueError(f"prefill mode {prefill!r} is not one of {', '.join(PREFILL_FORCED)}")
        self._forced_prefill = prefill
        self._forced_gemv = CC.GemvVariant.parse(gemv) if gemv else None
        # int8 activations for every GEMV whose weight types have an integer form, on models
        # big enough that reading weights, not launching kernels, bounds a decode step
        self.int8_activations = bool(getattr(backend, "int8_activations", False)) and \
            int(getattr(backend, "weight_bytes", 0)) >= int(getattr(backend, "int8_min_bytes", 0))
        if hasattr(backend, "numerics"):
            backend.numerics = "cuda-int8" if self.int8_activations else "cuda-f32"
        self.q8_k = 0                  # the most inputs of such a GEMV (the size of the xq scratch rows)
        self.mmq_min_rows = MQ.program_min_rows(backend, self.int8_activations)   # the MMQ from this many rows
        self.mmq_smem_max = MQ.smem_limit(backend) if self.mmq_min_rows is not None else 0
        try:
            self.plan = P.plan(program, fuse=fuse)
        except P.PlanError as e:
            raise ModelError(f"the CUDA backend cannot run this model: {e}") from None
        kl = self.plan.kv_layers
        if not kl or len({(L.n_kv_heads, L.head_dim) for L in kl}) != 1:
            raise ModelError("the CUDA backend needs the same KV heads and head dimension in every layer")
        self.n_layers, self.n_kv, self.head_dim = len(kl), kl[0].n_kv_heads, kl[0].head_dim
        self.vocab = self.plan.vocab
        self.d_model = self.plan.d_model
        self.need: set[str] = {"rms_norm", "bias_rows", "glu_rows", "row_scale", "quant_rows"}
        self.qkv_width = 0
        self.max_heads = 1
        self.max_hd = 32
        self.gemvs: list[Gemv] = []
        self.psites: dict[str, dict] = {}          # prefill site key -> its weights, shape, input
        self.refs: dict[int, int] = {}
        for s in self.plan.steps:
            for w in weights_of(s):
                self.refs[id(w)] = self.refs.get(id(w), 0) + 1
        rows_of = {}
        self._producer: dict[int, object] = {}
        for s in self.plan.steps:
            for v in P.writes(s):
                rows_of[id(s)] = self.plan.buffers[self.plan.loc[v].buf][0]
                self._producer[v] = s
        # the CPU expert tier's thread: it computes the CPU's experts while this thread
        # launches the GPU tier's (a mixture of experts only; started on first use)
        self.moe_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aotx-cpu-experts") \
            if any(isinstance(s, P.MoeHost) for s in self.plan.steps) else None
        self.moe_scratch: dict = {}    # the GPU expert tiers' shared buffers (MoeScratch) per shape
        self.moe_stages: dict = {}     # the moe steps' shared pinned rows (MoeStage) per width
        self.moe_device_scratch: dict = {}   # the device moe steps' graph-path buffers per (rows, shape)
        self.moe_eager_scratch: dict = {}    # their eager-path buffers per shape (grown on demand)
        self.expert_cache = None       # the learned GPU expert cache (experts.LearnedCache) or None: static
        self._cache_stage: tuple = ()  # its pinned staging (memory, uint8 view, event of the last copies)
        self.expert_copy = {"bytes": 0, "seconds": 0.0}
        self.steps = []
        self.state_steps: dict[int, object] = {}   # a hybrid model's state layer -> its step (recurrent.py)
        for s in self.plan.steps:
            rows = rows_of.get(id(s), P.ROWS_N)
            if isinstance(s, P.Linear):
                b = LinearStep(self, s, rows)
            elif isinstance(s, P.Glu):
                b = GluStep(self, s, rows)
            else:
                b = _BIND[type(s)](self, s)
            self.steps.append(b)
        self.moe_steps = [b for b in self.steps if isinstance(b, MoeStep)]
        out_loc = self.plan.loc[self.plan.output]
        self.out_buf = out_loc.buf
        self.v_ld = self.plan.buffers[out_loc.buf][1]
        self._blas = cp.cuda.device.get_cublas_handle()
        # kernel choice: a variant per (GEMV site, bucket), a GEMM mode per prefill site;
        # timing (policy auto/force) compiles the candidates itself (tune.kernels)
        from aotx.engine.backend.cuda import tune as cuda_tune

        t0 = time.perf_counter()
        self._gv: dict[tuple[str, int], CC.GemvVariant] = {}
        self._pm: dict[str, str] = {}
        self._tune_k: dict = {}
        self.kernel_choice = cuda_tune.resolve_choices(self)
        self.kernel_choice_s = round(time.perf_counter() - t0, 3)
        for g in self.gemvs:
            for v in self._variants_of(g.site):
                self.need.update(g.name(v, m) for m in g.modes())
            if g.mmq is not None:
                self.need.update(g.mmq.names(g.modes()))
        qtypes = {int(w.qtype) for d in self.psites.values() for w in d["weights"]}
        self.need.update(PrefillGemm.kernel_names(qtypes))
        missing = sorted(self.need - set(self._tune_k))
        self.k = {**self._tune_k, **(backend.module(missing) if missing else {})}
        self._tune_k = {}
        MQ.prepare(self.k, self.gemvs)
        self.gemm = PrefillGemm(self.k, self._blas)
        self._plan_dense()
        self.ks = backend.sampler_kernel()
        self._last_logits: cp.ndarray | None = None
        self._eager_logits: cp.ndarray | None = None
        self._eager_out_meta = np.zeros((2, 0), np.int32)
        self._keep: list = []          # the eager path's scratch arrays, alive until its forward returns
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.mask_table: CS.MaskTable | None = None   # constrained rows' token bitmasks (load_masks)

    # ---- load-time helpers -------------------------------------------------------------------

    def prefill_site(self, step, weights: list, m: int, norm, x: int) -> str:
        """Register the eager GEMM of ``weights`` (one op: a linear, the two halves of a
        GLU, one matrix of a QKV) and return its kernel-choice site key. Its input counts
        as bounded (float16 is a candidate) when it is RMS-normed here or comes from a
        non-residual norm or an attention step."""
        src = self._producer.get(x)
        bounded = norm is not None or isinstance(src, P.Attend) or (isinstance(src, P.Norm) and not src.add)
        names = sorted({qname(w.qtype) for w in weights})
        key = CC.prefill_site("+".join(names), m, int(weights[0].k), bounded)
        d = self.psites.setdefault(key, {"weights": [], "m": m, "k": int(weights[0].k), "bounded": bounded,
                                         "norm": norm})
        d["weights"].extend(weights)
        return key

    def _plan_dense(self) -> None:
        """Dense prefill copies (``gemm.py``) when every eager GEMM's dequantized weight
        fits the budget (``CudaBackend(dense_prefill=False)``: always tiles)."""
        uses = []
        for key, d in self.psites.items():
            mode = self.prefill_mode(key)
            if mode in ("f16", "tf32", "f32"):
                uses.extend((w, mode) for w in d["weights"])
        if not getattr(self.backend, "dense_prefill", True):
            self.gemm.plan_dense(uses, -1)
            self.gemm.dense_reason = "tiles: dense prefill copies turned off"
            return
        try:
            free = int(cp.cuda.Device().mem_info[0])
        except Exception:  # noqa: BLE001 - a runtime without the query: the fixed cap alone
            free = None
        self.gemm.plan_dense(uses, PrefillGemm.dense_budget(free))

    def prefill_mode(self, site: str | None) -> str | None:
        """The eager GEMM mode of a prefill site (None for a step on logits rows)."""
        if site is None:
            return None
        if self._forced_prefill is not None:
            return self._forced_prefill
        return self._pm[site]

    def gemv_variant(self, site: str, rows: int) -> CC.GemvVariant:
        """The variant a GEMV of ``site`` launches over ``rows`` batch rows."""
        if self._forced_gemv is not None:
            return self._forced_gemv
        return self._gv[(site, CC.tune_bucket(rows))]

    def _variants_of(self, site: str) -> set:
        if self._forced_gemv is not None:
            return {self._forced_gemv}
        return {v for (s, _), v in self._gv.items() if s == site}

    def keep(self, *arrays) -> None:
        """Keep eager scratch arrays (or Prepared activations) alive until the forward returns."""
        self._keep.extend(arrays)

    def bias_rows(self, y: int, ldy: int, bias: cp.ndarray, N: int, m: int) -> None:
        n_el = N * m
        self.k["bias_rows"](((n_el + NT - 1) // NT,), (NT,), (np.uint64(y), i32(ldy), bias, i32(N), i32(m)))

    # ---- the interface of engine/backend/IR.md section 6 ---------------------------------------

    @property
    def weight_bytes(self) -> int:
        return self.backend.weight_bytes

    @property
    def prefill_weight_bytes(self) -> int:
        """Bytes the eager (prefill) path adds for weights: the dense dequantized copies
        when the model's fit the budget, else the one dequantized-tile scratch buffer of
        the prefill GEMM (0 when every eager step runs the graph's GEMVs)."""
        if not self.psites or self._forced_prefill == "gemv":
            return 0
        return self.gemm.weight_bytes

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx, kv_type)`` allocates: K and V, and a hybrid model's state."""
        return CudaKVCache.nbytes(self.n_layers, self.n_kv, self.head_dim, n_slots, n_ctx, kv_type) + (
            RS.CudaRecurrentState.nbytes(self.plan.state_layers, self.state_steps, n_slots))

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> CudaKVCache:
        """A zeroed cache of ``n_slots`` slots of ``n_ctx`` tokens, with its graphs' state."""
        check_kv_type(kv_type)
        kv = CudaKVCache(self.n_layers, self.n_kv, self.head_dim, n_slots, n_ctx, kv_type)
        kv.state = RS.CudaRecurrentState(self.plan.state_layers, self.state_steps, n_slots, kv.stream, self.k) \
            if self.plan.state_layers else None          # a hybrid model's recurrent state (recurrent.py)
        self._states[kv] = CacheState(self, kv)
        return kv

    def _state(self, kv: CudaKVCache) -> CacheState:
        st = self._states.get(kv)
        if st is None:
            raise ValueError("this KV cache was not made by this program's new_kv_cache")
        return st

    def last_logits(self) -> cp.ndarray | None:
        """Device float32 (rows, vocab) logits of the last forward, greedy or sample call."""
        lg = self._last_logits
        if isinstance(lg, tuple):             # a replay's output buffer and its logits rows
            buf, R = lg
            lg = self._last_logits = buf[:R, :self.vocab]
        return lg

    def forward(self, tokens: np.ndarray, layout, kv: CudaKVCache, embeds=None) -> np.ndarray:
        """Run one batch; host float32 (R, vocab) logits (engine/backend/IR.md section 6)."""
        if embeds is None and self._graph_ok(layout, kv):
            self._replay(tokens, layout, kv, None, 0, want_ids=False)
            return self.last_logits().get()
        lg = self._eager(tokens, layout, kv, embeds)
        return lg.get() if lg is not None else np.empty((0, self.vocab), np.float32)

    def greedy(self, tokens: np.ndarray, layout, kv: CudaKVCache) -> np.ndarray:
        """Like ``forward`` but returns only the argmax id of each logits row, int32 (R,),
        computed on the device (the logits stay in ``last_logits()``)."""
        return self.sample(tokens, layout, kv, None)

    def sample(self, tokens: np.ndarray, layout, kv: CudaKVCache, rows, tick: int = 0) -> np.ndarray:
        """Run one batch and pick each logits row's next token on the device.

        rows: one ``(SamplerConfig, SamplerState, extra_history)`` per logits row (each must
        pass ``sampling.device_ok``), or None for greedy without penalty everywhere.
        The states are not advanced here (the caller mirrors the draws). Returns int32
        (R,) ids; the penalized logits stay in ``last_logits()``. Raises RuntimeError when
        a publication record does not belong to this tick."""
        if self._graph_ok(layout, kv):
            return self._replay(tokens, layout, kv, rows, tick, want_ids=True)
        lg = self._eager(tokens, layout, kv)
        if lg is None:
            return np.empty(0, np.int32)
        R = lg.shape[0]
        prm = np.zeros((R, CS.P_WORDS), np.int32)
        hist = np.zeros((R, CS.H_MAX), np.int32)
        CS.fill_rows(prm, hist, rows, list(range(R)), tick)
        ids = cp.empty(R, cp.int32)
        rec = cp.empty((R, CS.REC_WORDS), cp.int32)
        meta = cp.asarray(self._eager_out_meta)
        self.ks((R,), (1024,), (self._eager_logits, i32(self._eager_logits.shape[1]), i32(self.vocab), cp.asarray(prm),
                                cp.asarray(hist), meta[0], meta[1], Z64, ids, rec))
        return ids.get()

    def samples_exactly(self, cfg, state, n_drafts: int = 0) -> bool:
        """Whether ``sample`` picks exactly what the host's ``sampling.sample`` would for a row
        with sampler ``cfg`` and state ``state`` (a verify window of ``n_drafts`` drafts):
        ``cuda_sampling.device_ok`` and the penalty window fits the device table."""
        return CS.device_ok(cfg, n_drafts) and CS.fits_history(cfg, state)

    def load_masks(self, masks: np.ndarray) -> list[int]:
        """Copy a tick's token bitmasks ((n, ceil(vocab / 32)) int32) to the device's mask
        table (``cuda_sampling.MaskTable``, made on the first call); each row's device
        address, for its sampler row's ``mask_ptr``. ValueError for masks of another width."""
        if self.mask_table is None:
            self.mask_table = CS.MaskTable(self.vocab)
        return self.mask_table.load(masks)

    # ---- expert tiers (engine/model/experts.py's plan): "gpu" on the device, "host"/"mmap" on the CPU

    def measure_experts(self, layer: int, rows: tuple[int, ...]) -> dict:
        """Calibration of moe layer ``layer`` (``moe.measure_experts``)."""
        return moe.measure_experts(self, layer, rows)

    def place_experts(self, plan) -> dict:
        """Apply an expert-tier plan (``moe.place_experts``)."""
        return moe.place_experts(self, plan)

    def attach_expert_cache(self, cache) -> None:
        """Run the learned GPU expert cache from the next tick on, or none (``moe.attach_expert_cache``)."""
        moe.attach_expert_cache(self, cache)

    def _learn_experts(self) -> None:
        moe.learn_experts(self)

    def expert_stats(self) -> dict:
        """The expert tiers' counters (``moe.expert_stats``)."""
        return moe.expert_stats(self)

    # ---- graph path ---------------------------------------------------------------------------

    @property
    def moe_device_layers(self) -> tuple[bool, ...]:
        """Per moe layer: it runs as the device step once every expert is on the GPU tier
        (the expert planner's ``device_layers``)."""
        return tuple(st.dev_why is None and st.gpu.ok for st in self.moe_steps)

    def drop_graphs(self) -> None:
        """Forget every captured graph (and the device moe steps' buffers they name): the
        GPU expert tier's stacks moved (placement)."""
        for st in list(self._states.values()):
            st.graphs.clear()
        self.moe_device_scratch.clear()

    def _graph_ok(self, layout, kv: CudaKVCache) -> bool:
        if self.moe_steps and not all(m.device_ready() for m in self.moe_steps) \
                and not getattr(self.backend, "moe_graphs", False):
            return False                # a host moe step: the eager path (moe_graphs: graphs between them)
        n = int(layout.n_rows)
        if n == 0 or n > self._state(kv).b_max:
            return False
        gm = getattr(self.backend, "gemm_min_rows", None)    # opt-in: many rows on the eager path's GEMMs
        if gm is not None and n >= gm:
            return False
        segs = layout.segments
        if len(segs) == 1:
            return True
        slots = [s.slot for s in segs]
        return len(set(slots)) == len(slots)

    def _ctx(self, kv: CudaKVCache, st: CacheState, n: int, r: int) -> Ctx:
        c = Ctx()
        c.plan, c.kv, c.st, c.bufs, c.n, c.r = self.plan, kv, st, st.bufs, n, r
        t = st.tables
        c.tok_p, c.slot_p, c.pos_p, c.out_p = t.tok_ptr, t.slot_ptr, t.pos_ptr, t.out_ptr
        c.part, c.counters = st.part, st.counters
        c.xs, c.xq, c.xd, c.qkv, c.rope = st.xs, st.xq, st.xd, st.qkv, st.rope
        c.eager, c.layout = False, None
        return c

    def _launches(self, kv: CudaKVCache, st: CacheState, b: int, r: int, steps: list | None = None,
                  sampler: bool = True) -> None:
        """Every launch of one replay: ``b`` batch rows, ``r`` logits rows; ``steps``: only
        these (one segment of ``Segments``), the sampler only with ``sampler``. A host moe
        step among them (the plain run before a segmented capture, on padding rows) is
        skipped: it is not captured, and its rows would count as traffic."""
        self._launch_steps(kv, st, b, r, steps)
        if sampler:
            self._launch_sampler(st, r)

    def _launch_steps(self, kv: CudaKVCache, st: CacheState, b: int, r: int, steps: list | None) -> None:
        """The steps' launches of one replay (``_launches``; a tool may run them another way)."""
        c = self._ctx(kv, st, b, r)
        for s in (self.steps if steps is None else steps):
            if not (isinstance(s, MoeStep) and not s.device_ready()):
                s.graph(self, c)

    def _launch_sampler(self, st: CacheState, r: int) -> None:
        """``sample_rows`` over the ``r`` logits rows: ids and publication records."""
        t = st.tables
        self.ks((r,), (1024,), (st.bufs[self.out_buf], i32(self.v_ld), i32(self.vocab), t.prm, t.hist,
                                np.uint64(t.slot_ptr), np.uint64(t.pos_ptr), np.uint64(t.out_ptr), t.ids, t.rec))

    def _capture(self, kv: CudaKVCache, st: CacheState, b: int, r: int):
        s = kv.stream
        t = st.tables
        with s:
            # a plain run first (loads every kernel), on padding rows only: the scratch slot
            t.tab[0].fill(0)
            t.tab[1].fill(kv.scratch_slot)
            t.tab[2].fill(0)
            t.tab[3].fill(0)
            t.prm.fill(0)
            self._keep = []
            self._launches(kv, st, b, r)
            s.synchronize()
            parts = self._segments()
            if len(parts) > 1:
                lists, graphs = parts[0::2], []
                for i, seg in enumerate(lists):
                    last = i == len(lists) - 1
                    if not seg and not last:
                        graphs.append(None)
                        continue
                    s.begin_capture()
                    self._launches(kv, st, b, r, steps=seg, sampler=last)
                    graphs.append(s.end_capture())
                for g in graphs:
                    if g is not None:
                        g.upload(s)
                return Segments(graphs, parts[1::2])
            s.begin_capture()
            self._launches(kv, st, b, r)
            g = s.end_capture()
        g.upload(s)
        return g

    def _segments(self) -> list:
        """The steps cut at the host moe steps: [steps, host step, steps, ..., steps] (one
        list when every moe step runs on the device or there is none)."""
        out, cur = [], []
        for s in self.steps:
            if isinstance(s, MoeStep) and not s.device_ready():
                out += [cur, s]
                cur = []
            else:
                cur.append(s)
        return out + [cur]

    def _replay(self, tokens: np.ndarray, layout, kv: CudaKVCache, rows, tick: int, want_ids: bool):
        st = self._state(kv)
        kv.state is not None and kv.state.begin(layout)      # checks every segment before a row runs
        t = st.tables
        n = int(tokens.shape[0])
        b = pow2(n)
        R = t.fill_rows(tokens, layout, b, kv.scratch_slot)
        r = pow2(max(R, 1))
        prm = t.prm_np
        prm[:r] = 0
        need_hist = False
        if want_ids and R:
            need_hist = CS.fill_rows(prm, t.hist_np, rows, R, tick)
        if self.expert_cache is not None:
            with kv.stream:                # between ticks (a segmented tick: host steps among the graphs); its
                self._learn_experts()      # copies on the stream the graphs and host steps run on, ahead of them
        g = st.graphs.get((b, r))
        if g is None:
            g = st.graphs[(b, r)] = self._capture(kv, st, b, r)
        s = kv.stream
        t.upload(s, r, need_hist)
        if isinstance(g, Segments):
            g.launch(self, kv, st, b, r, layout, s)
        else:
            g.launch(s)
        if want_ids:
            t.download_records(s, R)
        s.synchronize()  # before anything on another stream reads the graph's output
        kv.state is not None and kv.state.end()
        self._last_logits = (st.bufs[self.out_buf], R)    # sliced when asked for (last_logits)
        if want_ids:
            rec = t.rec_np[:R]
            if R and (rec[:, 0] != (tick & 0x7FFFFFFF)).any():
                raise RuntimeError(f"publication records of tick {int(rec[0, 0])} where tick {tick} was expected")
            return rec[:, 3].copy()
        return None

    # ---- eager path (prefill, image rows) ----------------------------------------------------

    def _eager(self, tokens: np.ndarray, layout, kv: CudaKVCache, embeds=None) -> cp.ndarray | None:
        if self.expert_cache is not None:
            self._learn_experts()          # between ticks: before this tick's first launch
        st = self._state(kv)
        kv.state is not None and kv.state.begin(layout)
        N = int(tokens.shape[0])
        out_rows = layout.out_rows.astype(np.int32)
        R = int(out_rows.shape[0])
        meta = np.empty((4, max(N, R, 1)), np.int32)
        meta[0, :N] = tokens
        if embeds is not None:
            meta[0, np.asarray(embeds[0], np.int64)] = 0   # placeholder ids lie past the vocabulary
        meta[1, :N] = layout.slots
        meta[2, :N] = layout.positions
        meta[3, :R] = out_rows
        m_dev = cp.asarray(meta)
        w = meta.shape[1]
        c = Ctx()
        c.plan, c.kv, c.st, c.n, c.r = self.plan, kv, st, N, R
        c.bufs = [cp.empty((N if rk == P.ROWS_N else max(R, 1), wd), cp.float32) for rk, wd in self.plan.buffers]
        c.tok_p, c.slot_p, c.pos_p, c.out_p = (m_dev.data.ptr, m_dev.data.ptr + 4 * w, m_dev.data.ptr + 8 * w,
                                               m_dev.data.ptr + 12 * w)
        c.eager = True
        c.layout = layout
        gemv_only = self._forced_prefill == "gemv"
        c.layout_info = EagerBatch(layout, meta[1, :N], meta[2, :N], self.max_heads, self.max_hd, all_short=gemv_only)
        c.part, c.counters = c.layout_info.part, c.layout_info.counters
        c.xs = cp.empty(max(N, R, 1), cp.float32)
        c.xq, c.xd = q8_buffers(max(N, R, 1) if self.q8_k else 1, self.q8_k)
        c.qkv = cp.empty((N, self.qkv_width), cp.float32) if gemv_only and self.qkv_width else None
        c.rope = st.rope
        self._keep = []
        cublas.setStream(self._blas, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(self._blas, cublas.CUBLAS_POINTER_MODE_HOST)
        for s in self.steps:
            s.eager(self, c)
            if embeds is not None and isinstance(s, EmbedStep):
                x = c.arr(s.s.out)
                x[cp.asarray(np.asarray(embeds[0], np.int64))] = cp.asarray(embeds[1], dtype=cp.float32)
        self._keep = []
        kv.state is not None and kv.state.end()
        self._eager_out_meta = np.ascontiguousarray(meta[1:3, out_rows]) if R else np.zeros((2, 0), np.int32)
        if R == 0:
            self._last_logits = None
            cp.cuda.get_current_stream().synchronize()  # the graph's stream does not wait on this one
            return None
        lg = c.bufs[self.out_buf][:R]
        self._eager_logits = lg
        self._last_logits = lg[:, :self.vocab]
        return self._last_logits

