"""engine/backend/cpu/heap.py: malloc thresholds, so that attention's per-call scratch arrays
are reused instead of mapped and faulted in again at every call (float16 decode after 16k
tokens of history ran 3x slower as glibc comes; BENCHMARKS.md)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's thresholds are glibc's")
def test_a_cpu_backend_asks_glibc_for_keep_scratch():
    code = ("from aotx.engine.backend.cpu import heap; assert not heap._done; "
            "from aotx.engine.backend.cpu.backend import CpuBackend; CpuBackend(); "
            "assert heap._done and heap.keep_scratch(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
