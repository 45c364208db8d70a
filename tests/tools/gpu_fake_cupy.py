"""A stand-in for CuPy that runs the CUDA backend's host code on a machine without a GPU.

Owns: ``install()``, which puts fake ``cupy`` and ``cupy_backends.cuda.libs.cublas``
modules into ``sys.modules``. Device arrays are numpy arrays (a subclass with
``.data.ptr`` and ``.get()``), so slicing, copies and the host-to-device tables behave;
kernels do NOT run. Instead every launch is CHECKED against the kernel's signature parsed
from the CUDA source (argument count, and numpy type per parameter: ``np.int32`` for
``int``, ``np.int64`` for ``long long``, ``np.float32`` for ``float``, ``np.uint64`` or an
array for a pointer), every non-null device pointer must lie inside a live allocation,
grids and blocks must be within CUDA's limits, and cuBLAS GEMMs must address only memory
inside their operands' allocations (leading dimensions and extents). A violation raises
``LaunchError`` at the launch, naming the kernel and the argument.

For ``tests/tools/gpu_dryrun.py`` (run in a subprocess by tests/test_cuda_host.py): it
finds wrong argument lists, missing template instances and pointer arithmetic off its
buffer before the code meets a GPU. Numbers are not computed: logits are garbage.

Except with ``emulate = True`` (a test sets it around the calls it checks): then
``quant_rows``, the int8 ``gemv`` and ``mmq`` compute their outputs bit for bit in their own
reduction orders (``tests/tools/gpu_fake_mmq.py``, by ``tests/tools/mmq_model.py``), and the GPU
expert tier's kernels (``gemv`` in modes store and swiglu without a norm, ``moe_gemv``,
``moe_gather``, ``swiglu_oai_rows``) compute their outputs in numpy from the memory their
pointers address (weights dequantized by gguf, each dot product in float64, one output row
at a time, rounded to float32), so the tier's tables, strides and offsets are checked by
value: the grouped launches must give the per-expert launches' values exactly, and both the
float64 reference's within rounding. It says nothing about the device's reduction order.
The device moe step's ``moe_route`` and ``moe_tiles`` always run (in numpy: cpu_moe.route's
rules, the pairs grouped by expert), and ``moe_join`` (zeros unless emulated); a captured
graph's launches run again, checks included, each time it is launched.
"""

from __future__ import annotations

import ctypes
import re
import sys
import types
import weakref

import numpy as np


class LaunchError(AssertionError):
    """A kernel launch or cuBLAS call the real device would reject or misread."""


# ---- device memory -------------------------------------------------------------------------

_allocs: list = []          # weakrefs to base FakeArrays (their memory is "device memory")
stats = {"launches": 0, "gemms": 0, "kernels": set(), "captures": 0}
emulate = False             # compute the GPU expert tier's kernels in numpy (module docstring)


class _Mem:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeArray(np.ndarray):
    """A device array: a numpy array whose memory stands for device memory."""

    def __array_finalize__(self, obj):
        _allocs.append(weakref.ref(self))     # views too: their memory is inside their base's

    @property
    def data(self):            # noqa: D401 - cupy's .data.ptr
        return _Mem(self.__array_interface__["data"][0])

    def get(self, stream=None):
        return np.array(np.asarray(self), copy=True)


def _own(a: np.ndarray) -> FakeArray:
    out = np.array(a, copy=True, order="C").view(FakeArray)
    _allocs.append(weakref.ref(out))
    return out


def _span_ok(p: int, nbytes: int) -> bool:
    """[p, p + nbytes) inside one live allocation."""
    if len(_allocs) > 20000:
        _allocs[:] = [r for r in _allocs if r() is not None]
    for r in reversed(_allocs):
        a = r()
        if a is None:
            continue
        base = a.__array_interface__["data"][0]
        if base <= p and p + nbytes <= base + a.nbytes:
            return True
    return False


def zeros(shape, dtype=np.float32):
    return _own(np.zeros(shape, dtype))


def empty(shape, dtype=np.float32):
    return _own(np.zeros(shape, dtype))


def ones(shape, dtype=np.float32):
    return _own(np.ones(shape, dtype))


def empty_like(a):
    return zeros(a.shape, a.dtype)


def asarray(a, dtype=None):
    if isinstance(a, FakeArray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _own(np.asarray(a, dtype=dtype))


def ascontiguousarray(a):
    return _own(np.ascontiguousarray(a))


def concatenate(parts, axis=0):
    return _own(np.concatenate([np.asarray(p) for p in parts], axis=axis))


def arange(*a, dtype=None):
    return _own(np.arange(*a, dtype=dtype))


def matmul(a, b):
    return _own(np.matmul(np.asarray(a), np.asarray(b)))


# ---- kernels ---------------------------------------------------------------------------------

_SIG = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)", re.S)


