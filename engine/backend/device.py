"""Which device a run can use: the CPU, or a CUDA GPU with CuPy and AOTX's CUDA backend.

Owns ``pick_device`` (``--device auto|cpu|cuda``), for the engine process and for the
client commands that refuse ``--device cuda`` before starting an engine. Imports no
backend module unless asked about CUDA.
"""

from __future__ import annotations

from aotx.engine.errors import UsageError


def pick_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device and AOTX's CUDA backend are present, else ``cpu``.

    Raises UsageError for an explicit ``cuda`` that cannot be honoured (no CuPy, no
    device, no CUDA backend): the user asked for the GPU and gets the reason, not a CPU
    engine with a log line (``auto`` is the flag that falls back)."""
    if requested == "cpu":
        return "cpu"
    try:
        from aotx.engine.backend.cuda import backend as _cuda  # type: ignore[attr-defined]  # noqa: F401

        have_backend = True
    except ImportError:
        have_backend = False
    why = ""
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed, or broken
        why = "CuPy is not installed (pip install cupy-cuda12x)"
    else:
        try:
            if cupy.cuda.runtime.getDeviceCount() <= 0:
                why = "no CUDA device found"
        except Exception as e:  # noqa: BLE001 - no driver, no device
            why = f"no CUDA device found ({str(e).strip() or type(e).__name__})"
    if not why and not have_backend:
        why = "this build has no CUDA backend"
    if not why:
        return "cuda"
    if requested == "cuda":
        raise UsageError(f"--device cuda: {why}; use --device cpu, or --device auto to fall back to the CPU")
    return "cpu"
