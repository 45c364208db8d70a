"""The CUDA backend: weights on the GPU in their GGUF block layout, CuPy RawModule kernels.

Owns: the device check, uploading GGUF tensors (``matrix``, ``vector``), compiling the
kernels of ``kernels/`` (``source.py`` joins them into modules) once per set of template instances (CuPy caches the compiled
module on disk, keyed by source and options), and ``compile(program)``: an
``ops.Program`` (the architecture's forward, traced once at load) becomes a
``program.CudaProgram``, which owns buffers, the order of launches and the graphs.
Nothing here, nor in any module of this package, is specific to an architecture.

Importing this module imports CuPy, so ``import aotx.engine.backend.cuda.backend`` failing with
ImportError is how ``serve.pick_device`` learns that the CUDA backend is unavailable.

Supported tensor types (``source.TYPES``): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4. The other IQ* types, TQ* and NVFP4 are
refused with ModelError. Rows must hold a multiple of 32 inputs (256 for the K types and
IQ4_XS).
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from aotx.engine.backend import kernel_choice
from aotx.engine.backend.cuda import choice as cuda_choice
from aotx.engine.backend.cuda import source as cuda_src
from aotx.engine.backend.cuda.matrix import DevMatrix  # noqa: F401 - the upload's result type, named here too
from aotx.engine.backend.cuda.mmq import DEFAULT_MIN_ROWS as MMQ_DEFAULT_MIN_ROWS
from aotx.engine.errors import ModelError

SUPPORTED_TYPES: frozenset[T] = frozenset(T(c) for c in cuda_src.TYPES)
NVRTC_OPTIONS = ("-std=c++17",)
INT8_MIN_BYTES = 1 << 30        # int8 activations from this many bytes of weights (see CudaBackend)
# NVRTC's refusal (CuPy compiles a RawModule when its first function is asked for)
_COMPILE_ERRORS = (getattr(getattr(cp.cuda, "compiler", None), "CompileException",
                           type("_NoCompileError", (Exception,), {})),)


def _u64(a) -> np.uint64:
    """A device pointer as a kernel argument (a cupy array or a raw address)."""
    if a is None:
        return np.uint64(0)
    if isinstance(a, (int, np.integer)):
        return np.uint64(a)
    return np.uint64(a.data.ptr)


def compile_module(module: cuda_src.Module, name_expressions, kernels=None) -> dict[str, cp.RawKernel]:
    """Compile ``module`` (``source.Module``) with these template instances through NVRTC (or
    fetch it from CuPy's disk cache): name -> RawKernel for ``kernels`` (default: the name
    expressions). Raises ``source.KernelCompileError`` naming each error's file:line."""
    names = list(name_expressions)
    mod = cp.RawModule(code=module.text, options=NVRTC_OPTIONS, name_expressions=names or None)
    try:
        return {n: mod.get_function(n) for n in (names if kernels is None else kernels)}
    except _COMPILE_ERRORS as e:
        raise cuda_src.compile_error(module, e) from None