def signatures(src: str) -> dict[str, list[tuple[str, str]]]:
    """kernel name -> [(kind, param name)], kind one of ptr, int, i64, float."""
    out = {}
    for m in _SIG.finditer(src):
        params = []
        for p in m.group(2).split(","):
            p = " ".join(p.replace("__restrict__", "").replace("const", "").split())
            if not p:
                continue
            name = re.split(r"[\s*]+", p)[-1]
            if "*" in p:
                kind = "ptr"
            elif p.startswith("long long"):
                kind = "i64"
            elif p.startswith("int"):
                kind = "int"
            elif p.startswith("float"):
                kind = "float"
            else:
                raise ValueError(f"unknown parameter type in {m.group(1)}: {p!r}")
            params.append((kind, name))
        out[m.group(1)] = params
    return out


_KIND = {"int": np.int32, "i64": np.int64, "float": np.float32}


class RawKernel:
    def __init__(self, name: str, params: list):
        self.name, self.params = name, params
        self.max_dynamic_shared_size_bytes = 0     # CuPy's attribute: raised to launch with more than 48 KiB

    def __call__(self, grid, block, args, shared_mem=0):
        where = f"kernel {self.name}"
        if shared_mem > 227 * 1024 or (shared_mem > 48 * 1024 and shared_mem > self.max_dynamic_shared_size_bytes):
            raise LaunchError(f"{where}: {shared_mem} bytes of dynamic shared memory (limit raised to "
                              f"{self.max_dynamic_shared_size_bytes}; 48 KiB without, 227 KiB at most)")
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        block = tuple(block) if isinstance(block, tuple) else (block,)
        lim = (2 ** 31 - 1, 65535, 65535)
        for i, g in enumerate(grid):
            if not isinstance(g, (int, np.integer)) or not 1 <= int(g) <= lim[i]:
                raise LaunchError(f"{where}: grid {grid} (dimension {i} out of range)")
        if int(np.prod(block)) > 1024 or any(int(b) < 1 for b in block):
            raise LaunchError(f"{where}: block {block}")
        if len(args) != len(self.params):
            raise LaunchError(f"{where}: {len(args)} arguments for {len(self.params)} parameters "
                              f"({', '.join(n for _, n in self.params)})")
        for a, (kind, pname) in zip(args, self.params):
            if kind == "ptr":
                if isinstance(a, FakeArray):
                    continue
                if not isinstance(a, np.uint64):
                    raise LaunchError(f"{where}: pointer {pname} passed as {type(a).__name__}")
                p = int(a)
                if p and not _span_ok(p, 1):
                    raise LaunchError(f"{where}: pointer {pname} = {p:#x} is outside every device allocation")
            elif not isinstance(a, _KIND[kind]):
                raise LaunchError(f"{where}: {pname} ({kind}) passed as {type(a).__name__}")
        named = {n: a for a, (_, n) in zip(args, self.params)}
        named["__block__"], named["__smem__"] = block, int(shared_mem)
        if _recording is not None:        # stream capture: checked now, run when the graph is launched
            _recording.append((self, grid, named))
        else:
            self._run(grid, named)
        stats["launches"] += 1
        stats["kernels"].add(self.name.split("<")[0])

    def _run(self, grid, named) -> None:
        """What a launch does here: the extent checks (some read tables in device memory) and
        the emulated kernels (the device moe step's index kernels always; the expert tier's
        with ``emulate``)."""
        if self.name in _ALWAYS:          # the device moe step's index kernels: the tables moe_gemv's check reads
            _ALWAYS[self.name](self.name, grid, named)
        _extents(self.name, grid, named)
        if emulate and self.name.split("<")[0] in _EMULATED:
            _EMULATED[self.name.split("<")[0]](self.name, grid, named)


_recording: list | None = None    # the launches of the stream capture in progress


def _addr(a) -> int:
    return a.data.ptr if isinstance(a, FakeArray) else int(a)


def _need(where: str, a, nbytes: int, what: str) -> None:
    p = _addr(a)
    if p and nbytes > 0 and not _span_ok(p, int(nbytes)):
        raise LaunchError(f"{where}: {what} ({int(nbytes)} bytes from {p:#x}) runs outside its allocation")


