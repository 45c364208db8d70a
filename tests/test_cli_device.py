"""``--device``: ``cuda`` on a machine without a GPU is one line and exit 2 (no CPU engine
started in its place, no gateway key written); ``auto`` falls back to the CPU."""

from __future__ import annotations

import pytest

from tests import cli_support

aotx, one_line = cli_support.aotx, cli_support.one_line


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [["serve", "--device", "cuda"], ["run", "--device", "cuda", "hi"]])
def test_device_cuda_without_a_gpu_is_an_error_not_a_cpu_engine(tmp_path, argv):
    """Regression: `aotx serve --device cuda` (or `aotx run --device cuda` starting an
    engine) on a machine without a GPU warned "the engine runs on the cpu" and went on.
    Now it is one line saying why, exit 2, and no engine is started."""
    r = aotx(tmp_path, *argv, "--socket", str(tmp_path / "e.sock"), timeout=60)
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("aotx: --device cuda: ") and ("CuPy" in line or "no CUDA device" in line), line
    assert "started an engine" not in r.stderr and not (tmp_path / "engine.log").exists()


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
def test_a_refused_gateway_start_writes_no_key_file(tmp_path):
    """Regression: `aotx gateway --device cuda` without a GPU (and no engine) wrote a new API
    key file before the engine's refusal stopped it. The key of a first start is now
    written once an engine answers."""
    r = aotx(tmp_path, "gateway", "--port", "0", "--device", "cuda", "--socket", str(tmp_path / "e.sock"),
             timeout=60)
    assert r.returncode == 2
    assert "--device cuda: " in one_line(r)
    assert not (tmp_path / "gateway" / "api_keys").exists()


def test_device_auto_still_falls_back_to_the_cpu():
    from aotx.engine.cli.serve import pick_device

    assert pick_device("auto") == ("cuda" if _has_cuda() else "cpu")
    assert pick_device("cpu") == "cpu"
