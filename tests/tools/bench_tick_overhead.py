"""The runtime's own cost per tick: the engine loop around a model whose forward is nearly free.

Run: python tests/tools/bench_tick_overhead.py [--conversations 1,8] [--tokens 160] [--repeats 3]

A tiny random-weight llama (``tests/models/llama.py``: d_model 64, 2 layers, 300-token
vocabulary) makes the device time of a tick small, so what is left of a tick is the
runtime's: planning, laying out segments, sampling on the host, detokenizing, stop
checks, records and events. For each number of concurrent conversations (journal off,
greedy, raw prompts, no speculation) it prints JSON: host microseconds per tick and per
token and device microseconds per tick (the engine's own ``stats``, wall clock), and the
process's CPU microseconds per token (``time.process_time``, every thread: with
NUMBA_NUM_THREADS=1 the least disturbed by other load); median of the repeats. Run it under two trees with the same Python (PYTHONPATH picks the tree) to
compare them side by side; absolute numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def _tiny_gguf():
    """``tests/models/llama.py`` of the tree this file is in (loaded by path: the tree
    under measurement may be another one, on PYTHONPATH)."""
    path = Path(__file__).resolve().parents[1] / "models" / "llama.py"
    spec = importlib.util.spec_from_file_location("bench_tiny_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Sink:
    def __init__(self, final):
        self.events, self.done, self._final = [], threading.Event(), final

    def send(self, m):
        self.events.append(m)
        if isinstance(m, self._final):
            self.done.set()


def run_once(lm, k: int, tokens: int) -> dict:
    from aotx.engine import protocol as P
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    final = (P.Committed, P.Error, P.ConversationInfo)
    eng = Engine(lm, open_store(None), n_slots=k, n_ctx=512, prefill_chunk=256, speculative="off")
    eng.start()
    try:
        convs = []
        for i in range(k):
            s = _Sink(final)
            eng.post(P.CreateConversation(id=1, title=f"c{i}"), s)
            assert s.done.wait(30)
            convs.append(s.events[0].conversation.conv_id)
        st0, c0 = dict(eng.stats), time.process_time()
        sinks = []
        for i, cid in enumerate(convs):
            s = _Sink(final)
            eng.post(P.SubmitMessage(id=2, conv_id=cid, text=f"a b c d e f {i} g h i j k", raw=True,
                                     sampling=P.SamplingParams(temperature=0.0, max_tokens=tokens)), s)
            sinks.append(s)
        for s in sinks:
            assert s.done.wait(600)
        st1, c1 = dict(eng.stats), time.process_time()
    finally:
        eng.stop()
    ticks = max(1, st1["ticks"] - st0["ticks"])
    n_tok = max(1, st1["tokens"] - st0["tokens"])
    host = st1["host_s"] - st0["host_s"]
    return {"host_us_per_tick": 1e6 * host / ticks, "host_us_per_token": 1e6 * host / n_tok,
            "device_us_per_tick": 1e6 * (st1["device_s"] - st0["device_s"]) / ticks,
            "cpu_us_per_token": 1e6 * (c1 - c0) / n_tok, "ticks": ticks, "tokens": n_tok}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", default="1,8")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from aotx.engine.model.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        lm = load_model(_tiny_gguf().write_tiny_llama(Path(tmp) / "t.gguf", seed=3, context_length=512))
    out = {}
    for k in (int(x) for x in args.conversations.split(",")):
        runs = [run_once(lm, k, args.tokens) for _ in range(args.repeats)]
        out[k] = {key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
