"""Same PTX before and after a change of the CUDA kernels' source, without a GPU.

``python tests/tools/nvrtc_same_ptx.py OLD_SOURCE_PY [--types 2,12,14] [--match REGEX]``:
compiles this tree's kernels module (``source.KERNELS``) and the ``SRC`` string of an older
``cuda_src.py`` (e.g. ``git show fcf9a78:engine/backend/cuda_src.py > /tmp/old_src.py``) with
the same template instances (``nvrtc_check.instances``) for compute_90, and compares the PTX
function by function (basic-block labels, whose numbers follow the functions before them,
normalized). Prints the functions only one side has and those whose bodies differ; exit 1
when a function both sides have differs. Equal PTX means equal machine code (ptxas compiles
each function from its PTX alone).

NVRTC comes from CuPy's binding when CuPy is installed, else from ``libnvrtc.so`` by ctypes
(``NVRTC_LIB``: its path, e.g. the nvidia-cuda-nvrtc wheel's ``nvidia/cu13/lib/libnvrtc.so.13``;
its directory must also be on LD_LIBRARY_PATH for the builtins library).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import re
import sys


def _ptx_ctypes(text: str, names: list[str]) -> str:
    lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"aotx.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    for n in names:
        lib.nvrtcAddNameExpression(prog, n.encode())
    opts = [b"-std=c++17", b"--gpu-architecture=compute_90"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode()[-3000:])
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, buf)
    return buf.value.decode()


def ptx(text: str, names: list[str]) -> str:
    try:
        import cupy_backends.cuda.libs.nvrtc as nvrtc
    except ImportError:
        return _ptx_ctypes(text, names)
    prog = nvrtc.createProgram(text, "aotx.cu", [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    nvrtc.compileProgram(prog, ["-std=c++17", "-arch=compute_90"])
    p = nvrtc.getPTX(prog)
    return p.decode() if isinstance(p, bytes) else p


def functions(p: str) -> dict[str, str]:
    """Function name -> its PTX (labels normalized, up to the next function's directives)."""
    p = re.sub(r"\$L__BB\d+_", "$L__BB_", p)
    out = {}
    for part in re.split(r"\n(?=(?:\.visible |\.weak )?\.(?:entry|func) )", p)[1:]:
        m = re.match(r"(?:\.visible |\.weak )?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)\(", part)
        out[m.group(1)] = re.split(r"\n\t// \.(?:globl|weak)", part)[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="an older cuda_src.py (its SRC is compiled)")
    ap.add_argument("--types", default="", help="comma-separated GGML type codes to instantiate (default: all)")
    ap.add_argument("--match", default="", help="regex: only the instances whose name matches")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from aotx.engine.backend.cuda import source as S
    from tests.tools.nvrtc_check import instances

    spec = importlib.util.spec_from_file_location("old_cuda_src", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    names = [n for n in instances([int(t) for t in args.types.split(",")] if args.types else None)
             if not re.match(r"(gemv_h|quant_rows_h)\b", n)]            # the engine no longer compiles those
    if args.match:
        names = [n for n in names if re.search(args.match, n)]
    new_f, old_f = functions(ptx(S.KERNELS.text, names)), functions(ptx(old.SRC, names))
    diff = sorted(k for k in new_f if k in old_f and new_f[k] != old_f[k])
    print(f"{len(names)} instances; functions: {len(new_f)} new, {len(old_f)} old")
    print("only old:", sorted(set(old_f) - set(new_f)))
    print("only new:", sorted(set(new_f) - set(old_f)))
    print("different bodies:", diff)
    print("SAME PTX for every function both have" if not diff else "DIFFERENT")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
