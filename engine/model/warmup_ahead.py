"""Compiling a model's CPU kernels ahead, in a child process, while the engine reads the weights.

Owns: ``ahead`` (the single-threaded kernels a model's first forward needs, compiled into
numba's cache from tiny arrays of the types the engine passes, read from the file's header
alone: attention and the K/V store for the KV type, the matmul and row lookup of every
weight type), ``start_ahead`` (the child, ``python -m aotx.engine.model.warmup_ahead
MODEL KV_TYPE [REPORT]``, which writes its count to REPORT as JSON) and ``cache_is_warm``.
On a cold start of a 2-core machine the child and the engine's own load run at once; the
engine waits for the child before its warm-up, which then finds the kernels in the cache.
Leaves the kernels to ``backend/cpu``, the threaded kernels to ``backend/cpu/warmup.py``,
when to start to ``aotx serve``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from aotx.engine.backend.cpu.parallel import PARALLEL


def ahead(path: str | os.PathLike[str], kv_type: str = "f16",
          report: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Compile, into numba's cache, the single-threaded kernels a model's first forward
    needs (attention and the K/V store for ``kv_type``, the matmul of every weight type
    in the file, its embedding rows), on tiny arrays of the types the engine passes, read
    from the file's header alone. Run in a child process while the engine reads the
    weights and compiles the rest (the two halves of a 2-core machine's cold start run
    at once); a kernel the engine reaches first it compiles itself (nothing is wrong,
    only nothing is saved). ``report(done, total, name)`` before each kernel. Returns what
    it compiled, in order."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from aotx.engine.backend.cpu import attention
    from aotx.engine.backend.cpu.matmul import QuantMatrix
    from aotx.engine.backend.quants import SUPPORTED_TYPES
    from aotx.engine.model.gguf_header import read_file_header

    PARALLEL.ready = False
    done: list[str] = []
    h = read_file_header(path)
    # the matrices' types, the most used first (the layers' type: the first forward needs it
    # right after the weights are read; the output head's comes last)
    count: dict[int, int] = {}
    for t in h.tensors:
        if len(t.shape) == 2 and T(t.type_id) in SUPPORTED_TYPES:
            count[t.type_id] = count.get(t.type_id, 0) + 1
    types = sorted(count, key=lambda k: -count[k])
    total = 1 + len(types)
    tell = report or (lambda done_, total_, name: None)
    tell(0, total, f"attention ({kv_type})")
    half = kv_type != "f32"
    dt = np.uint16 if half else np.float32
    kc = np.zeros((1, 1, 16, 64), dt)
    vc = np.zeros((1, 1, 16, 64), dt)
    one = np.zeros((1, 1, 64), np.float32)
    pos = np.zeros(1, np.int32)
    attention.store_rows(kc, vc, one, one, pos, pos)
    attention.attention_rows(np.zeros((1, 1, 64), np.float32), kc, vc, pos, np.ones(1, np.int32), 0.125, 0,
                             np.empty((1, 1, 64), np.float32))
    done.append(f"attention ({kv_type})")
    for type_id in types:
        qt = T(type_id)
        tell(len(done), total, f"matmul {qt.name}")
        block, size = GGML_QUANT_SIZES[qt]
        k = 256 if block <= 256 and 256 % block == 0 else block
        raw = np.frombuffer(bytes(32 * (k // block) * size), np.uint8).reshape(32, -1)  # read-only, as a mmap
        w = QuantMatrix(raw, qt, 32, k, name=f"warm-up {qt.name}")
        x = np.zeros((1, k), np.float32)
        w.bound_matmul()(x, np.empty((1, 32), np.float32))
        w.rows(np.zeros(1, np.int64))
        done.append(qt.name)
    tell(total, total, "")
    return done


def cache_is_warm() -> bool:
    """Whether numba's cache has this install's attention kernel (a previous start compiled
    the kernels: nothing is gained by compiling ahead)."""
    try:
        from aotx.engine.backend.cpu import attention

        return os.path.exists(attention._attention_serial._cache._cache_file._index_path)
    except Exception:  # noqa: BLE001 - numba's private layout moved: compile ahead, as on a cold start
        return False


def start_ahead(model_path: str | os.PathLike[str], kv_type: str = "f16",
                report: str | os.PathLike[str] | None = None, force: bool = False) -> subprocess.Popen | None:
    """``ahead`` in a child process (None when it cannot start, or when the cache is warm:
    the engine compiles alone)."""
    if cache_is_warm() and not force:  # (force: a model loaded beside may have weight types not yet compiled)
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "aotx.engine.model.warmup_ahead", str(model_path),
                                 kv_type, *([str(report)] if report else [])], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """``MODEL [KV_TYPE [REPORT]]``: ``ahead``, at a slightly lower priority than the engine,
    its count written to REPORT (JSON: stage, done, total, detail)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        os.nice(2)
    except OSError:
        pass
    out = Path(argv[2]) if len(argv) > 2 else None

    def report(done: int, total: int, name: str) -> None:
        if out is not None:
            _write(out, {"stage": "compiling kernels", "done": done, "total": total, "detail": name})

    ahead(argv[0], argv[1] if len(argv) > 1 else "f16", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
