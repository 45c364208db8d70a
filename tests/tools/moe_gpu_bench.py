"""A Qwen3-30B-A3B-shaped random-weight mixture of experts on one GPU: AOTX next to llama.cpp
with ``--n-cpu-moe`` (issue 22). Driven by tests/tools/moe_gpu_bench.sh; subcommands:

* ``write OUT.gguf --tokenizer .gpubench/tokenizer.json [--layers N]``: the file, streamed
  tensor by tensor (qwen3moe: 48 layers, d_model 2048, 32 query heads and 4 KV heads of
  128, 128 experts of width 768, 8 per token; Q4_K with Q6_K ``attn_v`` and
  ``ffn_down_exps`` on llama-quantize's use_more_bits layers, as Q4_K_M; router F32;
  SmolLM2's vocabulary of 49,152 tokens, so the output head is smaller than the real
  model's), about 17 GB. Every
  matrix row is drawn from a small pool of valid random rows of its type (seconds per GB).
* ``aotx FILE --json OUT.json [--budget 8G] [--gpu-share 0.4]``: AOTX on the CUDA backend:
  dense layers on the GPU, every routed expert on the CPU tier first (a GPU expert budget of
  0). The expert-tier setup (calibration with CPU, GPU and copy timings, plan, placement:
  its stages and plan), admission's lines for the budget, prefill tokens/s at 512 (one
  chunk, after a warm-up), batch-1 greedy decode tokens/s over 16 steps. Then, with
  ``--gpu-share`` > 0, the setup again (the stored calibration reused) with a GPU expert
  budget of that share of the routed experts' bytes (about that share of the experts on the
  GPU tier, the rest on the CPU pool) and the same measurements (``gpu_tier``); with
  ``--all-gpu``, again with every expert on the GPU (``all_gpu``). Each configuration also
  times aggregate decode at 16 slots.

Throughput does not depend on the weights' values; these numbers are for the ratio to
llama.cpp on the same file in the same call, not for absolute claims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_expert=128, n_used=8,
             expert_ffn=768, ffn=6144, rope_base=1e6, norm_eps=1e-6, context_length=40960)
POOL_ROWS = 256
DECODE_STEPS = 16


def write(out: Path, tokenizer_json: Path, n_layers: int) -> Path:
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.models import shapes
    from tests.models.cuda_testmodel import random_matrix

    s = dict(SHAPE, n_layers=n_layers)
    d, hd, H, KV, E, F = s["d_model"], s["head_dim"], s["n_heads"], s["n_kv_heads"], s["n_expert"], s["expert_ffn"]
    V = shapes.VOCAB
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_name("aotx-random-qwen3-30b-a3b-shape")
    w.add_block_count(n_layers)
    w.add_context_length(s["context_length"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(s["n_used"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_expert_feed_forward_length(F)
    w.add_vocab_size(V)
    w.add_file_type(15)                       # LLAMA_FTYPE_MOSTLY_Q4_K_M
    shapes._add_kv(w, shapes.load_tokenizer(tokenizer_json))

    more = shapes.use_more_bits
    tensors: list[tuple[str, tuple, object]] = [("token_embd.weight", (V, d), T.Q4_K)]
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (d,), T.F32), (p + "attn_q.weight", (H * hd, d), T.Q4_K),
                    (p + "attn_k.weight", (KV * hd, d), T.Q4_K),
                    (p + "attn_v.weight", (KV * hd, d), T.Q6_K if more(i, n_layers) else T.Q4_K),
                    (p + "attn_q_norm.weight", (hd,), T.F32), (p + "attn_k_norm.weight", (hd,), T.F32),
                    (p + "attn_output.weight", (d, H * hd), T.Q4_K), (p + "ffn_norm.weight", (d,), T.F32),
                    (p + "ffn_gate_inp.weight", (E, d), T.F32),
                    (p + "ffn_gate_exps.weight", (E, F, d), T.Q4_K), (p + "ffn_up_exps.weight", (E, F, d), T.Q4_K),
                    (p + "ffn_down_exps.weight", (E, d, F), T.Q6_K if more(i, n_layers) else T.Q4_K)]
    tensors += [("output_norm.weight", (d,), T.F32), ("output.weight", (V, d), T.Q6_K)]
    pools: dict = {}

    def nbytes(shape, qt) -> int:
        if qt == T.F32:
            return 4 * int(np.prod(shape))
        be, bb = GGML_QUANT_SIZES[qt]
        return int(np.prod(shape[:-1])) * shape[-1] // be * bb

    def data(name, shape, qt):
        if len(shape) == 1:
            return (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        if qt == T.F32:
            return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        k = shape[-1]
        rows = int(np.prod(shape[:-1]))
        emb = name == "token_embd.weight"
        key = (int(qt), k, emb)
        if key not in pools:
            arr, _ = random_matrix(qt, POOL_ROWS, k, rng, 1.0 if emb else None)
            pools[key] = np.ascontiguousarray(np.asarray(arr).view(np.uint8).reshape(POOL_ROWS, -1))
        pool = pools[key]
        return pool[rng.integers(0, POOL_ROWS, rows)].reshape(*shape[:-1], pool.shape[1])

    for name, shape, qt in tensors:
        if qt == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, qt))
        else:
            be, bb = GGML_QUANT_SIZES[qt]
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // be * bb), np.dtype(np.uint8), nbytes(shape, qt),
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qt in tensors:
        w.write_tensor_data(data(name, shape, qt))
    w.close()
    return out


def _say(msg: str) -> None:
    """Progress on stderr as it happens (a timed-out run then shows where it was)."""
    print(f"[aotx {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


AGG_SLOTS, AGG_STEPS = 16, 8


def _speeds(model, vocab: int, res: dict, agg: bool = True) -> None:
    """Prefill 512 (one chunk, after a warm-up), batch-1 greedy decode tokens/s and (``agg``)
    aggregate decode at AGG_SLOTS slots into res."""
    from aotx.engine.model.batch import Segment

    rng = np.random.default_rng(0)

    def toks(n):
        return rng.integers(0, vocab, n).astype(np.int32)

    kv = model.new_kv_cache(1, 1024)
    model.forward(toks(32), [Segment(0, 0, 32)], kv)          # warm-up (setup already touched every expert)
    t = time.perf_counter()
    model.forward(toks(512), [Segment(0, 0, 512)], kv)
    res["prefill_512_tok_s"] = round(512 / (time.perf_counter() - t), 1)
    tok = np.array([1], np.int32)
    for i in range(2):
        tok = model.greedy(tok, [Segment(0, 512 + i, 1)], kv)
    steps = DECODE_STEPS
    t = time.perf_counter()
    for i in range(steps):
        tok = model.greedy(tok, [Segment(0, 514 + i, 1)], kv)
    res["decode_b1_tok_s"] = round(steps / (time.perf_counter() - t), 2)
    if agg:
        # aggregate decode at AGG_SLOTS slots (issue 22 item 6): each slot prefilled with 32
        # tokens, then AGG_STEPS steps of one token per slot in one batch
        kv = model.new_kv_cache(AGG_SLOTS, 256)
        for j in range(AGG_SLOTS):
            model.forward(toks(32), [Segment(j, 0, 32)], kv)
        toks16 = np.ones(AGG_SLOTS, np.int32)
        toks16 = model.greedy(toks16, [Segment(j, 32, 1) for j in range(AGG_SLOTS)], kv)   # warm-up
        t = time.perf_counter()
        for i in range(AGG_STEPS):
            toks16 = model.greedy(toks16, [Segment(j, 33 + i, 1) for j in range(AGG_SLOTS)], kv)
        res[f"aggregate_{AGG_SLOTS}_tok_s"] = round(AGG_SLOTS * AGG_STEPS / (time.perf_counter() - t), 2)


def aotx(path: Path, budget: str, home: Path, gpu_share: float = 0.0, all_gpu: bool = False) -> dict:
    import cupy as cp

    from aotx.engine.backend.cuda import CudaBackend
    from aotx.engine.model import experts as X
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.runtime import admission

    res: dict = {"engine": "aotx", "file_bytes": path.stat().st_size}
    t0 = time.perf_counter()
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    model = build(cfg, gf, CudaBackend(tune="auto", artifact_root=home, tune_budget_s=20.0))
    cp.cuda.Device().synchronize()
    res["load_s"] = round(time.perf_counter() - t0, 2)
    _say(f"loaded in {res['load_s']} s")
    res["gpu_weight_bytes"] = int(model.weight_bytes)
    res["host_expert_bytes"] = int(model.backend.host_expert_bytes)
    t = time.perf_counter()
    from aotx.engine.model.loader import fingerprint

    st = X.setup(model, model_fp=fingerprint(gf), gpu_bytes=0, host_bytes=None, root=home)
    res["experts_setup_s"] = round(time.perf_counter() - t, 2)
    res["experts_stages"] = st.stages
    res["plan"] = st.plan.summary()
    _say(f"expert setup {res['experts_setup_s']} s: {st.stages}")
    total = sum(x.n_expert * x.expert_bytes for x in X.moe_layers(model.program))
    try:
        res["admission"] = admission.check_experts(st.plan, total, admission.machine_memory_bytes(), gpu=True)
    except Exception as e:  # noqa: BLE001 - report it, the measurement goes on
        res["admission"] = [f"{type(e).__name__}: {e}"]
    gpu_total = admission.parse_size(budget)
    res["budget"] = {"gpu_budget_bytes": gpu_total, "model_file_bytes": path.stat().st_size,
                     "fits": int(model.weight_bytes) + (256 << 20) <= gpu_total}
    _speeds(model, cfg.vocab_size, res)
    _say(f"every expert on the CPU: {res['prefill_512_tok_s']} / {res['decode_b1_tok_s']} tok/s (prefill 512 / decode)")
    res["expert_pool"] = model.compiled.expert_stats()["pool"]
    if gpu_share > 0:
        g: dict = {"share": gpu_share, "gpu_expert_budget_bytes": int(gpu_share * total)}
        t = time.perf_counter()
        st = X.setup(model, model_fp=fingerprint(gf), gpu_bytes=g["gpu_expert_budget_bytes"], host_bytes=None,
                     root=home)
        g["experts_setup_s"] = round(time.perf_counter() - t, 2)
        g["plan"] = st.plan.summary()
        g["placed_gpu_bytes"] = int(st.placed.get("gpu_bytes", 0))
        g["gpu_experts"] = int(st.plan.count("gpu"))
        s0 = model.compiled.expert_stats()
        _speeds(model, cfg.vocab_size, g)
        s1 = model.compiled.expert_stats()
        g["gpu_pairs"] = sum(s1["gpu_rows"]) - sum(s0["gpu_rows"])
        g["cpu_pairs"] = s1["pool"]["rows"] - s0["pool"]["rows"]
        res["gpu_tier"] = g
    if all_gpu:
        # every expert in the GPU cache (the H200 holds the whole file): the third row
        a: dict = {"share": 1.0, "gpu_expert_budget_bytes": int(total) + (64 << 20)}
        t = time.perf_counter()
        st = X.setup(model, model_fp=fingerprint(gf), gpu_bytes=a["gpu_expert_budget_bytes"], host_bytes=None,
                     root=home)
        a["experts_setup_s"] = round(time.perf_counter() - t, 2)
        a["plan"] = st.plan.summary()
        a["gpu_experts"] = int(st.plan.count("gpu"))
        _speeds(model, cfg.vocab_size, a)
        _say(f"every expert on the GPU: {a['prefill_512_tok_s']} / {a['decode_b1_tok_s']} tok/s")
        res["all_gpu"] = a
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("write")
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--layers", type=int, default=SHAPE["n_layers"])
    p = sub.add_parser("aotx")
    p.add_argument("model")
    p.add_argument("--json", required=True)
    p.add_argument("--budget", default="8G")
    p.add_argument("--home", default="/tmp/moe_gpu_bench_home")
    p.add_argument("--gpu-share", type=float, default=0.0,
                   help="then again with this share of the routed experts' bytes as the GPU expert budget")
    p.add_argument("--all-gpu", action="store_true", help="then again with every expert on the GPU")
    a = ap.parse_args(argv)
    if a.cmd == "write":
        t = time.perf_counter()
        out = write(Path(a.out), Path(a.tokenizer), a.layers)
        print(f"wrote {out} ({out.stat().st_size:,} bytes) in {time.perf_counter() - t:.1f} s")
        return 0
    if os.environ.get("GPU_BENCH_FAKE"):            # the flow on the CPU against fake CuPy (no numbers)
        from tests.tools import gpu_fake_cupy

        gpu_fake_cupy.install()
    r = aotx(Path(a.model), a.budget, Path(a.home), a.gpu_share, a.all_gpu)
    Path(a.json).write_text(json.dumps(r, indent=1))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
