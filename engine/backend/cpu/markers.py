"""Numba type markers that pick what the integer kernels compile: instruction set and weight kind.

Owns: the tile geometry (``QB`` inputs per quantization block, ``LANES`` weight rows per
integer step, ``R`` rows per tile), the instruction-set markers (``PORTABLE``, ``AVX2``, ``VNNI``) and which one this
CPU runs (``HOST_ISA``, ``host_has_avx2``, ``host_has_vnni``); the weight-kind markers
(``Q4``, ``Q8``, ``Q8X2``, ``Q5`` and the compact ``Q4K``, ``Q6K``, ``Q6P``) with their
tile facts (``GROUPS``, ``SCALES``, ``OFFSET``, ``COMPACT``); ``corrections``, the integer
terms activation quantization stores for a kind and instruction set. The kernels take a
marker argument whose *numba type* selects the specialization, so the VNNI code is never
compiled on a CPU without VNNI, and tests can run every path on one that has them all.
Leaves to others: the integer step itself (``lanes.py``), activation quantization and
the matmul (``qdot.py``), the tile layouts (``repack.py``).
"""

from __future__ import annotations

import numpy as np
from numba import types

from aotx.engine.backend.cpu.llvm_ir import _features

QB = 32      # inputs per quantization block
LANES = 8    # weight rows per integer step (one 256-bit register of int32)
R = 8        # rows per tile of the repacked layouts (repack.py): one LANES group, so a tile's
             # blocks lie in memory in the order the kernel reads them. With 32-row tiles
             # each lane group read 32 of every 128 bytes per pass: a batch-1 GEMV from
             # memory ran at 12.5 GB/s on one core, 22 with 8-row tiles (2026-12-07)

PORTABLE = np.int8(0)    # generic LLVM vector IR (any target)
AVX2 = np.uint8(1)       # vpmaddubsw / vpmaddwd (llvm.x86.avx2.pmadd.ub.sw / pmadd.wd)
VNNI = np.uint16(2)      # vpdpbusd (llvm.x86.avx512.vpdpbusd.256: AVX-VNNI or AVX512-VNNI+VL)
# weight kinds (repack.py builds their tiles)
Q4 = np.int16(0)
Q8 = np.int32(0)
Q8X2 = np.uint32(0)
Q5 = np.uint64(0)
# compact K-quant kinds (repack.repack_compact): Q4_K's and Q6_K's quants as Q4 / Q8X2,
# their scales as the file has them - a small integer per 32 (Q4_K: sc and mn, 6 bits) or
# per 16 inputs (Q6_K: sc, int8) and float32 d (and dmin) per 256-input super-block -
# multiplied out in the kernel (D = d sc, M = -(dmin mn), c = M + 8 D: exact float32
# products and the one rounding of the stored layout's repack, so the same bits as Q4 /
# Q8X2 tiles of the same matrix) at 0.59 / 1.08 bytes per weight instead of 0.75 / 1.25:
# less memory traffic where a matmul is bound by it (decode).
Q4K = np.float32(0)
Q6K = np.float64(0)
# packed Q6_K ("q6p"): u = q + 32 in 0..63 as Q4's nibble tiles plus its 2 high bits, 4
# groups' worth per byte (mn: (T, nb, 2, R, 4) uint8, half h = the nibble half, bits 2g..2g+1
# for group g), the scales as q6k's: 0.83 bytes per weight (the file's 0.82). S_h =
# sum (u - 32) qx over each 16-input half (the nibble halves), init -32 * the half's qx sum.
Q6P = np.complex64(0)

_ISA_NAMES = {types.int8: "portable", types.uint8: "avx2", types.uint16: "vnni"}
_KIND_NAMES = {types.int16: "q4", types.int32: "q8", types.uint32: "q8x2", types.uint64: "q5",
               types.float32: "q4k", types.float64: "q6k", types.complex64: "q6p"}
COMPACT = {"q4k": "q4", "q6k": "q8x2", "q6p": "q6p"}   # compact kind -> the kind whose integer step it takes
# per kind: bytes of one tile block (groups x R rows x 4), scale floats per block and row
# (compact kinds: scale bytes per block and row)
GROUPS = {"q4": 4, "q8": 8, "q8x2": 8, "q5": 4, "q4k": 4, "q6k": 8, "q6p": 4}
SCALES = {"q4": 1, "q8": 1, "q8x2": 2, "q5": 1, "q4k": 2, "q6k": 2, "q6p": 2}
OFFSET = {"q4": 8, "q5": 16}     # the kinds with a minimum: S = sum (q - OFFSET) qx


def host_has_avx2() -> bool:
    """True when numba compiles for a CPU with AVX2."""
    return "avx2" in _features()


def host_has_vnni() -> bool:
    """True when numba compiles for a CPU with 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI
    with AVX512VL)."""
    f = _features()
    return "avx2" in f and ("avxvnni" in f or {"avx512vnni", "avx512vl"} <= f)


def host_isa():
    """The fastest integer path this CPU runs: VNNI, AVX2 or PORTABLE."""
    return VNNI if host_has_vnni() else AVX2 if host_has_avx2() else PORTABLE


def isa_name(isa) -> str:
    """'vnni', 'avx2' or 'portable' for an isa marker."""
    return {int(VNNI): "vnni", int(AVX2): "avx2", int(PORTABLE): "portable"}[int(isa)]


HOST_ISA = host_isa()


def corrections(kind: str, isa: str) -> tuple[int, int]:
    """(cs, ch): quantize_x stores xs = -cs * (sum of a block's qx) and xh = -ch * (sum of
    a half's qx), the integer terms the kernel of this kind and isa adds to its block
    sums (lanes.py's docstring): Q4 subtracts 8 * sum qx, Q5 16 * sum qx, and the VNNI path
    128 * sum qx for the bias of int8 weights."""
    vnni = 128 if isa == "vnni" else 0
    kind = COMPACT.get(kind, kind)
    return {"q4": (8, 0), "q8": (vnni, 0), "q8x2": (0, vnni), "q5": (16, 0), "q6p": (0, 32)}[kind]

