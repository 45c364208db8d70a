"""The H200 benchmark of issue 19, AOTX and llama.cpp on the same files in one call.

``python -m tests.tools.gpu_bench run --out DIR`` (what ``tests/tools/gpu_bench.sh`` runs,
after starting the llama.cpp build) does, each step bounded by what is left of
``--deadline`` seconds and skipped with a line saying so when it would not fit:

1. the CUDA tests of issue 19 / 16 (``tests/test_cuda_invariance.py``);
2. random-weight GGUFs (``tests/models/shapes.py``) in the shapes and tensor-type mix of
   the default model (SmolLM2-135M), Llama-3.1-8B Q4_K_M, Qwen2.5-0.5B Q4_K_M and
   Qwen2.5-7B Q4_K_M, SmolLM2's tokenizer (vocabulary 49,152) in each;
3. per model, in its own process (``gpu_bench aotx``): load with the kernel choice timing
   its candidates (policy auto, fresh artifact), then prefill 512 and 2048 tokens, the
   batch-invariant eager prefill (``prefill="gemv"``) at 512, batch-1 greedy decode
   (graph replay per token, host loop included) and its device time per token, aggregate
   greedy decode at 16 and 64 slots (128-token prompts, 32 steps), the achieved weight
   bandwidth at batch 1 against a device-to-device copy measured in the same process, and
   every GEMV site's GB/s per candidate at batch 1 (the tuner's timings);
4. per model, once the build is there: ``llama-bench`` (pp512, pp2048, tg128) and
   ``llama-batched-bench`` (-npp 128 -ntg 32 -npl 16,64) on the same file;
5. one short table (stdout and DIR/summary.json).

Not a test and not for CI: it needs a GPU, and llama.cpp's CUDA build.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("smollm2-135m", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b")
AOTX_CAP = {"smollm2-135m": 120, "llama-3.1-8b": 130, "qwen2.5-0.5b": 120, "qwen2.5-7b": 130}   # seconds per model
TUNE_BUDGET = {"smollm2-135m": 15, "llama-3.1-8b": 25, "qwen2.5-0.5b": 15, "qwen2.5-7b": 25}
LLAMA_CAP = 45            # seconds per model for both llama.cpp tools
CAP_SCALE = float(os.environ.get("GPU_BENCH_CAP_SCALE", "1"))   # > 1 for a dry run on fake CuPy (slow)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- AOTX on one model (a subprocess per model) ---------------------------------------------------

def copy_bandwidth(cp) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffers, median of 5)."""
    a = cp.ones(1 << 28, cp.float32)
    b = cp.empty_like(a)
    ts = []
    for _ in range(6):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    return 2 * (1 << 30) / statistics.median(ts[1:])


def _replay_ms(cp, graph, stream, n: int = 20) -> float:
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(n):
        graph.launch(stream)
    e1.record(stream)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / n


def read_bytes_per_token(path) -> int:
    """Bytes of weights one decode step reads: every matrix but the token embedding (only
    one row of it is read), unless the embedding is also the output head (tied)."""
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    tied = "output.weight" not in gf.tensors
    n = 0
    for name, t in gf.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue
        n += int(t.n_bytes)
    return n


def _decode_rows(cp, model, prog, toks, B: int, steps: int) -> tuple[float, float, object]:
    """Greedy decode of ``B`` slots (64-token prompts, the same ones on every call: the
    generator is reseeded) for ``steps`` ticks: (tokens/s with the host loop, device ms of one
    replay of the (B, B) graph, the last tick's logits on the host)."""
    import numpy as np

    from aotx.engine.model.batch import Segment

    rng = np.random.default_rng(1234 + B)
    V = prog.vocab
    kv = model.new_kv_cache(B, 256)
    for s in range(B):
        model.forward(rng.integers(0, V, 64).astype(np.int32), [Segment(s, 0, 64)], kv)
    cur = rng.integers(0, V, B).astype(np.int32)
    for i in range(3):
        cur = model.greedy(cur, [Segment(s, 64 + i, 1) for s in range(B)], kv)
    t = time.perf_counter()
    for i in range(steps):
        cur = model.greedy(cur, [Segment(s, 67 + i, 1) for s in range(B)], kv)
    tps = B * steps / (time.perf_counter() - t)
    last = model.last_logits().get().copy()
    ms = _replay_ms(cp, prog._state(kv).graphs[(B, B)], kv.stream)
    return round(tps, 1), round(ms, 4), last