def _extents(name: str, grid, a: dict) -> None:
    """Per-kernel extent checks for the kernels whose addressing is easy to get wrong."""
    base = name.split("<")[0]
    tpl = [int(t) for t in name[name.index("<") + 1:-1].split(",")] if "<" in name else []
    w = f"kernel {name}"
    i = lambda k: int(a[k])   # noqa: E731
    if base == "gemv":
        nb, mode = tpl[2], tpl[3]
        B, k, n_pairs = i("B"), i("k"), i("n_pairs")
        if mode in (3, 5):                               # QKV: rows [0, 2 n_pairs) of the matrix
            rows_a = rows_b = 2 * n_pairs
            ycols = 1
        else:
            max_ra = (n_pairs - 1) * i("a_stride")
            rows_a, rows_b = max_ra + 1, max_ra + i("b_off") + 1
            ycols = rows_b if mode in (0, 1) else n_pairs
            if mode in (0, 1) and ycols > i("ldy"):
                raise LaunchError(f"{w}: writes column {ycols - 1} of rows only {i('ldy')} wide")
        _need(w, a["Wa"], rows_a * i("rba"), "Wa")
        _need(w, a["Wb"], rows_b * i("rbb"), "Wb")
        q8 = len(tpl) > 6 and tpl[6] == 1
        if q8:                                           # int8 rows (ldx bytes) and their block scales
            _need(w, a["x"], (B - 1) * i("ldx") + k, "x (int8)")
            _need(w, a["xd"], 8 * ((B - 1) * i("ldd") + k // 32), "xd")
            if i("ldx") % 16 or i("ldd") * 32 != i("ldx"):
                raise LaunchError(f"{w}: int8 rows of {i('ldx')} bytes with {i('ldd')} block scales")
            if _addr(a["nw"]) and not _addr(a["xs"]):
                raise LaunchError(f"{w}: Q8 with a norm needs the precomputed scales xs")
        else:
            _need(w, a["x"], 4 * ((B - 1) * i("ldx") + k), "x")
        _need(w, a["y"], 4 * ((B - 1) * i("ldy") + ycols), "y")
        _need(w, a["nw"], 4 * k, "norm weight")
        _need(w, a["xs"], 4 * B, "norm scales")
        _need(w, a["bias_a"], 4 * (rows_a if mode in (0, 1, 3, 5) else n_pairs), "bias_a")
        _need(w, a["bias_b"], 4 * (rows_b if mode in (0, 1, 3, 5) else n_pairs), "bias_b")
        if grid[1] * nb < B:
            raise LaunchError(f"{w}: grid.y {grid[1]} x NB {nb} does not cover {B} rows")
        ppb = 4 // tpl[4] * (tpl[5] if len(tpl) > 5 else 1)          # GEMV_WARPS / WPP x PPW row pairs a block
        if grid[0] * ppb < n_pairs:
            raise LaunchError(f"{w}: grid.x {grid[0]} x {ppb} pairs a block does not cover {n_pairs} row pairs")
        if mode in (3, 5):
            for t in ("tab_slot", "tab_pos"):
                _need(w, a[t], 4 * B, t)
    elif base == "mmq":
        from tests.tools import gpu_fake_mmq

        gpu_fake_mmq.extents(w, tpl, grid, a)
    elif base == "moe_gemv":
        nb, mode = tpl[2], tpl[3]
        k, n_pairs = i("k"), i("n_pairs")
        if mode not in (0, 2):
            raise LaunchError(f"{w}: mode {mode} (moe_gemv has store and swiglu)")
        max_ra = (n_pairs - 1) * i("a_stride")
        rows_a, rows_b = max_ra + 1, max_ra + i("b_off") + 1
        ycols = rows_b if mode == 0 else n_pairs
        if ycols > i("ldy"):
            raise LaunchError(f"{w}: writes column {ycols - 1} of rows only {i('ldy')} wide")
        _need(w, a["tiles"], 12 * grid[1], "tiles")
        for e, b0, n in _i32(_addr(a["tiles"]), 3 * grid[1]).reshape(-1, 3).tolist():
            if n == 0 and e == 0 and b0 == 0:
                continue                 # a spare tile of moe_tiles' fixed grid (the kernel returns at once)
            if not 1 <= n <= nb or e < 0 or b0 < 0:
                raise LaunchError(f"{w}: tile (expert {e}, row {b0}, {n} rows) with NB {nb}")
            _need(w, _addr(a["Wa"]) + e * i("ea"), rows_a * i("rba"), f"Wa of expert slot {e}")
            _need(w, _addr(a["Wb"]) + e * i("eb"), rows_b * i("rbb"), f"Wb of expert slot {e}")
            _need(w, _addr(a["x"]) + 4 * b0 * i("ldx"), 4 * ((n - 1) * i("ldx") + k), f"x rows {b0}..{b0 + n - 1}")
            _need(w, _addr(a["y"]) + 4 * b0 * i("ldy"), 4 * ((n - 1) * i("ldy") + ycols), f"y rows {b0}..{b0 + n - 1}")
            for bn in ("bias_a", "bias_b"):
                if _addr(a[bn]):
                    _need(w, _addr(a[bn]) + 4 * e * i("ebias"), 4 * (rows_a if bn == "bias_a" else rows_b), bn)
    elif base == "moe_gather":
        n = grid[0]
        idx = _i32(_addr(a["idx"]), n) if _span_ok(_addr(a["idx"]), 4 * n) else None
        if idx is None:
            raise LaunchError(f"{w}: idx ({n} rows) runs outside its allocation")
        _need(w, a["x"], 4 * (int(idx.max()) * i("ldx") + i("k")), "x (the largest index)")
        _need(w, a["xo"], 4 * ((n - 1) * i("ldo") + i("k")), "xo")
    elif base in ("dequant", "dequant_h"):
        m, k = i("m"), i("k")
        _need(w, a["W"], m * i("rb"), "W")
        _need(w, a["out"], m * k * (4 if base == "dequant" else 2), "out")
    elif base == "rows_half":
        n = grid[0]
        _need(w, a["x"], 4 * ((n - 1) * i("ldx") + i("k")), "x")
        _need(w, a["out"], 2 * ((n - 1) * i("ldo") + i("k")), "out")
        _need(w, a["nw"], 4 * i("k"), "nw")
    elif base == "quant_rows":
        n, k = grid[0], i("k")
        if len(grid) < 2 or grid[1] * 128 < k:
            raise LaunchError(f"{w}: grid {grid} does not cover {k} inputs (128 per block)")
        _need(w, a["x"], 4 * ((n - 1) * i("ldx") + k), "x")
        _need(w, a["xq"], (n - 1) * i("ldq") + k, "xq")
        _need(w, a["xd"], 8 * ((n - 1) * i("ldd") + k // 32), "xd")
        if _addr(a["nw"]):
            _need(w, a["nw"], 4 * k, "nw")
            _need(w, a["xs"], 4 * n, "xs")
    elif base == "row_scale":
        n = grid[0]
        _need(w, a["x"], 4 * ((n - 1) * i("ldx") + i("k")), "x")
        _need(w, a["out"], 4 * n, "out")
    elif base == "attn_decode":
        hd = tpl[0]
        B, H = grid[2], i("H")
        _need(w, a["q"], 4 * ((B - 1) * i("ldq") + H * hd), "q")
        _need(w, a["out"], 4 * ((B - 1) * i("ldo") + H * hd), "out")
        _need(w, a["part"], 4 * B * H * i("nsmax") * (hd + 2), "part")
        _need(w, a["counters"], 4 * B * H, "counters")
        _need(w, a["sinks"], 4 * H, "sinks")
        _need(w, a["tab_slot"], 4 * B, "tab_slot")
        _need(w, a["tab_pos"], 4 * B, "tab_pos")
    elif base == "attn_prefill":
        hd, kvt = tpl
        n, H, n_kv, n_ctx = i("n"), i("H"), i("n_kv"), i("n_ctx")
        if grid[0] * 64 < n or grid[1] != H:
            raise LaunchError(f"{w}: grid {grid} does not cover {n} rows (64 per block) of {H} heads")
        if H % n_kv or not 0 <= i("pos0") <= i("pos0") + n <= n_ctx or i("slot") < 0:
            raise LaunchError(f"{w}: {H} heads, {n_kv} KV heads, rows at {i('pos0')}..{i('pos0') + n - 1}, "
                              f"n_ctx {n_ctx}, slot {i('slot')}")
        _need(w, a["q"], 4 * ((n - 1) * i("ldq") + H * hd), "q")
        _need(w, a["out"], 4 * ((n - 1) * i("ldo") + H * hd), "out")
        _need(w, a["sinks"], 4 * H, "sinks")
        row = _kv_row_bytes(kvt, hd)
        end = row * ((i("slot") + 1) * n_kv * n_ctx)   # the slot's last KV head, every position
        _need(w, a["kc"], end, "kc (the slot's keys)")
        _need(w, a["vc"], end, "vc (the slot's values)")
    elif base == "kvq_store":                       # a quantized cache's store: rows x (K heads, V heads)
        kvt, n_kv, hd, n_ctx = tpl[0], i("n_kv"), i("hd"), i("n_ctx")
        n = grid[1]
        if grid[0] != 2 * n_kv or hd % 32 or hd > 256:
            raise LaunchError(f"{w}: grid {grid} for {n_kv} KV heads of {hd}")
        for r in ("nk", "nv"):
            if i(r) and (hd % i(r) or i(r) & (i(r) - 1)):
                raise LaunchError(f"{w}: rotation block {r} = {i(r)} for heads of {hd}")
        _need(w, a["k"], 4 * ((n - 1) * i("ldk") + n_kv * hd), "k")
        _need(w, a["v"], 4 * ((n - 1) * i("ldv") + n_kv * hd), "v")
        _kv_rows_ok(w, a, n, n_kv, n_ctx, _kv_row_bytes(kvt, hd))
    elif base == "kvq_rotate":
        n_heads, n, hd, blk = grid[0], grid[1], i("hd"), i("n")
        if hd % blk or blk & (blk - 1) or hd > 256:
            raise LaunchError(f"{w}: rotation block {blk} for heads of {hd}")
        _need(w, a["x"], 4 * ((n - 1) * i("ld") + n_heads * hd), "x")
    elif base == "kvq_dequant":
        kvt, n, n_kv, hd, n_ctx, c0 = tpl[0], i("n"), i("n_kv"), i("hd"), i("n_ctx"), i("c0")
        if grid != (n, n_kv) or c0 < 0 or c0 + n > n_ctx:
            raise LaunchError(f"{w}: grid {grid} for positions {c0}..{c0 + n - 1} of {n_ctx}, {n_kv} KV heads")
        _need(w, a["c"], _kv_row_bytes(kvt, hd) * ((i("slot") + 1) * n_kv * n_ctx), "c (the slot)")
        _need(w, a["out"], 4 * n_kv * n * hd, "out")
    elif base == "head_rope_kv":
        kvt, n_kv, hd, n_ctx = tpl[0], i("n_kv"), i("hd"), i("n_ctx")
        _kv_rows_ok(w, a, grid[1], n_kv, n_ctx, _kv_row_bytes(kvt, hd))


def _kv_row_bytes(kvt: int, hd: int) -> int:
    """Bytes of one head's row in a cache of KVT ``kvt`` (f32, f16, q8_0, q4_0)."""
    return {0: 4 * hd, 1: 2 * hd, 2: hd // 32 * 34, 3: hd // 32 * 18}[kvt]


def _kv_rows_ok(w: str, a: dict, n: int, n_kv: int, n_ctx: int, row: int) -> None:
    """The rows a KV store writes (slot[r], pos[r], every KV head) lie inside kc and vc."""
    slots, pos = _i32(_addr(a["slot"]), n), _i32(_addr(a["pos"]), n)
    if n and (pos.min() < 0 or pos.max() >= n_ctx or slots.min() < 0):
        raise LaunchError(f"{w}: positions {pos.min()}..{pos.max()} of {n_ctx}, slots from {slots.min()}")
    end = row * ((int(slots.max()) + 1) * n_kv * n_ctx) if n else 0
    _need(w, a["kc"], end, "kc (the rows' slots)")
    _need(w, a["vc"], end, "vc (the rows' slots)")


# ---- numeric emulation of the GPU expert tier's kernels (``emulate = True``) -------------------

def _i32(p: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int32 * int(n)).from_address(int(p)))


def _f32(p: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * int(n)).from_address(int(p)))


def _i8(p: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int8 * int(n)).from_address(int(p)))


def _deq(p: int, rb: int, rows: int, qtype: int) -> np.ndarray:
    from gguf.quants import dequantize

    raw = np.frombuffer(ctypes.string_at(int(p), int(rows * rb)), np.uint8).reshape(rows, rb)
    return dequantize(raw, qtype).astype(np.float64)


def _silu(g):
    return g / (np.float32(1) + np.exp(-g))


def _gemv_rows(ta, tb, mode, Wa, Wb, rba, rbb, a_stride, b_off, n_pairs, k, x, ldx, B, bias_a, bias_b, y, ldy):
    ra = np.arange(n_pairs) * a_stride
    rb = ra + b_off
    A = _deq(Wa, rba, int(ra[-1]) + 1, ta)[ra]
    Bm = _deq(Wb, rbb, int(rb[-1]) + 1, tb)[rb]
    ba = _f32(bias_a, int(ra[-1]) + 1)[ra] if bias_a else np.zeros(n_pairs, np.float32)
    bb = _f32(bias_b, int(rb[-1]) + 1)[rb] if bias_b else np.zeros(n_pairs, np.float32)
    for b in range(B):
        xr = _f32(x + 4 * b * ldx, k).astype(np.float64)
        a = (A @ xr).astype(np.float32) + ba
        c = (Bm @ xr).astype(np.float32) + bb
        yr = _f32(y + 4 * b * ldy, int(rb.max()) + 1 if mode == 0 else n_pairs)
        if mode == 0:
            yr[ra], yr[rb] = a, c
        else:
            yr[:n_pairs] = _silu(a) * c


def _emu_gemv(name, grid, a) -> None:
    tpl = [int(t) for t in name[name.index("<") + 1:-1].split(",")]
    if len(tpl) == 7 and tpl[6] == 1:              # int8 activations: the canonical order, bit for bit
        from tests.tools import gpu_fake_mmq

        gpu_fake_mmq.emu_q8(tpl[0], tpl[1], tpl[3], a, mmq=False)
        return
    ta, tb, _, mode, _ = tpl[:5]
    if a["nw"] or mode not in (0, 2):
        return                       # not a GPU expert tier launch: left garbage, as every kernel
    _gemv_rows(ta, tb, mode, _addr(a["Wa"]), _addr(a["Wb"]), int(a["rba"]), int(a["rbb"]), int(a["a_stride"]),
               int(a["b_off"]), int(a["n_pairs"]), int(a["k"]), _addr(a["x"]), int(a["ldx"]), int(a["B"]),
               _addr(a["bias_a"]), _addr(a["bias_b"]), _addr(a["y"]), int(a["ldy"]))


def _emu_moe_gemv(name, grid, a) -> None:
    ta, tb, _, mode, _ = (int(t) for t in name[name.index("<") + 1:-1].split(","))
    ldx, ldy, eb_ = int(a["ldx"]), int(a["ldy"]), int(a["ebias"])
    for e, b0, n in _i32(_addr(a["tiles"]), 3 * grid[1]).reshape(-1, 3).tolist():
        bias = [_addr(a[t]) + 4 * e * eb_ if _addr(a[t]) else 0 for t in ("bias_a", "bias_b")]
        _gemv_rows(ta, tb, mode, _addr(a["Wa"]) + e * int(a["ea"]), _addr(a["Wb"]) + e * int(a["eb"]), int(a["rba"]),
                   int(a["rbb"]), int(a["a_stride"]), int(a["b_off"]), int(a["n_pairs"]), int(a["k"]),
                   _addr(a["x"]) + 4 * b0 * ldx, ldx, n, bias[0], bias[1], _addr(a["y"]) + 4 * b0 * ldy, ldy)


def _emu_moe_gather(name, grid, a) -> None:
    k, ldx, ldo = int(a["k"]), int(a["ldx"]), int(a["ldo"])
    for j, r in enumerate(_i32(_addr(a["idx"]), grid[0]).tolist()):
        _f32(_addr(a["xo"]) + 4 * j * ldo, k)[:] = _f32(_addr(a["x"]) + 4 * r * ldx, k)


def _emu_swiglu_oai(name, grid, a) -> None:
    n, f = int(a["n"]), int(a["f"])
    alpha, limit = np.float32(a["alpha"]), np.float32(a["limit"])
    for r in range(n):
        g = np.minimum(_f32(_addr(a["g"]) + 4 * r * int(a["ldg"]), f), limit)
        u = np.clip(_f32(_addr(a["u"]) + 4 * r * int(a["ldu"]), f), -limit, limit)
        _f32(_addr(a["out"]) + 4 * r * int(a["ldo"]), f)[:] = g / (np.float32(1) + np.exp(-alpha * g)) * (u + 1)


def _emu_moe_route(name, grid, a) -> None:
    """moe_route by cpu_moe.route itself (numba; the same rules), on the logits in memory."""
    route = _cpu_experts().route

    n, E, k, ldl = int(a["n"]), int(a["E"]), int(a["k"]), int(a["ldl"])
    lg = np.zeros((n, E), np.float32)
    for r in range(n):
        lg[r] = _f32(_addr(a["lg"]) + 4 * r * ldl, E)
    if np.isnan(lg).any() or np.isinf(lg).any():
        lg = np.nan_to_num(lg, nan=0.0, posinf=1.0, neginf=-1.0)   # garbage rows (not emulated): any valid ids
    if _addr(a["bias"]):
        lg = lg + _f32(_addr(a["bias"]), E)
    sel, w, _ = route(lg.astype(np.float32), k, "softmax_weight" if int(a["sw"]) else "softmax", bool(int(a["norm_w"])),
                      float(a["w_scale"]))
    _i32(_addr(a["sel"]), n * k)[:] = sel.reshape(-1)
    _f32(_addr(a["wts"]), n * k)[:] = w.reshape(-1)


def _emu_moe_tiles(name, grid, a) -> None:
    P, k, E, nb, tmax = (int(a[t]) for t in ("P", "k", "E", "nb", "tmax"))
    sel = _i32(_addr(a["sel"]), P).astype(np.int64)
    if P and (sel.min() < 0 or sel.max() >= E):
        raise LaunchError(f"kernel {name}: expert ids outside 0..{E - 1}")
    slot = _i32(_addr(a["slot"]), E)
    tab, pos = _i32(_addr(a["tab"]), P + 3 * tmax), _i32(_addr(a["pos"]), P)
    order = np.argsort(sel, kind="stable")
    tab[:P] = order // k
    pos[order] = np.arange(P)
    cnt = np.bincount(sel, minlength=E)
    tiles, off = [], 0
    for e in range(E):
        for b in range(0, int(cnt[e]), nb):
            tiles.append((int(slot[e]), off + b, min(nb, int(cnt[e]) - b)))
        off += int(cnt[e])
    if len(tiles) > tmax:
        raise LaunchError(f"kernel {name}: {len(tiles)} tiles for a grid of {tmax}")
    t = tab[P:].reshape(tmax, 3)
    t[:] = 0
    if tiles:
        t[:len(tiles)] = np.array(tiles, np.int32)
    if _addr(a["traffic"]):
        tr = np.ctypeslib.as_array((ctypes.c_uint64 * E).from_address(_addr(a["traffic"])))
        real = sel
        if _addr(a["row_slot"]):
            rs = _i32(_addr(a["row_slot"]), P // k if k else 0)
            real = sel[rs[np.arange(P) // k] != int(a["pad_slot"])]
        tr += np.bincount(real, minlength=E).astype(np.uint64)


def _emu_moe_join(name, grid, a) -> None:
    join = _cpu_experts().join

    n, k, d, ldy, ldo = grid[0], int(a["k"]), int(a["d"]), int(a["ldy"]), int(a["ldo"])
    pos = _i32(_addr(a["pos"]), n * k)
    Y = np.stack([_f32(_addr(a["y"]) + 4 * int(q) * ldy, d) for q in pos]).reshape(n, k, d)
    w = _f32(_addr(a["w"]), n * k).reshape(n, k)
    out = join(Y, w.copy(), np.empty((n, d), np.float32))
    for r in range(n):
        _f32(_addr(a["out"]) + 4 * r * ldo, d)[:] = out[r]


def _moe_join_or_zeros(name, grid, a) -> None:
    """moe_join emulated with ``emulate``; else its output rows zeroed: finite, so that later
    layers' routing (the host step's, on garbage NaN rows, picks the first experts) still
    follows the router biases a dry run sets."""
    if emulate:
        _emu_moe_join(name, grid, a)
        return
    d, ldo = int(a["d"]), int(a["ldo"])
    for r in range(grid[0]):
        _f32(_addr(a["out"]) + 4 * r * ldo, d)[:] = 0.0


_EMULATED = {"gemv": _emu_gemv, "moe_gemv": _emu_moe_gemv, "moe_gather": _emu_moe_gather,
             "swiglu_oai_rows": _emu_swiglu_oai, "quant_rows": lambda *a: _fake_mmq().emu_quant_rows(*a),
             "mmq": lambda *a: _fake_mmq().emu_mmq(*a)}


def _fake_mmq():
    """The int8 GEMV's, quant_rows' and the MMQ's checks and emulation (tests/tools/gpu_fake_mmq.py)."""
    from tests.tools import gpu_fake_mmq

    return gpu_fake_mmq
# the device moe step's kernels that run always: the index kernels (the tables moe_gemv's extent
# check reads; garbage logits give valid expert ids) and the join (zeros unless emulated)
_ALWAYS = {"moe_route": _emu_moe_route, "moe_tiles": _emu_moe_tiles, "moe_join": _moe_join_or_zeros}


class CompileException(Exception):
    """CuPy's ``cupy.cuda.compiler.CompileException``: NVRTC's log is its message."""

    def __init__(self, msg, source, name, options, backend="nvrtc"):
        super().__init__(msg)
        self._msg = msg

    def get_message(self) -> str:
        return self._msg


def _error_directive(code: str, name: str = "kern.cu") -> str | None:
    """NVRTC's log for the first ``#error`` directive of ``code`` (the preprocessor's part of
    a compile, done here as NVRTC does it: the location follows ``#line`` markers), else None."""
    f, n = name, 0
    for line in code.split("\n"):
        n += 1
        m = re.match(r'\s*#\s*line\s+(\d+)(?:\s+"([^"]*)")?', line)
        if m:
            f, n = m.group(2) or f, int(m.group(1)) - 1
            continue
        m = re.match(r"\s*#\s*error\b(.*)", line)
        if m:
            return f"{f}({n}): error: #error directive: {m.group(1).strip()}\n\n1 error detected in the compilation of \"{name}\".\n"
    return None


def _cpu_experts():
    """The CPU expert pool's module (``backend/cpu/experts.py``; ``backend/cpu_moe.py`` in trees
    before the backend's sub-packages, which tests/tools/gpu_bits.py also runs on this fake)."""
    try:
        from aotx.engine.backend.cpu import experts
    except ModuleNotFoundError:
        from aotx.engine.backend import cpu_moe as experts
    return experts


class RawModule:
    def __init__(self, code: str, options=(), name_expressions=None):
        self.log = _error_directive(code)
        self.sigs = signatures(code)
        self.names = set(name_expressions or ())
        for n in self.names:
            if n.split("<")[0] not in self.sigs:
                raise LaunchError(f"name expression {n!r}: no such kernel")

    def get_function(self, name: str) -> RawKernel:
        if self.log is not None:         # CuPy compiles the module when a function is first asked for
            raise CompileException(self.log, "", "kern.cu", ())
        base = name.split("<")[0]
        if "<" in name and name not in self.names:
            raise LaunchError(f"{name} was not among the module's name expressions")
        if base not in self.sigs:
            raise LaunchError(f"no kernel {base}")
        return RawKernel(name, self.sigs[base])


# ---- streams, events, graphs, runtime ----------------------------------------------------------

class _Graph:
    """A captured graph: its launches, run again (checks and emulated kernels) on each launch."""

    def __init__(self, calls=()):
        self.calls = list(calls)

    def upload(self, s=None):
        pass

    def launch(self, s=None):
        for k, grid, named in self.calls:
            k._run(grid, named)


class Stream:
    _current: list = []

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.ptr = 0 if null else id(self)
        self.capturing = False

    def __enter__(self):
        Stream._current.append(self)
        return self

    def __exit__(self, *a):
        Stream._current.pop()

    def synchronize(self):
        if self.capturing:
            raise LaunchError("synchronize during stream capture")

    def begin_capture(self):
        global _recording
        if self.ptr == 0:
            raise LaunchError("capture on the legacy default stream")
        self.capturing = True
        _recording = []

    def end_capture(self):
        global _recording
        self.capturing = False
        stats["captures"] += 1
        g, _recording = _Graph(_recording or ()), None
        return g


_null = Stream(null=True)


def get_current_stream():
    return Stream._current[-1] if Stream._current else _null


class Event:
    def record(self, s=None):
        pass

    def synchronize(self):
        pass


def get_elapsed_time(a, b) -> float:
    return 1.0


class Device:
    mem_info = (80 << 30, 141 << 30)      # (free, total) bytes, as CuPy reports them
    compute_capability = "90"             # as CuPy reports it (a string); sm_80+ kernels run

    def __init__(self, i: int = 0):
        self.id = i

    def use(self):
        pass

    def synchronize(self):
        pass


def _memcpy(dst, src, n, kind, stream=0):
    ctypes.memmove(int(dst), int(src), int(n))


def _memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream=0):
    """cudaMemcpy2DAsync: ``height`` rows of ``width`` bytes; the device side must lie
    inside one allocation (the host side is the caller's numpy memory)."""
    if width > dpitch or width > spitch:
        raise LaunchError(f"memcpy2DAsync: width {width} exceeds a pitch (dst {dpitch}, src {spitch})")
    dev, pitch = (src, spitch) if kind == 2 else (dst, dpitch)
    if height and not _span_ok(int(dev), int((height - 1) * pitch + width)):
        raise LaunchError(f"memcpy2DAsync: {height} rows of {width} bytes (pitch {pitch}) from {int(dev):#x} "
                          f"run outside the device allocation")
    for r in range(int(height)):
        ctypes.memmove(int(dst) + r * int(dpitch), int(src) + r * int(spitch), int(width))


def _pinned(n: int):
    return bytearray(int(n))


def _cublas_check(name, A, lda, Ak, Am, asize, B, ldb, Bk, Bn, bsize, C, ldc, m, n):
    """Column-major operands: op(A) is m x k read as a (k, m) block with ld lda (transposed),
    B a (k, n) block with ld ldb, C an (m, n) block with ld ldc (float32)."""
    if lda < Ak or ldb < Bk or ldc < m:
        raise LaunchError(f"{name}: leading dimensions lda {lda} (>= {Ak}), ldb {ldb} (>= {Bk}), ldc {ldc} (>= {m})")
    for what, p, ld, rows, cols, size in (("A", A, lda, Ak, Am, asize), ("B", B, ldb, Bk, Bn, bsize),
                                           ("C", C, ldc, m, n, 4)):
        span = ((cols - 1) * ld + rows) * size
        if not _span_ok(int(p), span):
            raise LaunchError(f"{name}: operand {what} at {int(p):#x} ({cols} columns of {rows}, ld {ld}) "
                              f"runs outside its allocation")
    stats["gemms"] += 1


def _sgemm(handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
    if (ta, tb) != (1, 0):
        raise LaunchError("sgemm: the backend only uses op(A) = T, op(B) = N")
    _cublas_check("sgemm", A, lda, k, m, 4, B, ldb, k, n, 4, C, ldc, m, n)


def _gemm_ex(handle, ta, tb, m, n, k, alpha, A, atype, lda, B, btype, ldb, beta, C, ctype, ldc, compute, algo):
    size = {0: 4, 2: 2, 14: 2}
    if atype not in size or btype != atype or ctype != 0:
        raise LaunchError(f"gemmEx: types A {atype}, B {btype}, C {ctype}")
    if compute not in (68, 77) or (compute == 77 and atype != 0) or (compute == 68 and atype != 2):
        raise LaunchError(f"gemmEx: compute type {compute} with inputs of type {atype}")
    if (ta, tb) != (1, 0):
        raise LaunchError("gemmEx: the backend only uses op(A) = T, op(B) = N")
    _cublas_check("gemmEx", A, lda, k, m, size[atype], B, ldb, k, n, size[btype], C, ldc, m, n)


def install() -> None:
    """Make ``import cupy`` and ``from cupy_backends.cuda.libs import cublas`` the fakes."""
    cp = types.ModuleType("cupy")
    cp.__version__ = "0.0-fake"
    cp.ndarray = FakeArray
    for n in ("float32", "float16", "float64", "int8", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        setattr(cp, n, getattr(np, n))
    for f in (zeros, ones, empty, empty_like, asarray, ascontiguousarray, concatenate, arange, matmul):
        setattr(cp, f.__name__, f)
    cp.RawModule, cp.RawKernel = RawModule, RawKernel
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.Device = Stream, Event, Device
    cuda.get_current_stream, cuda.get_elapsed_time, cuda.alloc_pinned_memory = get_current_stream, get_elapsed_time, \
        _pinned
    rt = types.SimpleNamespace(
        getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"Fake GPU", "multiProcessorCount": 132},
        driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13000, memcpyAsync=_memcpy, memcpy2DAsync=_memcpy2d,
        memcpyHostToDevice=1, memcpyDeviceToHost=2)
    cuda.runtime = rt
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 1)
    cuda.compiler = types.SimpleNamespace(CompileException=CompileException)
    cp.cuda = cuda
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T, cublas.CUBLAS_POINTER_MODE_HOST = 0, 1, 0
    cublas.sgemm, cublas.gemmEx = _sgemm, _gemm_ex
    cublas.setStream = lambda h, s: None
    cublas.setPointerMode = lambda h, m: None
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = cublas
    cb = types.ModuleType("cupy_backends")
    cbc = types.ModuleType("cupy_backends.cuda")
    cb.cuda, cbc.libs = cbc, libs
    sys.modules.update({"cupy": cp, "cupy.cuda": cuda, "cupy_backends": cb, "cupy_backends.cuda": cbc,
                        "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.cublas": cublas})
