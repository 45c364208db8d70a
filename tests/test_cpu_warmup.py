"""An engine's first replies run on the kernels' single-threaded twins while the threaded
kernels compile in the background (``engine/backend/cpu/warmup.py``).

The first start of a fresh install spent 39 of its 90 s of compilation on threaded kernels
(numba's parfor passes) before the first token. The twins must give the same numbers bit
for bit (a reply may switch kernels midway), and the background compile must bring the
threaded kernels in: from the cache when there, else from a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cpu import attention
from aotx.engine.backend.cpu.parallel import PARALLEL
from aotx.engine.backend.cpu.matmul import QuantMatrix
from aotx.engine.backend.cpu.fdot import HOST_F16

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def serial_first():
    PARALLEL.ready = False
    yield
    PARALLEL.ready = True


def _q8_0(m: int, k: int, rng) -> np.ndarray:
    """Random Q8_0 rows: per 32 values an f16 scale and 32 int8."""
    blocks = rng.integers(-127, 128, size=(m, k // 32, 32), dtype=np.int8)
    scales = (rng.random((m, k // 32)) * 0.02 + 0.001).astype(np.float16)
    raw = np.concatenate([scales.view(np.uint8).reshape(m, k // 32, 2), blocks.view(np.uint8)], axis=2)
    return raw.reshape(m, -1)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_the_serial_matmul_twin_gives_the_threaded_kernels_bits(n):
    rng = np.random.default_rng(n)
    w = QuantMatrix(_q8_0(256, 512, rng), T.Q8_0, 256, 512, name="w")
    x = rng.standard_normal((n, 512)).astype(np.float32)
    threaded = w.matmul(x)
    bound = w.bound_matmul()
    PARALLEL.ready = False
    try:
        serial = w.matmul(x)
        out = np.empty_like(serial)
        bound(x, out)
    finally:
        PARALLEL.ready = True
    assert np.array_equal(threaded, serial) and np.array_equal(threaded, out)


@pytest.mark.parametrize("half", [True, False])
def test_the_serial_attention_twin_gives_the_threaded_kernels_bits(half):
    rng = np.random.default_rng(3)
    n_slots, KV, n_ctx, hd, H, N = 2, 2, 128, 64, 4, 40
    dt = np.uint16 if half else np.float32
    vals = rng.standard_normal((2, n_slots, KV, n_ctx, hd)).astype(np.float32)
    kc, vc = (vals.astype(np.float16).view(np.uint16) if half else vals)[0].copy(), \
        (vals.astype(np.float16).view(np.uint16) if half else vals)[1].copy()
    assert kc.dtype == dt
    q = rng.standard_normal((N, H, hd)).astype(np.float32)
    slots = np.array([0] * 20 + [1] * 20, np.int32)
    lengths = np.array(list(range(90, 110)) + list(range(1, 21)), np.int32)
    args = lambda out: (HOST_F16, q, kc, vc, slots, lengths, np.float32(0.125), 0, out, half,  # noqa: E731
                        attention.NO_SINKS, False)
    keys = attention.attended_keys(lengths, 0)
    par = attention.kernel_for(keys, H, hd, half)
    ser = attention._attention_serial if half else attention._attention_serial_f32
    assert par is not ser
    a, b = np.empty((N, H, hd), np.float32), np.empty((N, H, hd), np.float32)
    par(*args(a))
    ser(*args(b))
    assert np.array_equal(a, b)
    PARALLEL.ready = False
    try:
        assert attention.kernel_for(keys, H, hd, half) is ser
    finally:
        PARALLEL.ready = True


def test_bring_in_compiles_the_threaded_kernels_in_a_child_then_loads_them_from_the_cache(tmp_path):
    """In a process of its own (numba reads its cache directory at import): the serial twin
    runs, the threaded kernel compiles in the background child into the cache, the
    process loads it from there (it never compiles it itself), and ``ready`` turns true."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from numba.core import event
        from aotx.engine.backend.cpu import warmup
        from tests.fakes import twin_kernels as k

        warmup.TWINS = (("tests.fakes.twin_kernels", "serial", "threaded"),)
        warmup.PARALLEL.ready = False
        x = np.arange(8, dtype=np.float32); out = np.empty_like(x)
        k.serial(x, out)
        compiled_here = []
        class L(event.Listener):
            def on_start(self, e): compiled_here.append(getattr(e.data.get("dispatcher"), "__name__", ""))
            def on_end(self, e): pass
        lines = []
        with event.install_listener("numba:compile", L()):
            warmup.bring_in(lines.append)
        assert warmup.PARALLEL.ready
        assert k.threaded.signatures == k.serial.signatures, k.threaded.signatures
        assert "threaded" not in compiled_here, compiled_here   # loaded, not compiled, here
        k.threaded(x, out)
        assert out[3] == 7.0
        print(lines[0])
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "nb"), PYTHONPATH=os.pathsep.join(
        [str(ROOT), *(p for p in [os.environ.get("PYTHONPATH")] if p)]))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compiling 1 multi-threaded kernel(s) in the background" in r.stdout


def test_kernels_compiled_ahead_are_the_ones_the_model_loads(tmp_path, tiny_gguf):
    """``warmup_ahead.ahead`` compiles from the file's header alone, on tiny arrays: only
    worth it if those are the very signatures the engine's warm-up needs. After it, a load
    of the model (single-threaded, as an engine warms up) compiles no attention or matmul
    kernel: it finds them in the cache. (Compiles the kernels once: ~20 s of CPU.)"""
    model = tiny_gguf.write_tiny_llama(tmp_path / "tiny.gguf", seed=1)
    script = textwrap.dedent(f"""
        import subprocess, sys
        from numba.core import event
        from aotx.engine.model.warmup_ahead import cache_is_warm
        assert not cache_is_warm()
        r = subprocess.run([sys.executable, "-m", "aotx.engine.model.warmup_ahead", {str(model)!r}, "f16",
                            {str(tmp_path / "report.json")!r}], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert cache_is_warm()   # a second start compiles nothing ahead
        from aotx.engine.backend.cpu.parallel import PARALLEL
        from aotx.engine.model.loader import load_model
        PARALLEL.ready = False
        compiled = []
        class L(event.Listener):
            def on_start(self, e): compiled.append(getattr(e.data.get("dispatcher"), "__name__", ""))
            def on_end(self, e): pass
        with event.install_listener("numba:compile", L()):
            load_model({str(model)!r}, device="cpu")
        heavy = [n for n in compiled if n in ("matmul_serial", "_attention_serial", "_rows", "_gemm_serial",
                                              "store_f16")]
        print(sorted(set(compiled)))
        assert not heavy, heavy
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "nb"), AOTX_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import json

    assert json.loads((tmp_path / "report.json").read_text()) == {"stage": "compiling kernels", "done": 2,
                                                                   "total": 2, "detail": ""}