def persistent_variants(cp, model, prog, be, toks) -> dict:
    """The persistent decode step (tests/tools/persistent_step.py) against the graph of
    kernels (what it saves), at 1 and 8 rows, and its blocks per multiprocessor / warps per row pair."""
    import numpy as np

    out = {}
    ref: dict = {}
    saved = (prog.persistent_reason, be.persistent_bps, be.persistent_wpp, be.persistent_prefetch)
    configs = (("graph of kernels", "off (bench)", saved[1], saved[2], True),
               ("persistent bps1 wpp1", None, 1, 1, True), ("persistent bps2 wpp1", None, 2, 1, True),
               ("persistent bps4 wpp1", None, 4, 1, True), ("persistent bps2 wpp2", None, 2, 2, True),
               ("persistent bps2 wpp1 no L2 prefetch", None, 2, 1, False))
    try:
        for label, reason, bps, wpp, pf in configs:
            prog.persistent_reason, be.persistent_bps, be.persistent_wpp, be.persistent_prefetch = reason, bps, wpp, pf
            row = {}
            for B in (1, 8):
                try:
                    row[f"b{B}_tok_s"], row[f"b{B}_device_ms"], last = _decode_rows(cp, model, prog, toks, B, 64)
                    if reason is not None:
                        ref[B] = last
                    elif B in ref:       # the graph's bits after 67 ticks, or not
                        row[f"b{B}_bits_equal"] = bool(np.array_equal(last.view(np.uint32), ref[B].view(np.uint32)))
                except Exception as e:  # noqa: BLE001 - one configuration's failure is a line, not the run's end
                    row[f"b{B}_error"] = f"{type(e).__name__}: {e}"[:300]
            row["note"] = prog.persistent_note
            out[label] = row
            log(f"   {label}: {row}")
    finally:
        prog.persistent_reason, be.persistent_bps, be.persistent_wpp, be.persistent_prefetch = saved
    return out


