"""Compile the CUDA backend's kernels with NVRTC for sm_90 on a machine without a GPU.

``python tests/tools/nvrtc_check.py [--ptxas]``: compiles the kernels module
(``engine/backend/cuda/kernels/``, followed by the measurement candidate ``tests/tools/gemv_h.cu``)
with every template instance a model of each supported architecture could ask for, and
the sampler's module, through NVRTC (``--match REGEX``: only the instances whose
name matches, e.g. ``--match 'gemv_h|quant_rows_h'``) (``pip install nvidia-cuda-nvrtc cupy-cuda13x``;
NVRTC needs no device). With ``--ptxas`` (``pip install nvidia-cuda-nvcc``) it also
assembles the PTX and prints each kernel's registers, spills and shared memory.
Exit code 1 on a compile error (the log is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def instances(types=None) -> list[str]:
    from aotx.engine.backend.cuda import choice as CC
    from aotx.engine.backend.cuda import source as S

    types = S.TYPES if types is None else types
    names = ["gather_rows", "rms_norm", "causal_softmax", "glu_rows", "ew_rows", "bias_rows", "head_ops",
             "row_scale", "rows_half", "moe_gather", "swiglu_oai_rows", "moe_route", "moe_tiles", "moe_join",
             "short_conv", "conv_state", "delta_rule<16>", "delta_rule<32>", "delta_rule<64>",
             "delta_rule<128>", "l2_norm_rows", "sigmoid_gate_rows", "deinterleave_rows"]
    for t in types:
        names += [f"embed<{t}>", f"dequant<{t}>", f"dequant_h<{t}>"]
    for nb, wpps in CC.GEMV_GRID.items():
        for wpp in wpps:
            for mode in (S.MODE_STORE, S.MODE_ADD, S.MODE_QKV, S.MODE_QKV16, S.MODE_SWIGLU, S.MODE_GEGLU):
                for t in types:
                    names.append(f"gemv<{t},{t},{nb},{mode},{wpp}>")
            for mode in (S.MODE_STORE, S.MODE_SWIGLU):      # the GPU expert tier's grouped GEMV
                for t in types:
                    names.append(f"moe_gemv<{t},{t},{nb},{mode},{wpp}>")
    for nb, ppws in CC.PPW_GRID.items():          # row pairs per warp (one mode each: the loads differ, not the epilogue)
        for ppw in ppws[1:]:
            for wpp in CC.GEMV_GRID[nb]:
                for t in types:
                    names.append(f"gemv<{t},{t},{nb},{S.MODE_QKV16},{wpp},{ppw}>")
    names.append(f"gemv<{S.Q4_K},{S.Q6_K},4,{S.MODE_SWIGLU},4>")
    names.append("quant_rows")                    # int8 activations (Q8 1): every mode at NB 1, every NB in one mode
    for t in (S.Q8_TYPES if types is S.TYPES else [t for t in types if t in S.Q8_TYPES]):
        for mode in (S.MODE_STORE, S.MODE_ADD, S.MODE_QKV, S.MODE_QKV16, S.MODE_SWIGLU, S.MODE_GEGLU):
            names.append(f"gemv<{t},{t},1,{mode},4,1,1>")
        for nb, wpps in CC.GEMV_GRID.items():
            for wpp in wpps:
                for ppw in CC.PPW_GRID[nb]:
                    names.append(f"gemv<{t},{t},{nb},{S.MODE_STORE},{wpp},{ppw},1>")
    for t in (S.Q8_TYPES if types is S.TYPES else [t for t in types if t in S.Q8_TYPES]):   # the MMQ
        for wn, wm, sp in ((1, 1, 1), (2, 1, 4), (1, 2, 2), (2, 2, 4), (1, 4, 2), (2, 4, 1)):
            names.append(f"mmq<{t},{t},{S.MODE_STORE},{wn},{wm},{sp}>")
        for mode in (S.MODE_ADD, S.MODE_QKV, S.MODE_QKV16, S.MODE_SWIGLU, S.MODE_GEGLU):
            names.append(f"mmq<{t},{t},{mode},2,4,2>")
    if types is S.TYPES:
        names += [f"mmq<{S.Q4_K},{S.Q6_K},{S.MODE_SWIGLU},2,4,1>", f"mmq<{S.Q6_K},{S.Q4_K},{S.MODE_STORE},1,2,4>"]
    names.append("quant_rows_h")                  # fp16 activations (gemv_h, a measurement candidate)
    from tests.tools.gemv_h import H_TYPES

    for t in (H_TYPES if types is S.TYPES else [t for t in types if t in H_TYPES]):
        for mode in (S.MODE_STORE, S.MODE_ADD, S.MODE_QKV16, S.MODE_SWIGLU):
            names.append(f"gemv_h<{t},{t},1,{mode},4,1>")
        for nb, wpps in CC.GEMV_GRID.items():
            for wpp in wpps:
                for ppw in (1, 2) if nb <= 4 else (1,):
                    names.append(f"gemv_h<{t},{t},{nb},{S.MODE_STORE},{wpp},{ppw}>")
    for hd in (64, 96, 128, 256):
        for kvt in (0, 1, 2, 3):                    # f32, f16, and the quantized q8_0, q4_0 (kv_quant.cu)
            names.append(f"attn_decode<{hd},{kvt}>")
    for kvt in (0, 1):
        names += [f"head_rope_kv<{kvt}>", f"kv_store<{kvt}>"]
    for kvt in (2, 3):
        names += [f"head_rope_kv<{kvt}>", f"kvq_store<{kvt}>", f"kvq_dequant<{kvt}>"]
    names.append("kvq_rotate")
    for hd in S.FLASH_HEAD_DIMS:                    # the flash-style prefill attention (sm_80+)
        for kvt in (0, 1, 2, 3):
            names.append(f"attn_prefill<{hd},{kvt}>")
    return names


def compile_src(module, names: list[str], arch: str) -> tuple[bytes, str]:
    """PTX of ``module`` (``source.Module``) with these instances, and NVRTC's log (its errors
    as file:line)."""
    import cupy_backends.cuda.libs.nvrtc as nvrtc

    prog = nvrtc.createProgram(module.text, "aotx.cu", [], [])
    for n in names:
        nvrtc.addNameExpression(prog, n)
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}"])
    except Exception:  # noqa: BLE001 - NVRTCError; the log says what
        print(module.explain(nvrtc.getProgramLog(prog)))
        raise SystemExit(1)
    log = nvrtc.getProgramLog(prog)
    ptx = nvrtc.getPTX(prog)
    return ptx, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptxas", action="store_true", help="assemble for sm_90 and print registers and spills")
    ap.add_argument("--filter", default="", help="regex: only report kernels whose mangled name matches")
    ap.add_argument("--types", default="", help="comma-separated GGML type codes to instantiate (default: all)")
    ap.add_argument("--match", default="", help="regex: only compile the instances whose name matches (e.g. gemv_h)")
    args = ap.parse_args()
    from aotx.engine.backend.cuda import source as S
    from tests.tools import gemv_h

    names = instances([int(t) for t in args.types.split(',')] if args.types else None)
    if args.match:
        names = [n for n in names if re.search(args.match, n)]
    module = gemv_h.module()
    ptx, log = compile_src(module, names, "compute_90")
    if log.strip():
        print(log)
    ptx2, log2 = compile_src(S.SAMPLING, [], "compute_90")
    if log2.strip():
        print(log2)
    print(f"NVRTC: the kernels ({len(names)} instances) and the sampler compile for compute_90")
    if args.ptxas:
        import nvidia  # the nvidia-cuda-nvcc wheel's ptxas

        ptxas = None
        for root in nvidia.__path__:
            for cand in ("cu13/bin/ptxas", "cuda_nvcc/bin/ptxas"):
                if os.path.exists(os.path.join(root, cand)):
                    ptxas = os.path.join(root, cand)
        if ptxas is None:
            print("ptxas not found (pip install nvidia-cuda-nvcc)")
            return 1
        for i, p in enumerate((ptx, ptx2)):
            with tempfile.NamedTemporaryFile("wb", suffix=".ptx", delete=False) as f:
                f.write(p if isinstance(p, bytes) else p.encode())
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
            os.unlink(f.name)
            if r.returncode:
                print(r.stderr)
                return 1
            fn = None
            for ln in r.stderr.splitlines():
                m = re.search(r"Compiling entry function '(\S+)'", ln)
                if m:
                    fn = m.group(1)
                    continue
                if fn and args.filter and not re.search(args.filter, fn):
                    continue
                if "registers" in ln or ("spill" in ln and not " 0 bytes spill stores, 0 bytes spill loads" in ln):
                    print(fn, ln.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
