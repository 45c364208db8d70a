"""The CUDA backend's host code, run on the CPU against a fake CuPy that checks every launch.

Nothing of the CUDA backend can run on CI, and GPU time is scarce; what CAN go wrong on
the host (a kernel argument list that no longer matches the kernel after an edit, a
template instance that was never compiled, a pointer or a GEMM operand off its buffer, a
Python error on a path the GPU tests reach late) is found here:
``tests/tools/gpu_dryrun.py`` builds random-weight llama models on the fake
(``tests/tools/gpu_fake_cupy.py``) and drives the graph path at every bucket, the eager
path in every prefill mode, every GEMV variant and the kernel-choice tuner;
``tests/tools/gpu_dryrun_hybrid.py`` does the same for a hybrid model (qwen35's recurrent
layers and their state). Each runs in a subprocess so the fake never replaces a real CuPy
in this process.

The fake itself is tested too: each kind of violation it must catch, it catches.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_of_every_cuda_path_passes_the_launch_checks():
    p = subprocess.run([sys.executable, "-m", "tests.tools.gpu_dryrun"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = p.stdout
    assert "dry run OK" in out
    # every kernel family the backend has was launched at least once
    for k in ("gemv", "row_scale", "rows_half", "dequant_h", "dequant", "attn_decode", "head_rope_kv", "embed",
              "sample_rows", "causal_softmax", "kv_store", "head_ops", "persistent_step", "attn_prefill", "mmq"):
        assert k in out.split("kernels:")[-1], k
    reused = re.search(r"artifact reused: \d+ launches; kernel choice: (\d+) of (\d+) sites from the artifact", out)
    assert reused and reused.group(1) == reused.group(2), out   # the tuner's artifact is reused without timing


def test_dry_run_of_a_hybrid_model_checks_its_launches_and_state_against_the_cpu():
    """tests/tools/gpu_dryrun_hybrid.py: qwen35's host code (prefill eager and through the graph,
    3-slot decode, a verify window's rollback, snapshot / restore, the refusals) with every
    launch checked, and the recurrent steps' launches emulated against the CPU's kernels."""
    p = subprocess.run([sys.executable, "-m", "tests.tools.gpu_dryrun_hybrid"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "hybrid dry run OK" in p.stdout
    for k in ("short_conv", "conv_state", "delta_rule", "l2_norm_rows", "sigmoid_gate_rows", "deinterleave_rows"):
        assert k in p.stdout.split("kernels:")[-1], k


def test_the_kernels_module_compiles_with_nvcc_where_a_toolkit_is_installed(tmp_path):
    """NVRTC needs CuPy; where a CUDA toolkit is installed without it, nvcc compiles the kernels
    module's non-template kernels and the recurrent ones (delta_rule at every head size) to PTX
    for sm_90."""
    import os
    import shutil

    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    from aotx.engine.backend.cuda import source as S

    src, ptx = tmp_path / "kernels.cu", tmp_path / "kernels.ptx"
    text = S.KERNELS.text
    m = re.search(r"template <int S>\s*__global__\s+void\s+__launch_bounds__\([^)]*\)\s+delta_rule\s*\(([^)]*)\)", text)
    assert m, "delta_rule<S> not found"
    text += "".join(f"template __global__ void delta_rule<{s}>({m.group(1)});\n" for s in (16, 32, 64, 128))
    src.write_text(text)
    p = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o", str(ptx)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, S.KERNELS.explain(p.stderr)[-4000:]
    text = ptx.read_text()
    for k in ("short_conv", "conv_state", "delta_rule", "l2_norm_rows", "sigmoid_gate_rows", "deinterleave_rows"):
        assert re.search(rf"\.entry _Z\d+{k}[PI]", text), k
    for s in (16, 32, 64, 128):
        assert f"_Z10delta_ruleILi{s}E" in text, s


@pytest.fixture()
def fake(monkeypatch):
    """The fake module's functions, without installing it into sys.modules."""
    sys.path.insert(0, str(ROOT))
    from tests.tools import gpu_fake_cupy as F

    return F


SRC = r"""
__global__ void __launch_bounds__(128) k1(const float* __restrict__ x, int n, long long rb, float s, void* out) {}
template <int T>
__global__ void dequant(const unsigned char* __restrict__ W, long long rb, int m, int k, float* __restrict__ out) {}
"""


def test_the_fake_catches_wrong_argument_lists(fake):
    mod = fake.RawModule(SRC, name_expressions=["dequant<12>"])
    k1 = mod.get_function("k1")
    x = fake.zeros(16, np.float32)
    k1((1,), (128,), (x, np.int32(16), np.int64(4), np.float32(1.0), np.uint64(x.data.ptr)))
    with pytest.raises(fake.LaunchError, match="4 arguments for 5"):
        k1((1,), (128,), (x, np.int32(16), np.int64(4), np.float32(1.0)))
    with pytest.raises(fake.LaunchError, match="n \\(int\\) passed as int64"):
        k1((1,), (128,), (x, np.int64(16), np.int64(4), np.float32(1.0), x))
    with pytest.raises(fake.LaunchError, match="pointer out passed as int"):
        k1((1,), (128,), (x, np.int32(16), np.int64(4), np.float32(1.0), 5))
    with pytest.raises(fake.LaunchError, match="outside every device allocation"):
        k1((1,), (128,), (x, np.int32(16), np.int64(4), np.float32(1.0), np.uint64(np.zeros(4).ctypes.data)))
    with pytest.raises(fake.LaunchError, match="grid"):
        k1((1, 70000), (128,), (x, np.int32(16), np.int64(4), np.float32(1.0), x))
    with pytest.raises(fake.LaunchError, match="not among the module's name expressions"):
        mod.get_function("dequant<13>")