class CudaBackend:
    """Op set on one NVIDIA GPU through CuPy. ``weight_bytes`` counts the quantized
    weights uploaded. ``fuse=False`` compiles programs without the fused kernels (tests of
    the generic path).

    Kernel choice (DESIGN.md, "Kernel choice"; ``kernel_choice``): ``tune`` is the policy for the
    artifact under ``artifact_root`` (default: the data dir): "off" (default: fixed
    default kernels, no file read or written: tests and tools), "reuse" (a valid
    artifact's winners, else defaults), "auto" (what the engine uses: sites without a
    valid winner are timed at load, within ``tune_budget_s``, and recorded) or "force"
    (``aotx tune``: every site timed again). ``prefill`` / ``gemv`` force one eager GEMM
    mode / one GEMV variant everywhere (``CudaProgram``; tests and benchmarks).
    ``dense_prefill``: the eager GEMMs keep dense dequantized weight copies when they fit
    the budget (``gemm.py``; default), False: always per-tile dequantization.
    ``int8_activations``: every decode GEMV whose weight types have an integer form (all but
    F32, F16, BF16 and Q2_K) rounds its activations to int8 per 32-input block (``quant_rows``)
    and runs integer dot products (``__dp4a``), as llama.cpp's MMVQ; what the engine loads
    (``make_backend``). Logits then differ from float arithmetic by about 1e-2 relative, as the
    CPU's int8 path; still one reduction order per output, so the same bits whatever the batch
    bucket or variant. False (the default here: tests and tools): float32 activations.
    ``int8_min_bytes``: with int8 activations asked, a model whose weights on the device
    take fewer bytes keeps float32 ones (default ``INT8_MIN_BYTES``, 1 GiB): there the
    decode step is bound by its launches, not by reading weights, and ``quant_rows`` adds
    one launch per GEMV site (measured on the 8B shape only; 0 forces int8 everywhere).
    ``numerics`` names the path the last compiled program took: "cuda-int8" or "cuda-f32".
    ``expert_int8``: the CPU expert tier of a mixture of experts uses the CPU backend's
    int8-activation kernels (default; False: its float path, for comparisons).
    ``gemm_min_rows``: batches of at least this many rows (decode ticks of many slots
    included) run the eager path, tensor-core GEMMs over dequantized weights, instead of the
    captured graph of GEMVs, which reads the weights once per 16-row block (an 8B model at
    64 rows: 0.45x llama.cpp's aggregate on an H100). None (the default): the graph up to
    its largest bucket. A measurement knob, not batch-invariant: a row's bits depend on
    whether its batch reached the threshold.
    ``mmq_min_rows``: with int8 activations on sm_80+, a GEMV launch over at least this many
    batch rows (decode ticks of that many slots, verify windows, and the eager path's steps
    with ``prefill="gemv"``) runs as the MMQ (``mmq.py``, kernels/mmq.cu): int8 tensor cores,
    the weights read once per tile of up to 64 rows, and every output the int8 GEMV's bits (the
    same integers, float tail and reduction order), so batch invariance holds across the
    threshold. None turns it off (the GEMV at every row count). Default ``mmq.DEFAULT_MIN_ROWS``.
    ``moe_device``: a mixture-of-experts layer whose experts are all on the GPU tier runs
    as a device step (router, routing, experts and join on the device, captured in the
    decode graph; default); False: every moe layer runs as the host step (comparisons).
    ``moe_graphs``: a tick with host moe steps (experts on the CPU tier) runs as captured
    graphs between them instead of the eager path (``moe.Segments``; opt-in: not
    yet run on a GPU).

    Raises ModelError when CuPy sees no CUDA device."""

    name = "cuda"
    supported_types = SUPPORTED_TYPES

    def __init__(self, device: int = 0, *, fuse: bool = True, tune: str = "off",
                 tune_budget_s: float = kernel_choice.DEFAULT_BUDGET_S, artifact_root=None,
                 prefill: str | None = None, gemv: str | None = None, expert_int8: bool = True,
                 dense_prefill: bool = True, int8_activations: bool = False,
                 int8_min_bytes: int | None = None, gemm_min_rows: int | None = None, moe_device: bool = True,
                 moe_graphs: bool = False, mmq_min_rows: int | None = MMQ_DEFAULT_MIN_ROWS) -> None:
        if tune not in kernel_choice.POLICIES:
            raise ValueError(f"kernel choice policy {tune!r} is not one of {', '.join(kernel_choice.POLICIES)}")
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 - the driver's errors come in many classes
            raise ModelError(f"--device cuda: no usable CUDA driver ({e})") from None
        if n <= device:
            raise ModelError(f"--device cuda: CuPy sees {n} CUDA devices, device {device} does not exist")
        self.device = cp.cuda.Device(device)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(device)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.n_sm = int(props["multiProcessorCount"])
        self.weight_bytes = 0
        self.host_expert_bytes = 0       # mixtures of experts: experts kept for the CPU tier
        self.expert_int8 = bool(expert_int8)   # the CPU tier's kernels: int8 activations (False: float, tests)
        self.int8_activations = bool(int8_activations)
        self.int8_min_bytes = INT8_MIN_BYTES if int8_min_bytes is None else int(int8_min_bytes)
        self.numerics = "cuda-int8" if self.int8_activations else "cuda-f32"
        self._modules: dict[tuple[str, ...], object] = {}
        self._sampler = None
        self.fuse = fuse
        self.tune = tune
        self.tune_budget_s = float(tune_budget_s)
        self.artifact_root = artifact_root
        self.prefill = prefill
        self.gemv = gemv
        self.dense_prefill = bool(dense_prefill)
        self.moe_device = bool(moe_device)
        self.moe_graphs = bool(moe_graphs)
        if gemm_min_rows is not None and int(gemm_min_rows) < 2:
            raise ValueError(f"gemm_min_rows {gemm_min_rows!r}: at least 2 (None: off)")
        self.gemm_min_rows = None if gemm_min_rows is None else int(gemm_min_rows)
        if mmq_min_rows is not None and int(mmq_min_rows) < 1:
            raise ValueError(f"mmq_min_rows {mmq_min_rows!r}: at least 1 (None: off)")
        self.mmq_min_rows = None if mmq_min_rows is None else int(mmq_min_rows)

    def device_key(self) -> kernel_choice.DeviceKey:
        """The kernel-choice artifact key of this device and build: GPU name, driver and
        runtime versions, CuPy version, hash of the kernel sources and options."""
        rt = cp.cuda.runtime
        return kernel_choice.DeviceKey(
            gpu=self.device_name, driver=str(rt.driverGetVersion()), cuda=str(rt.runtimeGetVersion()),
            cupy=str(cp.__version__),
            source=kernel_choice.source_hash(cuda_src.KERNELS.text, cuda_src.SAMPLING.text, " ".join(NVRTC_OPTIONS),
                                             cuda_choice.CHOICE_VERSION))

    def artifact_path(self):
        """Where this device's kernel-choice artifact lives (None with tune "off")."""
        if self.tune == "off":
            return None
        from aotx.engine import paths

        root = self.artifact_root if self.artifact_root is not None else paths.data_dir()
        return kernel_choice.artifact_path(root, self.device_name)

    def compile(self, program, *, fuse: bool | None = None):
        """The CudaProgram of ``program`` (kernels chosen and compiled, weights placed;
        graphs are captured per KV cache on first use). ``fuse=False`` runs every op as a
        generic kernel (the fallback path; for tests). Raises ModelError for a program the
        CUDA backend cannot run (a head dimension its attention kernel lacks, say)."""
        from aotx.engine.backend.cuda.program import CudaProgram

        return CudaProgram(program, self, fuse=self.fuse if fuse is None else fuse, prefill=self.prefill,
                           gemv=self.gemv)

    # ---- tensors ---------------------------------------------------------------

    def matrix(self, t) -> DevMatrix:
        """A 2-D GGUF tensor (ggml shape ``[k, m]``) uploaded as a DevMatrix (m, k).

        Raises ModelError for an unsupported type or a row length that is not a whole
        number of the type's blocks."""
        qt = T(int(t.qtype))
        if qt not in SUPPORTED_TYPES:
            raise ModelError(f"tensor {t.name!r} has tensor type {qt.name}, which the CUDA backend does not support "
                             f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
        k, m = (int(s) for s in t.shape)
        be, bb = GGML_QUANT_SIZES[qt]
        if k % max(be, 32):
            raise ModelError(f"tensor {t.name!r}: rows of {k} inputs are not a multiple of {max(be, 32)}, "
                             f"which the CUDA kernels need for {qt.name}")
        rb = k // be * bb
        raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
        if raw.size != m * rb:
            raise ModelError(f"tensor {t.name!r}: {raw.size} bytes, expected {m} rows of {rb} bytes")
        m_pad = m + (m & 1)
        data = cp.zeros((m_pad, rb), cp.uint8)
        data[:m] = cp.asarray(raw.reshape(m, rb))
        dm = DevMatrix(t.name, int(qt), m, k, rb, data)
        self.weight_bytes += dm.nbytes
        return dm

    def vector(self, t) -> cp.ndarray:
        """A 1-D F32/F16/BF16 tensor as a float32 device array."""
        if len(t.shape) != 1:
            raise ModelError(f"tensor {t.name!r} should be 1-D, has shape {list(t.shape)}")
        qt = T(int(t.qtype))
        raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
        if qt == T.F32:
            v = raw.view(np.float32)
        elif qt == T.F16:
            v = raw.view(np.float16).astype(np.float32)
        elif qt == T.BF16:
            v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise ModelError(f"tensor {t.name!r} is {qt.name}; 1-D tensors must be F32, F16 or BF16")
        arr = cp.asarray(np.ascontiguousarray(v, dtype=np.float32))
        self.weight_bytes += int(arr.nbytes)
        return arr

    def array(self, t) -> np.ndarray:
        """A small F32/F16/BF16 tensor of any rank (a hybrid model's convolution kernel, ggml
        ``[K, C]``) as a host float32 array of the reversed shape ((C, K)); the step that
        reads it uploads it (``recurrent.ShortConvStep``)."""
        from aotx.engine.backend.quants import dequantize_rows

        n = int(np.prod(t.shape))
        flat = dequantize_rows(np.asarray(t.data).reshape(1, -1), t.qtype, slice(0, 1), n)[0]
        arr = np.ascontiguousarray(np.asarray(flat, np.float32).reshape(tuple(reversed(tuple(t.shape)))))
        self.weight_bytes += int(arr.nbytes)
        return arr

    def experts(self, t):
        """A 3-D GGUF expert tensor (ggml ``[k, m, E]``) for the CPU expert tier:
        ``cpu.experts.CpuExperts`` over the file's memory map (no GPU memory; counted in
        ``host_expert_bytes``). The moe op runs on the host (``plan.MoeHost``, ``moe.MoeStep``)."""
        from aotx.engine.backend.cpu.experts import CpuExperts

        if len(t.shape) != 3:
            raise ModelError(f"tensor {t.name!r} should be 3-D (experts), has shape {list(t.shape)}")
        st = CpuExperts(t, int8=self.expert_int8)
        self.host_expert_bytes += int(t.n_bytes)
        return st

    def expert_vectors(self, t) -> np.ndarray:
        """Per-expert biases (ggml ``[n, E]``) as host float32 (E, n), for the CPU tier."""
        from aotx.engine.backend.cpu.experts import expert_vectors

        arr = expert_vectors(t)
        self.host_expert_bytes += int(arr.nbytes)
        return arr

    def concat(self, name: str, parts: list[DevMatrix]) -> DevMatrix:
        """One DevMatrix of the rows of ``parts`` (same type and k; each m even)."""
        assert all(p.qtype == parts[0].qtype and p.k == parts[0].k and p.m % 2 == 0 for p in parts)
        data = cp.concatenate([p.data for p in parts])
        for p in parts:
            self.weight_bytes -= p.nbytes
            p.data = None  # type: ignore[assignment]
        dm = DevMatrix(name, parts[0].qtype, sum(p.m for p in parts), parts[0].k, parts[0].row_bytes, data)
        self.weight_bytes += dm.nbytes
        return dm

    # ---- kernels ---------------------------------------------------------------

    def module(self, names) -> dict[str, cp.RawKernel]:
        """Compile (or fetch from CuPy's disk cache) the source with these template
        instances and plain kernels; returns name -> RawKernel."""
        key = tuple(sorted(set(names)))
        got = self._modules.get(key)
        if got is None:
            got = self._modules[key] = compile_module(cuda_src.KERNELS, key)
        return dict(got)

    def sampler_kernel(self) -> cp.RawKernel:
        """The ``sample_rows`` kernel (``kernels/sampling.cu``; compiled once per backend)."""
        if self._sampler is None:
            self._sampler = compile_module(cuda_src.SAMPLING, (), ("sample_rows",))["sample_rows"]
        return self._sampler
