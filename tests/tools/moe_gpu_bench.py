"""A Qwen3-30B-A3B-shaped random-weight mixture of experts on one GPU: AOTX next to llama.cpp
with ``--n-cpu-moe`` (issue 22). Driven by tests/tools/moe_gpu_bench.sh; subcommands:

* ``write OUT.gguf --tokenizer .gpubench/tokenizer.json [--layers N] [--router-skew A]``: the
  file, streamed tensor by tensor (qwen3moe: 48 layers, d_model 2048, 32 query heads and 4 KV
  heads of 128, 128 experts of width 768, 8 per token; Q4_K with Q6_K ``attn_v`` and
  ``ffn_down_exps`` on llama-quantize's use_more_bits layers, as Q4_K_M; router F32;
  SmolLM2's vocabulary of 49,152 tokens, so the output head is smaller than the real
  model's), about 17 GB. Every matrix row is drawn from a small pool of valid random rows of
  its type (seconds per GB). Routing is about uniform (random router rows, random hidden
  states); ``--router-skew A`` > 0 scales router row e of layer l by ``router_scales``: the
  expert of rank r in a per-layer random order gets (r + 1)^-A (normalized to mean 1), so
  its logits are larger in magnitude and it wins top-8 more often (a Zipf-like skew: at
  A = 0.8 the 51 most used of 128 experts get ~96% of the routed rows, 40% of them at
  uniform routing; simulated on normal hidden states). Default 0: the uniform file.
* ``aotx FILE --json OUT.json [--budget 8G] [--gpu-share 0.4] [--all-gpu] [--learned-skew A]
  [--deadline EPOCH_S]``: AOTX on the CUDA backend. Every configuration measures prefill 512
  tokens/s (one chunk, after a warm-up), batch-1 greedy decode tokens/s over DECODE_STEPS
  steps and aggregate decode at AGG_SLOTS slots, and writes OUT.json after each metric (a
  call cut off by its timeout keeps what it measured). 1. dense layers on the GPU, every
  routed expert on the CPU tier (GPU expert budget 0): the expert-tier setup (calibration,
  plan, placement: its stages and plan) and admission's lines; 2. (``--gpu-share`` > 0) a
  GPU expert budget of that share of the routed experts' bytes (``gpu_tier``); 3.
  (``--all-gpu``) every expert on the GPU (``all_gpu``); 2 and 3 reuse the stored
  calibration (no re-timing). 4. (``--learned-skew A`` > 0) the learned GPU expert cache
  under skewed routing (``learned``): the routers of the loaded model scaled in memory as
  ``write --router-skew A`` scales them (no second 17 GB file), then the static plan of
  ``--gpu-share`` against ``--expert-cache lfu`` on the same budget (a warm-up of ticks
  first, at most ``--learned-copies`` copies per tick), decode b1 and aggregate 16 each,
  with the share of routed rows the GPU computed. A stage that would start after
  ``--deadline`` (epoch seconds) less its estimate is skipped, with a line saying so.

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
AGG_SLOTS, AGG_STEPS = 16, 8


def router_scales(layer: int, n_expert: int, skew: float) -> np.ndarray:
    """(n_expert,) float32 scales of layer ``layer``'s router rows for a skew ``skew`` (module
    docstring): (rank + 1)^-skew over a random order of the experts seeded by the layer,
    normalized to mean 1; all ones at skew 0."""
    if skew <= 0:
        return np.ones(n_expert, np.float32)
    rank = np.random.default_rng(1000 + layer).permutation(n_expert)
    s = (rank + 1.0) ** -float(skew)
    return (s / s.mean()).astype(np.float32)


def write(out: Path, tokenizer_json: Path, n_layers: int, router_skew: float = 0.0) -> Path:
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
    w.add_name("aotx-random-qwen3-30b-a3b-shape" + (f"-skew{router_skew:g}" if router_skew > 0 else ""))
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
            w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            if router_skew > 0 and name.endswith("ffn_gate_inp.weight"):
                w *= router_scales(int(name.split(".")[1]), shape[0], router_skew)[:, None]
            return w
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


def _speeds(model, vocab: int, res: dict, dump, prefill: bool = True, agg: bool = True) -> None:
    """Prefill 512 (one chunk, after a warm-up), batch-1 greedy decode tokens/s and (``agg``)
    aggregate decode at AGG_SLOTS slots into res; ``dump()`` after each."""
    from aotx.engine.model.batch import Segment

    rng = np.random.default_rng(0)

    def toks(n):
        return rng.integers(0, vocab, n).astype(np.int32)

    kv = model.new_kv_cache(1, 1024)
    model.forward(toks(32), [Segment(0, 0, 32)], kv)          # warm-up (setup already touched every expert)
    if prefill:
        t = time.perf_counter()
        model.forward(toks(512), [Segment(0, 0, 512)], kv)
        res["prefill_512_tok_s"] = round(512 / (time.perf_counter() - t), 1)
        dump()
    p0 = 512 if prefill else 32
    tok = np.array([1], np.int32)
    for i in range(2):
        tok = model.greedy(tok, [Segment(0, p0 + i, 1)], kv)
    t = time.perf_counter()
    for i in range(DECODE_STEPS):
        tok = model.greedy(tok, [Segment(0, p0 + 2 + i, 1)], kv)
    res["decode_b1_tok_s"] = round(DECODE_STEPS / (time.perf_counter() - t), 2)
    dump()
    if agg:
        # aggregate decode at AGG_SLOTS slots (issue 22 item 6): the slots prefilled with 32
        # tokens each in ONE forward (16 segments), then AGG_STEPS steps of one token per slot
        kv = model.new_kv_cache(AGG_SLOTS, 256)
        model.forward(toks(32 * AGG_SLOTS), [Segment(j, 0, 32) for j in range(AGG_SLOTS)], kv)
        toks16 = np.ones(AGG_SLOTS, np.int32)
        toks16 = model.greedy(toks16, [Segment(j, 32, 1) for j in range(AGG_SLOTS)], kv)   # warm-up
        t = time.perf_counter()
        for i in range(AGG_STEPS):
            toks16 = model.greedy(toks16, [Segment(j, 33 + i, 1) for j in range(AGG_SLOTS)], kv)
        res[f"aggregate_{AGG_SLOTS}_tok_s"] = round(AGG_SLOTS * AGG_STEPS / (time.perf_counter() - t), 2)
        dump()


def _with_moe_graphs(model, vocab: int, into: dict, dump) -> None:
    """The placement's decode and aggregate again with ``CudaBackend(moe_graphs=True)`` (the
    tick as captured graphs between the host moe steps, not the eager path), into
    ``into["graphs"]``; MOE_BENCH_GRAPHS=0 skips it."""
    if os.environ.get("MOE_BENCH_GRAPHS", "1") == "0":
        return
    be = model.compiled.backend
    saved = getattr(be, "moe_graphs", False)
    be.moe_graphs = True
    try:
        into["graphs"] = {}
        _speeds(model, vocab, into["graphs"], dump, prefill=False)
    except Exception as e:  # noqa: BLE001 - report it, the measurement goes on
        into["graphs"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        be.moe_graphs = saved
    _say(f"   with moe_graphs: {into['graphs']}")
    dump()


def _gpu_share_of_rows(model, run) -> dict:
    """Run ``run()``; the (row, expert) pairs the GPU tier and the CPU pool computed in it."""
    s0 = model.compiled.expert_stats()
    run()
    s1 = model.compiled.expert_stats()
    g = sum(s1["gpu_rows"]) - sum(s0["gpu_rows"])
    c = s1["pool"]["rows"] - s0["pool"]["rows"]
    return {"gpu_pairs": int(g), "cpu_pairs": int(c), "gpu_pair_share": round(g / max(1, g + c), 4)}


def _skew_routers(model, skew: float) -> list:
    """Scale each moe step's host router rows by ``router_scales`` (as ``write --router-skew``
    writes them); returns the old routers (``_unskew_routers`` puts them back)."""
    from gguf import GGMLQuantizationType as T

    from aotx.engine.backend.cpu.matmul import QuantMatrix

    saved = []
    for st in model.compiled.moe_steps:
        dm = st.s.attrs["router"]                          # the device copy the host one was made from
        if int(dm.qtype) != int(T.F32):
            raise ValueError(f"router {dm.name}: {T(dm.qtype).name}, the skew needs F32")
        w = np.ascontiguousarray(np.asarray(dm.data[:dm.m].get())).view(np.float32).reshape(dm.m, dm.k)
        w = w * router_scales(int(st.attrs["moe_layer"]), dm.m, skew)[:, None]
        saved.append(st.attrs["router"])
        st.attrs["router"] = QuantMatrix(np.ascontiguousarray(w, np.float32).view(np.uint8), T.F32, dm.m, dm.k,
                                         dm.name)
    return saved


def _unskew_routers(model, saved: list) -> None:
    for st, w in zip(model.compiled.moe_steps, saved):
        st.attrs["router"] = w


def _learned(model, vocab: int, fp: str, home: Path, total: int, share: float, skew: float, copies: int,
             res: dict, dump, deadline: float) -> None:
    """Stage 4 (module docstring): static plan against the learned lfu cache, same budget,
    under router skew ``skew``, into res (``static`` and ``lfu``)."""
    from aotx.engine.model import experts as X
    from aotx.engine.model.batch import Segment

    budget = int(share * total)
    saved = _skew_routers(model, skew)
    try:
        for policy in ("static", "lfu"):
            if time.time() > deadline - 35:
                _say(f"learned cache: {policy} skipped ({deadline - time.time():.0f} s left)")
                res[policy] = {"skipped": "deadline"}
                dump()
                break
            r: dict = res.setdefault(policy, {})
            t = time.perf_counter()
            learned = X.LearnedPolicy("lfu", copies_per_tick=copies) if policy == "lfu" else None
            st = X.setup(model, model_fp=fp, gpu_bytes=budget, host_bytes=None, root=home, policy=policy,
                         learned=learned)
            r["setup_s"] = round(time.perf_counter() - t, 2)
            r["gpu_experts"] = int(st.plan.count("gpu"))
            if policy == "lfu":
                # warm-up: a 512-token prefill (traffic) then decode ticks until a few ticks copy nothing
                t = time.perf_counter()
                kv = model.new_kv_cache(1, 1024)
                rng = np.random.default_rng(1)
                model.forward(rng.integers(0, vocab, 512).astype(np.int32), [Segment(0, 0, 512)], kv)
                tok, quiet, n = np.array([1], np.int32), 0, 0
                while quiet < 4 and n < 400 and time.time() < deadline - 30:
                    c0 = st.cache.copies
                    tok = model.greedy(tok, [Segment(0, 512 + n, 1)], kv)
                    quiet = quiet + 1 if st.cache.copies == c0 else 0
                    n += 1
                r["warmup"] = {"ticks": n + 1, "copies": st.cache.copies, "s": round(time.perf_counter() - t, 2)}
                c0 = st.cache.copies
                _say(f"learned cache warm-up: {n + 1} ticks, {st.cache.copies} copies")
            r.update(_gpu_share_of_rows(model, lambda: _speeds(model, vocab, r, dump, prefill=False)))
            if policy == "lfu":
                r["cache"] = model.compiled.expert_stats().get("cache", {})
                r["copies_while_measured"] = st.cache.copies - c0
            _say(f"skew {skew}, {policy}: decode {r.get('decode_b1_tok_s')} / aggregate "
                 f"{r.get(f'aggregate_{AGG_SLOTS}_tok_s')} tok/s, GPU share of pairs {r['gpu_pair_share']}")
            dump()
    finally:
        _unskew_routers(model, saved)
        model.compiled.attach_expert_cache(None)


def aotx(path: Path, budget: str, home: Path, gpu_share: float = 0.0, all_gpu: bool = False,
         learned_skew: float = 0.0, learned_copies: int = 32, deadline: float = 0.0,
         json_out: Path | None = None) -> dict:
    import cupy as cp

    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model import experts as X
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.loader import fingerprint
    from aotx.engine.runtime import admission

    deadline = deadline or time.time() + 1e9
    res: dict = {"engine": "aotx", "file_bytes": path.stat().st_size}

    def dump() -> None:
        if json_out is not None:
            tmp = Path(str(json_out) + ".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            os.replace(tmp, json_out)

    def room(what: str, need: float) -> bool:
        left = deadline - time.time()
        if left >= need:
            return True
        _say(f"{what}: skipped ({left:.0f} s left, ~{need:.0f} s needed)")
        res.setdefault("skipped", []).append(what)
        dump()
        return False

    t0 = time.perf_counter()
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    # MOE_BENCH_BACKEND: more CudaBackend arguments as JSON ('{"moe_device": false}': every moe
    # layer as the host step, so the planner spreads the budget as before whole layers)
    extra = json.loads(os.environ.get("MOE_BENCH_BACKEND", "{}"))
    model = build(cfg, gf, CudaBackend(tune="auto", artifact_root=home, tune_budget_s=20.0, **extra))
    res["backend_args"] = extra
    cp.cuda.Device().synchronize()
    res["load_s"] = round(time.perf_counter() - t0, 2)
    _say(f"loaded in {res['load_s']} s")
    res["gpu_weight_bytes"] = int(model.weight_bytes)
    res["host_expert_bytes"] = int(model.backend.host_expert_bytes)
    fp = fingerprint(gf)
    total = sum(x.n_expert * x.expert_bytes for x in X.moe_layers(model.program))
    dump()
    # 1. every expert on the CPU tier (the first setup calibrates and stores the costs)
    t = time.perf_counter()
    st = X.setup(model, model_fp=fp, gpu_bytes=0, host_bytes=None, root=home)
    res["experts_setup_s"] = round(time.perf_counter() - t, 2)
    res["experts_stages"] = st.stages
    res["plan"] = st.plan.summary()
    _say(f"expert setup {res['experts_setup_s']} s: {st.stages}")
    try:
        res["admission"] = admission.check_experts(st.plan, total, admission.machine_memory_bytes(), gpu=True)
    except Exception as e:  # noqa: BLE001 - report it, the measurement goes on
        res["admission"] = [f"{type(e).__name__}: {e}"]
    gpu_total = admission.parse_size(budget)
    res["budget"] = {"gpu_budget_bytes": gpu_total, "model_file_bytes": path.stat().st_size,
                     "fits": int(model.weight_bytes) + (256 << 20) <= gpu_total}
    dump()
    t = time.perf_counter()
    _speeds(model, cfg.vocab_size, res, dump)
    cpu_s = time.perf_counter() - t
    _say(f"every expert on the CPU: {res['prefill_512_tok_s']} / {res['decode_b1_tok_s']} / "
         f"{res.get(f'aggregate_{AGG_SLOTS}_tok_s')} tok/s (prefill 512 / decode / aggregate {AGG_SLOTS}) "
         f"in {cpu_s:.0f} s")
    res["expert_pool"] = model.compiled.expert_stats()["pool"]
    dump()
    _with_moe_graphs(model, cfg.vocab_size, res, dump)
    # 2. a share of the experts on the GPU tier (the stored calibration reused)
    if gpu_share > 0 and room("gpu_tier", 0.8 * cpu_s + 10):
        g: dict = {"share": gpu_share, "gpu_expert_budget_bytes": int(gpu_share * total)}
        res["gpu_tier"] = g
        t = time.perf_counter()
        st = X.setup(model, model_fp=fp, gpu_bytes=g["gpu_expert_budget_bytes"], host_bytes=None, root=home)
        g["experts_setup_s"] = round(time.perf_counter() - t, 2)
        g["plan"] = st.plan.summary()
        g["placed_gpu_bytes"] = int(st.placed.get("gpu_bytes", 0))
        g["gpu_experts"] = int(st.plan.count("gpu"))
        _say(f"GPU tier ({gpu_share:.0%}) setup {g['experts_setup_s']} s: {g['gpu_experts']} experts on the GPU")
        dump()
        g.update(_gpu_share_of_rows(model, lambda: _speeds(model, cfg.vocab_size, g, dump)))
        _say(f"~{gpu_share:.0%} on the GPU: {g.get('prefill_512_tok_s')} / {g.get('decode_b1_tok_s')} / "
             f"{g.get(f'aggregate_{AGG_SLOTS}_tok_s')} tok/s")
        dump()
        _with_moe_graphs(model, cfg.vocab_size, g, dump)
    # 3. every expert on the GPU: the third row
    if all_gpu and room("all_gpu", 40):
        a: dict = {"share": 1.0, "gpu_expert_budget_bytes": int(total) + (64 << 20)}
        res["all_gpu"] = a
        t = time.perf_counter()
        st = X.setup(model, model_fp=fp, gpu_bytes=a["gpu_expert_budget_bytes"], host_bytes=None, root=home)
        a["experts_setup_s"] = round(time.perf_counter() - t, 2)
        a["plan"] = st.plan.summary()
        a["gpu_experts"] = int(st.plan.count("gpu"))
        _say(f"all on the GPU: setup {a['experts_setup_s']} s")
        dump()
        _speeds(model, cfg.vocab_size, a, dump)
        _say(f"every expert on the GPU: {a.get('prefill_512_tok_s')} / {a.get('decode_b1_tok_s')} / "
             f"{a.get(f'aggregate_{AGG_SLOTS}_tok_s')} tok/s")
        dump()
    # 4. the learned GPU expert cache against the static plan, under skewed routing
    if learned_skew > 0 and gpu_share > 0 and room("learned", 75):
        res["learned"] = {"router_skew": learned_skew, "share": gpu_share, "copies_per_tick": learned_copies}
        _learned(model, cfg.vocab_size, fp, home, total, gpu_share, learned_skew, learned_copies, res["learned"],
                 dump, deadline)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    dump()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("write")
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--layers", type=int, default=SHAPE["n_layers"])
    p.add_argument("--router-skew", type=float, default=0.0,
                   help="Zipf-like exponent of the router rows' scales (module docstring); 0: uniform routing")
    p = sub.add_parser("aotx")
    p.add_argument("model")
    p.add_argument("--json", required=True)
    p.add_argument("--budget", default="8G")
    p.add_argument("--home", default="/tmp/moe_gpu_bench_home")
    p.add_argument("--gpu-share", type=float, default=0.0,
                   help="then again with this share of the routed experts' bytes as the GPU expert budget")
    p.add_argument("--all-gpu", action="store_true", help="then again with every expert on the GPU")
    p.add_argument("--learned-skew", type=float, default=0.0,
                   help="then the static plan against the learned lfu cache under this router skew (0: not run)")
    p.add_argument("--learned-copies", type=int, default=32, help="the learned cache's copies per tick")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: skip the stages that would not fit")
    a = ap.parse_args(argv)
    if a.cmd == "write":
        t = time.perf_counter()
        out = write(Path(a.out), Path(a.tokenizer), a.layers, a.router_skew)
        print(f"wrote {out} ({out.stat().st_size:,} bytes) in {time.perf_counter() - t:.1f} s")
        return 0
    if os.environ.get("GPU_BENCH_FAKE"):            # the flow on the CPU against fake CuPy (no numbers)
        from tests.tools import gpu_fake_cupy

        gpu_fake_cupy.install()
    r = aotx(Path(a.model), a.budget, Path(a.home), a.gpu_share, a.all_gpu, a.learned_skew, a.learned_copies,
             a.deadline, Path(a.json))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