def aotx_bench(path: Path, name: str, home: Path, tune_budget: float) -> dict:
    import cupy as cp
    import numpy as np

    from aotx.engine.backend.cuda import choice as CC
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build
    from tests.tools import persistent_step

    res: dict = {"engine": "aotx", "model": name}
    t0 = time.perf_counter()
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    # the engine's numerics (make_backend: int8 activations); AOTX_BENCH_NUMERICS=f32 for float32 ones
    int8 = os.environ.get("AOTX_BENCH_NUMERICS", "int8") != "f32"
    # AOTX_BENCH_INT8_MIN: the int8_min_bytes rule's threshold (0: int8 on every model size)
    mb = os.environ.get("AOTX_BENCH_INT8_MIN")
    # session 7's kernels: the flash prefill attention on unless AOTX_BENCH_FLASH=0; the persistent
    # decode step only with AOTX_BENCH_PERSISTENT=auto (session 8's H200: 0.72 ms a token through the
    # graph of kernels, 1.05 persistent; its variants are still timed side by side below)
    from aotx.engine.backend.cuda import attention as CA

    CA.FLASH_ATTENTION = os.environ.get("AOTX_BENCH_FLASH", "1") == "1"
    res["flash_attention"] = CA.FLASH_ATTENTION
    be = persistent_step.backend(tune="auto", artifact_root=home, tune_budget_s=tune_budget,
                                 int8_activations=int8, int8_min_bytes=int(mb) if mb else None,
                                 persistent=os.environ.get("AOTX_BENCH_PERSISTENT", "off"))
    model = build(cfg, gf, be)
    res["numerics"] = be.numerics
    cp.cuda.Device().synchronize()
    prog = model.compiled
    kc = prog.kernel_choice
    res.update(load_s=round(time.perf_counter() - t0, 2), kernel_choice_s=prog.kernel_choice_s,
               kernel_choice=kc.summary(), weight_bytes=int(model.weight_bytes),
               read_bytes_per_token=read_bytes_per_token(path), prefill_modes=sorted(set(prog._pm.values())))
    bw = copy_bandwidth(cp)
    res["copy_GBs"] = round(bw / 1e9, 1)
    rng = np.random.default_rng(0)
    V = cfg.vocab_size

    def toks(n):
        return rng.integers(0, V, n).astype(np.int32)

    # prefill (the eager path: tensor-core GEMMs), then the batch-invariant mode at 512
    kv = model.new_kv_cache(1, 2048 + 64)
    res["prefill_tok_s"] = {}
    for n in (512, 2048):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            model.forward(toks(n), [Segment(0, 0, n)], kv)
            ts.append(time.perf_counter() - t)
        res["prefill_tok_s"][str(n)] = round(n / min(ts[1:]), 1)
    prog._forced_prefill, saved = "gemv", prog._forced_prefill   # the measurement only: every eager step on GEMVs
    try:
        ts = []
        for _ in range(2):
            t = time.perf_counter()
            model.forward(toks(512), [Segment(0, 0, 512)], kv)
            ts.append(time.perf_counter() - t)
        res["prefill_invariant_512_tok_s"] = round(512 / ts[-1], 1)
    finally:
        prog._forced_prefill = saved
    del kv

    # batch-1 decode: greedy, one graph replay per token, host loop included
    kv = model.new_kv_cache(1, 512)
    model.forward(toks(128), [Segment(0, 0, 128)], kv)
    tok = np.array([1], np.int32)
    for i in range(4):
        tok = model.greedy(tok, [Segment(0, 128 + i, 1)], kv)
    steps = 128
    t = time.perf_counter()
    for i in range(steps):
        tok = model.greedy(tok, [Segment(0, 132 + i, 1)], kv)
    res["decode_b1_tok_s"] = round(steps / (time.perf_counter() - t), 1)
    st = prog._state(kv)
    ms = _replay_ms(cp, st.graphs[(1, 1)], kv.stream)
    res["decode_b1_device_ms"] = round(ms, 4)
    res["decode_b1_GBs"] = round(res["read_bytes_per_token"] / (ms * 1e-3) / 1e9, 1)
    res["decode_b1_bw_fraction"] = round(res["decode_b1_GBs"] / res["copy_GBs"], 3)
    del kv
    res["persistent"] = prog.persistent_note
    if prog.persistent_reason is None:
        res["persistent_variants"] = persistent_variants(cp, model, prog, be, toks)

    # aggregate decode: 128-token prompts, 32 greedy steps for all slots
    kvb = model.new_kv_cache(64, 256)
    for s0 in range(0, 64, 16):
        segs = [Segment(s, 0, 128) for s in range(s0, s0 + 16)]
        model.forward(toks(128 * 16), segs, kvb)
    res["aggregate_tok_s"], res["tick_device_ms"] = {}, {}
    pos = {s: 128 for s in range(64)}
    for B in (16, 64):
        cur = toks(B)
        for rep in range(33):
            if rep == 1:
                t = time.perf_counter()
            cur = model.greedy(cur, [Segment(s, pos[s], 1) for s in range(B)], kvb)
            for s in range(B):
                pos[s] += 1
        dt = time.perf_counter() - t
        res["aggregate_tok_s"][str(B)] = round(B * 32 / dt, 1)
        res["tick_device_ms"][str(B)] = round(_replay_ms(cp, prog._state(kvb).graphs[(B, B)], kvb.stream), 4)
    # AOTX_BENCH_GEMM_ROWS=N: the same decode steps again with CudaBackend(gemm_min_rows=N)
    # (batches of N+ rows on the eager path's tensor-core GEMMs, not the graph of GEMVs)
    gm = os.environ.get("AOTX_BENCH_GEMM_ROWS")
    if gm:
        res["aggregate_gemm_tok_s"], saved_gm = {}, be.gemm_min_rows
        be.gemm_min_rows = int(gm)
        try:
            for B in (16, 64):
                cur = toks(B)
                for rep in range(17):
                    if rep == 1:
                        cp.cuda.Device().synchronize()
                        t = time.perf_counter()
                    cur = model.greedy(cur, [Segment(s, pos[s], 1) for s in range(B)], kvb)
                    for s in range(B):
                        pos[s] += 1
                res["aggregate_gemm_tok_s"][str(B)] = round(B * 16 / (time.perf_counter() - t), 1)
        except Exception as e:  # noqa: BLE001 - a measurement's failure is a line, not the run's end
            res["aggregate_gemm_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            be.gemm_min_rows = saved_gm
    del kvb

    # every GEMV site at batch 1: GB/s of each candidate the tuner timed
    per_site = {}
    groups: dict[str, list] = {}
    for g in prog.gemvs:
        groups.setdefault(g.site, []).append(g)
    for site, gs in groups.items():
        key = CC.at_bucket(site, 1)
        us = kc.timings_us.get(key)
        nbytes = gs[0].weight_bytes
        row = {"bytes": nbytes, "launches_per_token": len(gs), "chosen": kc.choice.get(key),
               "default": CC.gemv_default(1, gs[0].nw is not None, gs[0].m_rows, gs[0].k)}
        if us:
            row["GBs"] = {c: round(nbytes / (t * 1e-6) / 1e9, 1) for c, t in us.items()}
        for b in (16, 64):
            u = kc.timings_us.get(CC.at_bucket(site, b))
            if u:
                best = min(u.values())
                row[f"GBs_b{b}"] = round(nbytes / (best * 1e-6) / 1e9, 1)
        per_site[site] = row
    res["gemv_sites"] = per_site
    return res


# ---- llama.cpp on one model ----------------------------------------------------------------------

def _run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, f"timeout after {timeout:.0f} s"


def llamacpp_bench(bindir: Path, path: Path, name: str, timeout: float) -> dict:
    res: dict = {"engine": "llama.cpp", "model": name}
    pin = ["taskset", "-c", f"0-{(os.cpu_count() or 1) - 1}"] if shutil.which("taskset") else []
    llp = os.environ.get("LLAMA_LD_LIBRARY_PATH")     # prebuilt binaries: their CUDA libraries, for them only
    if llp:
        pin = ["env", f"LD_LIBRARY_PATH={llp}", f"LD_PRELOAD={os.environ.get('LLAMA_PRELOAD', '')}"] + pin
    t_end = time.monotonic() + timeout
    # FlashAttention off and on: the table takes llama.cpp's better figure of the two
    rc, out, err = _run(pin + [str(bindir / "llama-bench"), "-m", str(path), "-ngl", "99", "-fa", "0,1",
                               "-p", "512,2048", "-n", "128", "-r", "3", "-o", "jsonl"],
                        max(5.0, 0.6 * timeout))
    res["llama_bench_rc"] = rc
    for ln in out.splitlines():
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        fa = "fa1" if str(d.get("flash_attn")).lower() in ("1", "true", "on", "enabled") else "fa0"
        ts = round(float(d["avg_ts"]), 1)
        if d.get("n_gen") == 0:
            res.setdefault(f"prefill_tok_s_{fa}", {})[str(d["n_prompt"])] = ts
            k = str(d["n_prompt"])
            res.setdefault("prefill_tok_s", {})[k] = max(ts, res.get("prefill_tok_s", {}).get(k, 0.0))
        elif d.get("n_prompt") == 0:
            res[f"decode_b1_tok_s_{fa}"] = ts
            res["decode_b1_tok_s"] = max(ts, res.get("decode_b1_tok_s", 0.0))
        res["build"] = f"{d.get('build_commit', '?')} (build {d.get('build_number', '?')})"
    if rc:
        res["llama_bench_err"] = err.strip().splitlines()[-3:]
    left = t_end - time.monotonic()
    rc, out, err = _run(pin + [str(bindir / "llama-batched-bench"), "-m", str(path), "-ngl", "99", "-fa", "on",
                               "-c", "12288", "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "32",
                               "-npl", "16,64", "--output-format", "jsonl"], max(5.0, left))
    res["batched_bench_rc"] = rc
    for ln in (out + "\n" + err).splitlines():
        ln = ln.strip()
        if not ln.startswith("{"):
            continue
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if "speed_tg" in d:
            res.setdefault("aggregate_tok_s", {})[str(d["pl"])] = round(float(d["speed_tg"]), 1)
    if rc:
        res["batched_bench_err"] = err.strip().splitlines()[-3:]
    return res


# ---- the whole run ---------------------------------------------------------------------------------

def table(rows: dict, out: Path) -> None:
    """One short table: per model, AOTX and llama.cpp side by side, and their ratio."""
    lines = []
    hdr = f"{'model':14} {'metric':22} {'llama.cpp':>10} {'AOTX':>10} {'ratio':>7}"
    lines.append(hdr)
    metrics = [("prefill 512 tok/s", lambda r: r["prefill_tok_s"]["512"]),
               ("prefill 2048 tok/s", lambda r: r["prefill_tok_s"]["2048"]),
               ("decode b1 tok/s", lambda r: r["decode_b1_tok_s"]),
               ("aggregate 16 tok/s", lambda r: r["aggregate_tok_s"]["16"]),
               ("aggregate 64 tok/s", lambda r: r["aggregate_tok_s"]["64"]),
               # AOTX_BENCH_GEMM_ROWS: AOTX's decode ticks on the eager path's GEMMs, against llama.cpp's aggregates
               ("aggregate 16, GEMMs", lambda r: r["aggregate_gemm_tok_s"]["16"] if "engine" in r and
                r["engine"] == "aotx" else r["aggregate_tok_s"]["16"]),
               ("aggregate 64, GEMMs", lambda r: r["aggregate_gemm_tok_s"]["64"] if "engine" in r and
                r["engine"] == "aotx" else r["aggregate_tok_s"]["64"])]
    for name, r in rows.items():
        a, l = r.get("aotx", {}), r.get("llama.cpp", {})
        for label, get in metrics:
            if label.endswith("GEMMs") and "aggregate_gemm_tok_s" not in a:
                continue
            def val(d):
                try:
                    return float(get(d))
                except (KeyError, TypeError, ValueError):
                    return None
            va, vl = val(a), val(l)
            ratio = f"{va / vl:7.2f}" if va and vl else "      -"
            lines.append(f"{name:14} {label:22} {vl if vl is not None else '-':>10} {va if va is not None else '-':>10} "
                         f"{ratio}")
        if a.get("decode_b1_GBs"):
            lbw = ""
            if l.get("decode_b1_tok_s") and a.get("read_bytes_per_token"):
                lbw = f", llama.cpp ~{a['read_bytes_per_token'] * l['decode_b1_tok_s'] / 1e9:.0f} GB/s (tg128)"
            lines.append(f"{name:14} {'b1 weight bandwidth':22} AOTX {a['decode_b1_GBs']} GB/s device-timed = "
                         f"{100 * a['decode_b1_bw_fraction']:.0f}% of the {a['copy_GBs']} GB/s copy{lbw}")
        for label, pv in (a.get("persistent_variants") or {}).items():
            lines.append(f"{name:14} {label:22} b1 {pv.get('b1_tok_s', '-')} tok/s {pv.get('b1_device_ms', '-')} ms, "
                         f"b8 {pv.get('b8_tok_s', '-')} tok/s {pv.get('b8_device_ms', '-')} ms")
        if a.get("prefill_invariant_512_tok_s"):
            lines.append(f"{name:14} {'invariant prefill 512':22} AOTX {a['prefill_invariant_512_tok_s']} tok/s "
                         f"(GEMV kernels for every eager row; tensor cores: {a['prefill_tok_s']['512']})")
    text = "\n".join(lines)
    log("== table (random weights, vocabulary 49,152; llama.cpp: the better of -fa 0 and -fa 1 in llama-bench, "
        "-fa on in llama-batched-bench)")
    log(text)
    (out / "table.txt").write_text(text + "\n")


def cmd_run(args) -> int:
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    left = lambda: deadline - time.monotonic()  # noqa: E731
    summary: dict = {"models": {}, "steps": {}}

    # 1. tests
    if args.tests and left() > 300:
        t = time.monotonic()
        # GPU_BENCH_TEST_FILES (space-separated) and GPU_BENCH_TEST_S: which CUDA tests run first, how long at most
        files = os.environ.get("GPU_BENCH_TEST_FILES", "tests/test_cuda_invariance.py").split()
        limit = min(float(os.environ.get("GPU_BENCH_TEST_S", "150")), left() - 250)
        # GPU_BENCH_PYTEST_ARGS: more pytest arguments ("-x -k Q8_0", say: a failure's traceback before the limit)
        extra = os.environ.get("GPU_BENCH_PYTEST_ARGS", "").split()
        rc, so, se = _run([sys.executable, "-m", "pytest", "-q", "--tb=short", "-rs", "-p", "no:cacheprovider",
                           "-s"] + extra + files, limit)
        (out / "pytest.log").write_text(so + "\n--- stderr\n" + se)
        tail = [ln for ln in so.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
        summary["steps"]["tests"] = {"rc": rc, "summary": tail[-1] if tail else f"rc {rc}",
                                     "s": round(time.monotonic() - t, 1)}
        log(f"== tests: {'PASS' if rc == 0 else 'FAIL'} ({summary['steps']['tests']['summary']}, "
            f"{summary['steps']['tests']['s']} s)")
        for ln in so.splitlines():
            if "relative error against float32" in ln:
                log("   " + ln.strip())
        if rc:
            log("\n".join(so.splitlines()[-25:]))
    else:
        log("== tests: skipped")

    # 2-4. per model: write its file, AOTX on it; llama.cpp on every file AOTX has measured as
    # soon as the build is there (so each pair is measured even if time runs out later)
    from aotx.engine.model.architectures import get_architecture
    from tests.models import shapes

    try:
        get_architecture("qwen2")
        qwen_arch = "qwen2"
    except Exception:  # noqa: BLE001 - AOTX without qwen2 yet: the same shapes as llama
        qwen_arch = "llama"
    kv = shapes.load_tokenizer(args.tokenizer)
    files: dict[str, Path] = {}
    rows: dict = {}
    home = work / "aotx-home"
    bindir = Path(args.llama_bin)

    def flush() -> None:
        """summary.json as it stands (a call cut short still returns what was measured)."""
        summary["rows"] = rows
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    def built() -> bool:
        return (bindir / "llama-bench").exists() and (bindir / "llama-batched-bench").exists() and \
            Path(args.build_done).exists() and Path(args.build_done).read_text().strip() == "0"

    def llama_pending(wait: bool) -> None:
        while wait and not Path(args.build_done).exists() and left() > 40:
            time.sleep(2)
        if not built():
            return
        for name, path in files.items():
            if "llama.cpp" in rows.get(name, {}) or "aotx" not in rows.get(name, {}):
                continue
            if left() < 25:
                log(f"== llama.cpp {name}: skipped, {left():.0f} s left")
                continue
            t = time.monotonic()
            r = llamacpp_bench(bindir, path, name, min(CAP_SCALE * LLAMA_CAP, left() - 10))
            rows[name]["llama.cpp"] = r
            log(f"== llama.cpp {name} ({time.monotonic() - t:.0f} s): prefill {r.get('prefill_tok_s')} decode b1 "
                f"{r.get('decode_b1_tok_s')} aggregate {r.get('aggregate_tok_s')} [{r.get('build', '?')}]"
                + (f" errors: {r.get('llama_bench_err') or ''} {r.get('batched_bench_err') or ''}"
                   if r.get("llama_bench_rc") or r.get("batched_bench_rc") else ""))

    for name in args.models.split(","):
        cap = min(CAP_SCALE * AOTX_CAP.get(name, 120), left() - 30)
        if cap < 30:
            log(f"== {name}: skipped, {left():.0f} s left")
            continue
        t = time.monotonic()
        arch = qwen_arch if SHAPES_ARCH(name) == "qwen2" else None
        files[name] = path = shapes.write_shape(work / f"{name}.gguf", name, kv, arch=arch)
        log(f"== wrote {name} ({arch or SHAPES_ARCH(name)}): {path.stat().st_size / 1e9:.2f} GB in "
            f"{time.monotonic() - t:.1f} s")
        summary["models"][name] = {"file_bytes": path.stat().st_size, "arch": arch or SHAPES_ARCH(name)}
        # GPU_BENCH_LLAMA_FIRST=1: llama.cpp on the file before AOTX (a short lease still brings its side back)
        if os.environ.get("GPU_BENCH_LLAMA_FIRST") == "1" and built() and left() > 60:
            t = time.monotonic()
            r = llamacpp_bench(bindir, path, name, min(CAP_SCALE * LLAMA_CAP, left() - 10))
            rows.setdefault(name, {})["llama.cpp"] = r
            log(f"== llama.cpp {name} ({time.monotonic() - t:.0f} s, first): prefill {r.get('prefill_tok_s')} "
                f"decode b1 {r.get('decode_b1_tok_s')} aggregate {r.get('aggregate_tok_s')} [{r.get('build', '?')}]")
            flush()
        cap = min(CAP_SCALE * AOTX_CAP.get(name, 120), left() - 20)
        t = time.monotonic()
        jf = out / f"aotx_{name}.json"
        rc, so, se = _run([sys.executable, "-m", "tests.tools.gpu_bench", "aotx", "--model", str(path), "--name", name,
                           "--home", str(home), "--budget", str(TUNE_BUDGET.get(name, 20)), "--json", str(jf)], cap)
        if rc or not jf.exists():
            log(f"== AOTX {name}: FAILED rc {rc} after {time.monotonic() - t:.0f} s\n" + "\n".join(
                (so + se).strip().splitlines()[-15:]))
        else:
            r = json.loads(jf.read_text())
            rows.setdefault(name, {})["aotx"] = r
            log(f"== AOTX {name} ({time.monotonic() - t:.0f} s): load {r['load_s']} s (kernel choice "
                f"{r['kernel_choice_s']} s: {r['kernel_choice']}); prefill {r['prefill_tok_s']} tok/s, "
                f"invariant 512 {r['prefill_invariant_512_tok_s']}; decode b1 {r['decode_b1_tok_s']} tok/s "
                f"({r['decode_b1_device_ms']} ms device, {r['decode_b1_GBs']} GB/s = "
                f"{100 * r['decode_b1_bw_fraction']:.0f}% of copy {r['copy_GBs']}); aggregate "
                f"{r['aggregate_tok_s']} (tick {r['tick_device_ms']} ms)"
                + (f", on the GEMMs {r.get('aggregate_gemm_tok_s')} {r.get('aggregate_gemm_error', '')}"
                   if "aggregate_gemm_tok_s" in r else "") + f"; prefill GEMM modes {r['prefill_modes']}")
            for site, st in r["gemv_sites"].items():
                gbs = st.get("GBs", {})
                if gbs:
                    best = max(gbs, key=gbs.get)
                    log(f"   {site}: x{st['launches_per_token']}/token, {st['bytes'] / 1e6:.2f} MB; b1 chosen "
                        f"{st['chosen']} {gbs.get(st['chosen'], '-')} GB/s, default {st['default']} "
                        f"{gbs.get(st['default'], '-')}, best {best} {gbs[best]}; b16 {st.get('GBs_b16', '-')}, "
                        f"b64 {st.get('GBs_b64', '-')} GB/s")
        llama_pending(wait=False)
        flush()
    llama_pending(wait=True)
    if not built():
        done = Path(args.build_done)
        why = "no time left" if not done.exists() else "build failed"
        log(f"== llama.cpp: {why}; tail of {args.build_log}:")
        try:
            log("\n".join(Path(args.build_log).read_text(errors="replace").splitlines()[-12:]))
        except OSError:
            pass
    for f in files.values():
        f.unlink(missing_ok=True)

    # 5. the table
    summary["rows"] = rows
    summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table(rows, out)
    log(f"== done in {summary['elapsed_s']} s")
    return 0


def SHAPES_ARCH(name: str) -> str:
    from tests.models.shapes import SHAPES

    return SHAPES[name]["arch"]


def cmd_aotx(args) -> int:
    if os.environ.get("GPU_BENCH_FAKE"):
        from tests.tools import gpu_fake_cupy

        gpu_fake_cupy.install()
    r = aotx_bench(Path(args.model), args.name, Path(args.home), float(args.budget))
    Path(args.json).write_text(json.dumps(r))
    return 0


def cmd_write(args) -> int:
    from tests.models import shapes

    kv = shapes.load_tokenizer(args.tokenizer)
    for name in args.models.split(","):
        p = shapes.write_shape(Path(args.out) / f"{name}.gguf", name, kv, arch=args.arch or None)
        print(p, p.stat().st_size)
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/gpu_bench")
    p.add_argument("--tokenizer", required=True, help="tokenizer JSON (tests/tools/gpu_bench_prep.sh makes it)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--deadline", type=float, default=560.0, help="seconds for everything")
    p.add_argument("--tests", type=int, default=1)
    p.add_argument("--llama-bin", default="/tmp/gpu_bench/llama.cpp/build/bin")
    p.add_argument("--build-done", default="/tmp/gpu_bench/llama-build.done")
    p.add_argument("--build-log", default="/tmp/gpu_bench/llama-build.log")
    p = sub.add_parser("aotx")
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--home", required=True)
    p.add_argument("--budget", default="20")
    p.add_argument("--json", required=True)
    p = sub.add_parser("write")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--arch", default="")
    args = ap.parse_args(argv)
    return {"run": cmd_run, "aotx": cmd_aotx, "write": cmd_write}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
