"""``aotx bench --engine-path``: the speeds a user meets, next to the model alone.

Owns: ``bench_engine_path`` (the speeds ``aotx run --json`` reports, ``prompt_tokens_per_s``
and ``decode_tokens_per_s`` of each reply's timings, from an engine built exactly as ``aotx
serve`` builds it: ``serve.build_engine``'s slots, context, prefill chunk, journal and
capsules, in a temporary AOTX_HOME), the llama.cpp peer run beside it (``--peer PYTHON``,
through ``tests/tools/llamacpp_peer.py`` in a source checkout) and the table of both.
Leaves the model-alone measurements, the prompts and the other benchmarks to ``bench.py``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from aotx.engine.cli.bench import TEXT, _Sink, bench_model


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_engine_path(model=None, device: str = "cpu", sizes=(128, 512, 1024), decode_tokens: int = 128,
                      repeats: int = 3) -> dict:
    """Per prompt size n: the median ``prompt_tokens_per_s`` of replies to raw prompts of
    about n tokens (each a different text, so no prompt reuses another's KV); decode: the
    median ``decode_tokens_per_s`` of 128-token greedy replies to a chat prompt, with
    speculative decoding off and at the engine's default ("auto"). The engine is
    ``serve.build_engine``'s, its tick loop on this thread as in ``aotx serve``; the client
    side runs on another thread, as sockets would. Also: CPU seconds of this process per
    token, and the engine's device / host time per tick."""
    import argparse
    import os

    from aotx.engine import protocol as P
    from aotx.engine.cli.serve import build_engine

    out: dict = {"prefill": {}, "decode": {}}
    with tempfile.TemporaryDirectory() as home:
        old_home = os.environ.get("AOTX_HOME")
        os.environ["AOTX_HOME"] = home
        try:
            args = argparse.Namespace(model=model, device=device, slots=None, context=None, memory_budget=None,
                                      mmproj="none", draft_model=None, speculative=None, draft_p_min=None)
            eng, store = build_engine(args)
        finally:
            if old_home is None:
                os.environ.pop("AOTX_HOME", None)
            else:
                os.environ["AOTX_HOME"] = old_home
        lm = eng.lm
        pool = lm.tokenizer.encode(TEXT)
        while len(pool) < max(sizes) * (repeats + 1):
            pool += pool
        box: dict = {}

        def reply(text: str, sp, raw: bool) -> tuple[dict, float, dict]:
            s = _Sink()
            s._journaled = True
            eng.post(P.CreateConversation(id=1, title="bench"), s)
            deadline = time.time() + 60
            while not s.events and time.time() < deadline:
                time.sleep(0.005)
            cid = s.events[0][1].conversation.conv_id
            s = _Sink()
            s._journaled = False            # done at Committed: the timings are in it
            st0, c0 = dict(eng.stats), _cpu_s()
            eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, sampling=sp, raw=raw), s)
            s.done.wait(600)
            cpu = _cpu_s() - c0
            done = next(m for _, m in s.events if isinstance(m, P.Committed))
            st1 = dict(eng.stats)
            ticks = max(1, st1["ticks"] - st0["ticks"])
            per_tick = {"tick_device_ms": round(1e3 * (st1["device_s"] - st0["device_s"]) / ticks, 3),
                        "tick_host_ms": round(1e3 * (st1["host_s"] - st0["host_s"]) / ticks, 3)}
            return done.timings, cpu, per_tick

        def drive() -> None:
            try:
                reply("Hi", P.SamplingParams(temperature=0.0, max_tokens=4), False)        # warm-up
                for si, n in enumerate(sizes):
                    rates, cpus, ttft = [], [], []
                    for r in range(repeats):
                        # a distinct first word: no slot's cached prefix matches (the text repeats)
                        text = f"Draft {si * repeats + r + 1}. " + lm.tokenizer.decode(pool[:n - 4])
                        t, cpu, _ = reply(text, P.SamplingParams(temperature=0.0, max_tokens=1), True)
                        rates.append(t["prompt_tokens_per_s"])
                        ttft.append(t["ttft_s"])
                        cpus.append(cpu / max(1.0, t["prompt_tokens"] - t["prompt_tokens_reused"]))
                    out["prefill"][n] = {"prompt_tokens_per_s": statistics.median(rates),
                                         "prompt_tokens": int(t["prompt_tokens"]),
                                         "prompt_tokens_reused": int(t["prompt_tokens_reused"]),
                                         "ttft_s": statistics.median(ttft),
                                         "cpu_ms_per_token": round(1e3 * statistics.median(cpus), 3)}
                for mode in ("off", "auto"):
                    rates, cpus, ticks = [], [], []
                    for _ in range(repeats):
                        sp = P.SamplingParams(temperature=0.0, max_tokens=decode_tokens, speculative=mode)
                        t, cpu, pt = reply("Tell me a long story about a dragon.", sp, False)
                        rates.append(t["decode_tokens_per_s"])
                        cpus.append(cpu / max(1.0, t["completion_tokens"]))
                        ticks.append(pt)
                    out["decode"][mode] = {"decode_tokens_per_s": statistics.median(rates),
                                           "completion_tokens": int(t["completion_tokens"]),
                                           "cpu_ms_per_token": round(1e3 * statistics.median(cpus), 3),
                                           **ticks[len(ticks) // 2]}
            except Exception as e:  # noqa: BLE001 - reported by the caller
                box["error"] = e
            finally:
                eng.request_stop()

        th = threading.Thread(target=drive, daemon=True)
        th.start()
        eng.run()
        th.join()
        store.close()
        if "error" in box:
            raise box["error"]
        out["config"] = {"slots": eng.n_slots, "n_ctx": eng.n_ctx, "prefill_chunk": eng.prefill_chunk,
                         "numerics": getattr(getattr(eng, "executor", eng), "numerics", "")}
        out["model_alone"] = bench_model(lm, sizes=sizes, decode_steps=decode_tokens, repeats=repeats)
    return out


def _peer_script() -> Path:
    from aotx import __file__ as root

    p = Path(root).resolve().parent / "tests" / "tools" / "llamacpp_peer.py"
    if not p.exists():
        from aotx.engine.errors import UsageError

        raise UsageError(f"--peer needs a source checkout of AOTX ({p} is missing)")
    return p


def run_peer(python: str, model_path: str, sizes, decode_tokens: int, repeats: int) -> dict:
    """llama.cpp on the same file through ``tests/tools/llamacpp_peer.py`` in ``python``
    (a virtualenv with llama-cpp-python): its JSON result."""
    import subprocess

    cmd = [python, str(_peer_script()), "--model", model_path, "--sizes", ",".join(map(str, sizes)),
           "--decode", str(decode_tokens), "--repeats", str(repeats), "--threads", str(_threads())]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        from aotx.engine.errors import UsageError

        raise UsageError(f"--peer {python}: no such Python") from None
    if res.returncode != 0:
        from aotx.engine.errors import UsageError

        raise UsageError(f"--peer {python}: the llama.cpp peer failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _threads() -> int:
    import numba

    return int(numba.get_num_threads())


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def run_engine_path(args, device: str) -> int:
    """``aotx bench --engine-path [--peer PYTHON]``: see the module docstring."""
    from aotx.engine.model.loader import resolve_model_path

    path = str(resolve_model_path(args.model))
    sizes = (128, 512) if args.quick else (128, 512, 1024)
    repeats = 1 if args.quick else 3
    dec = 32 if args.quick else 128
    peer = getattr(args, "peer", None)
    res: dict = {"device": device, "model": path}
    if peer:
        res["llama_cpp_before"] = run_peer(peer, path, sizes, dec, repeats)
    res["aotx"] = bench_engine_path(path, device, sizes, dec, repeats)
    if peer:
        res["llama_cpp_after"] = run_peer(peer, path, sizes, dec, repeats)
    if args.json:
        print(json.dumps(res))
        return 0
    a = res["aotx"]
    mo = a["model_alone"]
    cfg = a["config"]
    print(f"device {device}, model {Path(path).name}, {cfg['numerics']}; engine as aotx serve builds it: "
          f"{cfg['slots']} slots x {cfg['n_ctx']} tokens, prefill chunk {cfg['prefill_chunk']}, journal on")

    def peer_val(kind, key):
        vals = [res[k][kind].get(str(key), res[k][kind].get(key)) if kind == "prefill_tok_s" else res[k][kind]
                for k in ("llama_cpp_before", "llama_cpp_after") if k in res]
        vals = [v for v in vals if v]
        return statistics.mean(vals) if vals else None

    head = "measure                         engine path   model alone" + (
        "   llama.cpp   engine/llama.cpp" if peer else "")
    print(head)
    for n, r in a["prefill"].items():
        pv = peer_val("prefill_tok_s", n) if peer else None
        line = f"prefill {n:>5} tokens (tok/s)   {r['prompt_tokens_per_s']:>11.1f}   {mo['prefill_tok_s'][n]:>11.1f}"
        if peer:
            line += f"   {pv or 0:>9.1f}   {_ratio(r['prompt_tokens_per_s'], pv):>16}"
        print(line)
    for mode, r in a["decode"].items():
        pv = peer_val("decode_tok_s", None) if peer else None
        line = (f"decode, speculative {mode:<4} (tok/s) {r['decode_tokens_per_s']:>9.1f}   "
                f"{mo['decode_tok_s'] if mode == 'off' else float('nan'):>11.1f}")
        if peer:
            line += f"   {pv or 0:>9.1f}   {_ratio(r['decode_tokens_per_s'], pv):>16}"
        print(line)
    print("CPU ms per token, engine path: prefill " + ", ".join(
        f"{n}: {r['cpu_ms_per_token']}" for n, r in a["prefill"].items()) + "; decode " + ", ".join(
        f"{m}: {r['cpu_ms_per_token']} (tick device {r['tick_device_ms']} ms, host {r['tick_host_ms']} ms)"
        for m, r in a["decode"].items()))
    for key in ("llama_cpp_before", "llama_cpp_after"):
        if key in res:
            pr = res[key]
            print(f"CPU ms per token, llama.cpp ({key[10:]}): prefill " + ", ".join(
                f"{n}: {v}" for n, v in pr.get("prefill_cpu_ms_per_token", {}).items())
                + f"; decode {pr.get('decode_cpu_ms_per_token')} ({pr.get('threads')} threads)")
    return 0