def test_the_fake_checks_extents(fake):
    mod = fake.RawModule(SRC, name_expressions=["dequant<12>"])
    dq = mod.get_function("dequant<12>")
    W = fake.zeros((4, 144), np.uint8)
    out = fake.zeros((4, 256), np.float32)
    dq((1,), (256,), (W, np.int64(144), np.int32(4), np.int32(256), out))
    with pytest.raises(fake.LaunchError, match="W .* runs outside"):
        dq((1,), (256,), (np.uint64(W.data.ptr + 144), np.int64(144), np.int32(4), np.int32(256), out))
    with pytest.raises(fake.LaunchError, match="out .* runs outside"):
        dq((1,), (256,), (W, np.int64(144), np.int32(4), np.int32(256), fake.zeros((3, 256), np.float32)))


def test_the_fake_checks_gemm_operands(fake):
    A = fake.zeros((8, 32), np.float32)       # 8 rows of k = 32 (column-major: 32 x 8, ld 32)
    B = fake.zeros((4, 32), np.float32)       # 4 batch rows
    C = fake.zeros((4, 8), np.float32)
    fake._sgemm(1, 1, 0, 8, 4, 32, 0, A.data.ptr, 32, B.data.ptr, 32, 0, C.data.ptr, 8)
    with pytest.raises(fake.LaunchError, match="operand C"):       # ldc 9: the last column runs past C
        fake._sgemm(1, 1, 0, 8, 4, 32, 0, A.data.ptr, 32, B.data.ptr, 32, 0, C.data.ptr, 9)
    with pytest.raises(fake.LaunchError, match="leading dimensions"):
        fake._sgemm(1, 1, 0, 8, 4, 32, 0, A.data.ptr, 16, B.data.ptr, 32, 0, C.data.ptr, 8)
    H = fake.zeros((8, 32), np.float16)
    X = fake.zeros((4, 32), np.float16)
    fake._gemm_ex(1, 1, 0, 8, 4, 32, 0, H.data.ptr, 2, 32, X.data.ptr, 2, 32, 0, C.data.ptr, 0, 8, 68, -1)
    with pytest.raises(fake.LaunchError, match="compute type"):
        fake._gemm_ex(1, 1, 0, 8, 4, 32, 0, H.data.ptr, 2, 32, X.data.ptr, 2, 32, 0, C.data.ptr, 0, 8, 77, -1)
    with pytest.raises(fake.LaunchError, match="operand A"):   # float32 A read where only float16 was allocated
        fake._gemm_ex(1, 1, 0, 8, 4, 32, 0, H.data.ptr, 0, 32, B.data.ptr, 0, 32, 0, C.data.ptr, 0, 8, 77, -1)


def test_kernel_signatures_parse_every_kernel_of_the_backend(fake):
    from aotx.engine.backend.cuda import sampling as cuda_sampling
    from aotx.engine.backend.cuda import source as cuda_src

    sigs = fake.signatures(cuda_src.SRC)
    assert {"gemv", "row_scale", "rows_half", "dequant_h", "attn_decode", "head_rope_kv"} <= set(sigs)
    assert [k for k, _ in sigs["row_scale"]] == ["ptr", "int", "int", "float", "ptr"]
    assert len(sigs["gemv"]) == 34               # ... the int8 form's block scales xd and their stride ldd
    assert [k for k, _ in sigs["gemv"][-2:]] == ["ptr", "int"]
    assert [k for k, _ in sigs["quant_rows"]] == ["ptr", "int", "int", "ptr", "float", "ptr", "ptr", "int", "ptr",
                                                  "int"]
    assert "sample_rows" in fake.signatures(cuda_sampling.SRC)


def test_gpu_bits_runs_every_configuration_on_the_fake(tmp_path):
    """tests/tools/gpu_bits.py (the before/after bits of tests/tools/gpu_reshape_check.sh) on the
    fake CuPy: every configuration builds, prefills, decodes through the graphs and prints
    its line (the numbers are the fake's, so only the paths are checked here)."""
    tool = ROOT / "tests" / "tools" / "gpu_bits.py"
    w = subprocess.run([sys.executable, str(tool), "write", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert w.returncode == 0, w.stderr[-3000:]
    p = subprocess.run([sys.executable, str(tool), "run", str(tmp_path), "--fake"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert p.stdout.rstrip().endswith("bits done"), p.stdout
    assert set(lines) >= {"llama-q4_1-f32", "llama-q4_k_m-int8", "qwen3moe-host-step", "qwen3moe-device-step",
                          "gemma3-int8"}, p.stdout
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for k, v in lines.items() if k != "bits"), p.stdout
