"""The fp16 decode GEMV (``quant_rows_h`` then ``gemv_h``): a measurement candidate the engine
does not launch, kept beside its tests and benchmarks.

Owns: the kernel file ``tests/tools/gemv_h.cu`` (weights dequantized in registers to half2,
HFMA2; the same canonical reduction order as ``gemv``), the module that compiles it after the
engine's kernels (``module()``: the engine's kernels module, then this file, behind its own
``#line`` marker) and the weight types it has a half2 form for (``H_TYPES``). Leaves every
kernel it builds on (``deq8``, the GEMV's helpers) to ``engine/backend/cuda/kernels/``.

Why it is not in the engine: on the H100 and H200 the int8-activation GEMV (``gemv`` with
Q8 1, llama.cpp's MMVQ) was faster at every bucket (BENCHMARKS.md), so the kernel choice
never times this one. Used by tests/test_cuda_gemv_f16.py, tests/tools/cuda_gemv_bench.py
(``--fp16``) and tests/tools/nvrtc_check.py.
"""

from __future__ import annotations

from pathlib import Path

from aotx.engine.backend.cuda import source as S

#: the weight types with a half2 form (``hw<T>``): ``gemv_h`` instances exist for these
H_TYPES = (S.Q4_0, S.Q4_1, S.Q8_0, S.Q4_K, S.Q6_K)
FILE = Path(__file__).with_name("gemv_h.cu")


def module() -> S.Module:
    """The engine's kernels module followed by ``gemv_h.cu``."""
    return S.build(S.KERNEL_FILES, "kernels+gemv_h", extra=(("tests/tools/gemv_h.cu", FILE.read_text()),))
