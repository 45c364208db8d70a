"""``aotx bench``: prefill and decode speed, in-process, as a table or JSON.

Measures, on the chosen device: prefill tokens/s at several prompt lengths (one
forward pass per prompt, median of repeats), batch-1 decode tokens/s (the model
alone, 128 greedy steps), and through the engine's tick loop: aggregate decode
tokens/s at several concurrent conversations, time to first token, per-tick
device and host time, with the journal off and on, and the durable-receipt
latency (commit to receipt) at 1 and 8 conversations.

``--engine-path`` (``bench_path.py``): the speeds a user meets, as ``aotx run --json`` reports them
(``prompt_tokens_per_s``, ``decode_tokens_per_s`` of each reply's timings), from an
engine built exactly as ``aotx serve`` builds it (``serve.build_engine``: its default
slots, context, prefill chunk, journal and capsules, in a temporary AOTX_HOME), next to
the model alone in the same process: where they differ is what the engine path costs.
With ``--peer PYTHON`` (a Python that has llama-cpp-python, e.g. /work/coord/llama-venv)
llama.cpp runs on the same file before and after AOTX, through
``tests/tools/llamacpp_peer.py`` (a source checkout), and the table gives the ratios.

Timings are wall-clock on this machine: compare ratios against a peer measured
in the same run (llama.cpp through ``tests/tools/llamacpp_peer.py`` and
``tests/tools/bench_llamacpp_*.py``), never absolute numbers across machines. A loaded
machine (other processes on the cores) distorts them: the engine-path section also
reports CPU seconds per token.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

TEXT = ("The river ran slow and brown past the mill, and the miller's children "
        "counted the barges as they went by, naming each one after a bird. ") * 60
PROMPTS = ["Tell me a long story about a dragon.", "Explain how a steam engine works, in detail.",
           "Write a long poem about the sea.", "Describe the history of Rome.",
           "Give me a recipe for bread and explain each step.", "What are the planets of the solar system?",
           "Write a story about a robot learning to paint.", "Explain photosynthesis to a child."]


def _median_rate(fn, n_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        rates.append(n_tokens / (time.perf_counter() - t))
    return statistics.median(rates)


def bench_model(lm, sizes=(128, 512, 1024), decode_steps=128, repeats=3) -> dict:
    """Prefill tokens/s per size and batch-1 decode tokens/s of the model alone."""
    from aotx.engine.model.batch import Segment

    pool = lm.tokenizer.encode(TEXT)
    while len(pool) < max(sizes):
        pool += pool
    kv = lm.model.new_kv_cache(1, max(max(sizes), 64 + decode_steps) + 8)
    m = lm.model
    m.forward(np.asarray(pool[:64], np.int32), [Segment(0, 0, 64)], kv)  # warm-up
    out = {"prefill_tok_s": {}, "decode_tok_s": 0.0}
    for n in sizes:
        ids = np.asarray(pool[:n], np.int32)
        out["prefill_tok_s"][n] = round(_median_rate(lambda: m.forward(ids, [Segment(0, 0, n)], kv), n, repeats), 1)

    prompt = np.asarray(lm.tokenizer.encode("<|im_start|>user\nTell me a long story.<|im_end|>\n"
                                            "<|im_start|>assistant\n", parse_special=True), np.int32)

    def decode():
        lg = m.forward(prompt, [Segment(0, 0, len(prompt))], kv)
        t0 = time.perf_counter()
        for i in range(decode_steps):
            tok = int(np.argmax(lg[0]))
            lg = m.forward(np.asarray([tok], np.int32), [Segment(0, len(prompt) + i, 1)], kv)
        return decode_steps / (time.perf_counter() - t0)

    out["decode_tok_s"] = round(statistics.median(decode() for _ in range(repeats)), 1)
    return out


class _Sink:
    def __init__(self):
        self.events = []
        self.done = threading.Event()
        self.tok_t: dict[int, float] = {}
        self.receipt_lat: list[float] = []
        self.final_seq = None

    def send(self, m):
        from aotx.engine import protocol as P

        now = time.perf_counter()
        self.events.append((now, m))
        if isinstance(m, P.Token):
            self.tok_t.setdefault(m.seq, now)
        elif isinstance(m, P.Durable):
            for s in [s for s in self.tok_t if s <= m.receipt.last_seq]:
                self.receipt_lat.append(now - self.tok_t.pop(s))
            if self.final_seq is not None and m.receipt.last_seq >= self.final_seq:
                self.done.set()
        elif isinstance(m, P.Committed):
            self.final_seq = m.seq
            if not self._journaled:
                self.done.set()
        elif isinstance(m, P.Error):
            self.done.set()


def bench_engine(lm, concurrency=(1, 2, 4, 8, 16), max_tokens=64, journal: bool = False, n_ctx=512) -> dict:
    """Aggregate decode tokens/s (all streams' tokens after their first, over the
    decode wall time), mean TTFT, per-tick device/host ms, receipt latency."""
    from aotx.engine import protocol as P
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in concurrency:
            store = open_store(Path(tmp) / f"j{k}" if journal else None)
            eng = Engine(lm, store, n_slots=max(k, 1), n_ctx=n_ctx, prefill_chunk=256)
            box: dict = {}

            def drive(eng=eng, k=k, box=box):
                """Client side, on a thread: the tick loop runs on this (the main) thread,
                as in ``aotx serve``."""
                try:
                    convs = []
                    for i in range(k):
                        s = _Sink()
                        s._journaled = journal
                        eng.post(P.CreateConversation(id=1, title=f"bench {i}"), s)
                        convs.append(s)
                    deadline = time.time() + 60
                    while any(not s.events for s in convs) and time.time() < deadline:
                        time.sleep(0.01)
                    ids = [s.events[0][1].conversation.conv_id for s in convs]
                    sinks = [_Sink() for _ in range(k)]
                    for s in sinks:
                        s._journaled = journal
                    box["st0"] = dict(eng.stats)
                    box["t0"] = time.perf_counter()
                    for i, (cid, s) in enumerate(zip(ids, sinks)):
                        sp = P.SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i)
                        eng.post(P.SubmitMessage(id=10 + i, conv_id=cid, text=PROMPTS[i % len(PROMPTS)],
                                                 sampling=sp), s)
                    for s in sinks:
                        s.done.wait(300)
                    box["t_end"] = time.perf_counter()
                    box["st1"] = dict(eng.stats)
                    box["sinks"] = sinks
                finally:
                    eng.request_stop()

            th = threading.Thread(target=drive, daemon=True)
            th.start()
            eng.run()
            th.join()
            store.close()
            sinks, t0, t_end, st0, st1 = box["sinks"], box["t0"], box["t_end"], box["st0"], box["st1"]
            toks = [[t for t, m in s.events if isinstance(m, P.Token)] for s in sinks]
            first = max(t[0] for t in toks if t)
            last = max(t[-1] for t in toks if t)
            n_after = sum(sum(1 for x in t if x > first) for t in toks)
            ticks = st1["ticks"] - st0["ticks"]
            lat = sorted(x for s in sinks for x in s.receipt_lat)
            results[k] = {
                "aggregate_decode_tok_s": round(n_after / max(1e-9, last - first), 1),
                "tokens": sum(len(t) for t in toks),
                "ttft_s_mean": round(statistics.mean(t[0] - t0 for t in toks if t), 4),
                "wall_s": round(t_end - t0, 3),
                "tick_device_ms": round(1e3 * (st1["device_s"] - st0["device_s"]) / max(1, ticks), 3),
                "tick_host_ms": round(1e3 * (st1["host_s"] - st0["host_s"]) / max(1, ticks), 3),
            }
            if journal and lat:
                results[k]["receipt_p50_ms"] = round(1e3 * lat[len(lat) // 2], 2)
                results[k]["receipt_p99_ms"] = round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2)
    return results


def bench_capsules(lm, sizes=(512, 2048), new_tokens: int = 16, chunk: int = 512) -> dict:
    """Per context size n: snapshot/restore seconds per home (host copy, disk write and
    read), and time to first token of a next turn of ``new_tokens`` through a restore
    versus a cold prefill of all n + new_tokens tokens (chunked like the engine)."""
    from aotx.engine.model.batch import Segment
    from aotx.engine.state import capsule as C

    pool = lm.tokenizer.encode(TEXT)
    while len(pool) < max(sizes) + new_tokens:
        pool += pool
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            kv = lm.model.new_kv_cache(2, n + new_tokens + 1)
            ids = pool[:n + new_tokens]

            def prefill(slot, start, stop):
                for a in range(start, stop, chunk):
                    b = min(stop, a + chunk)
                    lg = lm.model.forward(np.asarray(ids[a:b], np.int32), [Segment(slot, a, b - a)], kv)
                return lg

            t = time.perf_counter()
            prefill(0, 0, n + new_tokens)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            cap = C.snapshot(kv, 0, ids[:n], fingerprint=lm.fingerprint)
            snap = time.perf_counter() - t
            t = time.perf_counter()
            C.save(cap, Path(tmp) / f"{n}.caps")
            save = time.perf_counter() - t
            t = time.perf_counter()
            back = C.load(Path(tmp) / f"{n}.caps")
            load = time.perf_counter() - t
            t = time.perf_counter()
            C.restore(back, kv, 1, fingerprint=lm.fingerprint)
            restore = time.perf_counter() - t
            t = time.perf_counter()
            C.restore(cap, kv, 1, fingerprint=lm.fingerprint)
            prefill(1, n, n + new_tokens)
            warm = time.perf_counter() - t
            dev = {}
            try:
                t = time.perf_counter()
                dk, dv = kv.snapshot_slot(0, n, device=True)  # the device home: a copy beside the live KV
                dev["snapshot_device_s"] = round(time.perf_counter() - t, 5)
                t = time.perf_counter()
                kv.restore_slot(1, dk, dv, n)
                prefill(1, n, n + new_tokens)
                dev["ttft_restore_device_s"] = round(time.perf_counter() - t, 5)
                t = time.perf_counter()
                kv.restore_slot(1, dk, dv, n)
                dev["restore_device_s"] = round(time.perf_counter() - t, 5)
                dev["speedup_device"] = round(cold / dev["ttft_restore_device_s"], 1)
            except TypeError:
                pass  # the CPU cache has no device home
            out[n] = {**dev, "capsule_bytes": cap.nbytes, "snapshot_host_s": round(snap, 4), "save_disk_s": round(save, 4),
                      "load_disk_s": round(load, 4), "restore_s": round(restore, 4),
                      "ttft_cold_prefill_s": round(cold, 4), "ttft_restore_s": round(warm, 4),
                      "speedup": round(cold / warm, 1)}
    return out


CODE_SNIPPET = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, _, email = line.strip().partition(",")
            if name and email:
                users.append({"name": name, "email": email})
    return users


def main():
    settings = parse_config("app.cfg")
    users = load_users(settings.get("users", "users.csv"))
    for user in users:
        print(user["name"], user["email"])
"""

SPEC_TASKS = {
    "rewrite": "Rewrite this Python code, renaming the function load_users to read_users. Output the whole "
               "code.\n\n" + CODE_SNIPPET,
    "chat": "Tell me about the history of the bicycle.",
}


def dump_spec_prompts(path: str, model: str | None = None) -> None:
    """Write the speculative tasks' prompts as the token ids AOTX feeds the model (chat
    template applied) and the end-of-generation ids, as JSON, for the llama.cpp peer
    (``tests/tools/bench_llamacpp_lookup.py``)."""
    from aotx.engine.model.chat_template import encode_chat
    from aotx.engine.model.loader import load_model

    lm = load_model(model)
    tasks = {t: encode_chat(lm.tokenizer, lm.template, [{"role": "user", "content": text}])
             for t, text in SPEC_TASKS.items()}
    Path(path).write_text(json.dumps({"model": str(lm.path), "tasks": tasks, "eog": sorted(lm.tokenizer.eog_ids)}))


def _spec_once(lm, text: str, mode: str, max_tokens: int, draft_lm=None) -> dict:
    """One greedy reply through an engine whose tick loop runs on this (the main)
    thread, as in ``aotx serve``; the client side runs on a thread."""
    from aotx.engine import protocol as P
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=1, n_ctx=1024, speculative=mode, device=lm.backend,
                 draft_lm=draft_lm if mode == "draft" else None)
    box: dict = {}

    def drive() -> None:
        try:
            s = _Sink()
            s._journaled = False
            eng.post(P.CreateConversation(id=1, title="spec"), s)
            deadline = time.time() + 60
            while not s.events and time.time() < deadline:
                time.sleep(0.01)
            cid = s.events[0][1].conversation.conv_id
            s = _Sink()
            s._journaled = False
            eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text,
                                     sampling=P.SamplingParams(temperature=0.0, max_tokens=max_tokens)), s)
            s.done.wait(600)
            box["sink"] = s
        finally:
            eng.request_stop()

    th = threading.Thread(target=drive, daemon=True)
    th.start()
    eng.run()
    th.join()
    events = box["sink"].events
    done = next(m for _, m in events if isinstance(m, P.Committed))
    ids = [m.token_id for _, m in events if isinstance(m, P.Token)]
    ticks = sorted({m.tick for _, m in events if isinstance(m, P.Token)})
    t = done.timings
    drafted, accepted = int(t.get("draft_tokens", 0)), int(t.get("draft_accepted", 0))
    # decode ticks after the first token's tick; each is one verify pass (or a plain step)
    passes = max(1, len(ticks) - 1)
    return {"decode_tok_s": t["decode_tokens_per_s"], "tokens": len(ids), "draft_tokens": drafted,
            "accepted": accepted, "acceptance_rate": round(accepted / max(1, drafted), 3),
            "accepted_per_pass": round(accepted / passes, 2),
            "tokens_per_pass": round((len(ids) - 1) / passes, 2), "ids": ids}


def bench_speculative(lm, max_tokens: int = 160, draft_lm=None, repeats: int = 1) -> dict:
    """Greedy decode tokens/s with speculation off, prompt lookup (ngram) and, given
    ``draft_lm``, a draft model; acceptance rate (accepted / proposed drafts), mean
    accepted drafts and tokens per verify pass (per decode tick), on a repetitive task
    (rewrite a ~300-token code snippet with one change) and on free chat; checks the
    outputs are identical to plain greedy. Modes alternate within each repeat; the
    reported tok/s is the median over repeats."""
    modes = ("off", "auto", "ngram") + (("draft",) if draft_lm is not None else ())
    out = {}
    for task, text in SPEC_TASKS.items():
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in modes:
                runs[mode].append(_spec_once(lm, text, mode, max_tokens, draft_lm))
        res = {}
        base = statistics.median(r["decode_tok_s"] for r in runs["off"])
        for mode in modes:
            r = dict(runs[mode][-1])
            r["decode_tok_s"] = round(statistics.median(x["decode_tok_s"] for x in runs[mode]), 2)
            r["speedup"] = round(r["decode_tok_s"] / max(1e-9, base), 2)
            r["identical"] = all(x["ids"] == runs["off"][0]["ids"] for x in runs[mode])
            del r["ids"]
            res[mode] = r
        out[task] = res
    return out


def run_bench(args) -> int:
    from aotx.engine.model.loader import load_model
    from aotx.engine.cli.serve import pick_device

    device = pick_device(args.device)
    lm = load_model(args.model, device=device, tune="auto")
    if getattr(args, "speculative", False):
        # the draft model: --draft-model, else the model itself loaded a second time (its own
        # weights and KV): that shows acceptance (~100%), not speed
        draft_lm = load_model(args.draft_model or lm.path, device=device)
        from aotx.engine.runtime.drafter import DraftModel

        DraftModel.check_vocabulary(lm, draft_lm)
        res = bench_speculative(lm, draft_lm=draft_lm, repeats=1 if args.quick else 3)
        if args.json:
            print(json.dumps({"device": device, "model": lm.name, "draft_model": draft_lm.name,
                              "speculative": res}))
        else:
            print(f"device {device}, model {lm.name}, draft model {draft_lm.name}; greedy, 160 tokens")
            print("task      mode    tok/s  speed-up  acceptance  accepted/pass  tokens/pass  identical")
            for task, modes in res.items():
                for mode, r in modes.items():
                    print(f"{task:<8}  {mode:<5}  {r['decode_tok_s']:>7.1f}  {r['speedup']:>7.2f}x  "
                          f"{r['acceptance_rate']:>10.3f}  {r['accepted_per_pass']:>13.2f}  "
                          f"{r['tokens_per_pass']:>11.2f}  {r['identical']}")
        return 0
    if getattr(args, "capsules", None):
        sizes = tuple(int(x) for x in args.capsules.split(",") if x)
        if max(sizes) + 64 > lm.config.n_ctx_train:
            from aotx.engine.errors import UsageError

            raise UsageError(f"--capsules {max(sizes)}: {lm.name} has a context of {lm.config.n_ctx_train} tokens; "
                             f"a size needs 64 more for the next turn (at most {lm.config.n_ctx_train - 64})")
        res = bench_capsules(lm, sizes)
        if args.json:
            print(json.dumps({"device": device, "model": lm.name, "capsules": res}))
        else:
            print("context  capsule MiB  snapshot ms  save ms  load ms  restore ms  TTFT cold s  TTFT restore s  speed-up")
            for n, r in res.items():
                print(f"{n:>7}  {r['capsule_bytes'] / 2**20:>11.1f}  {1e3 * r['snapshot_host_s']:>11.1f}  "
                      f"{1e3 * r['save_disk_s']:>7.1f}  {1e3 * r['load_disk_s']:>7.1f}  {1e3 * r['restore_s']:>10.1f}"
                      f"  {r['ttft_cold_prefill_s']:>11.3f}  {r['ttft_restore_s']:>14.4f}  {r['speedup']:>7.1f}x")
                if "restore_device_s" in r:
                    print(f"         device home: snapshot {1e3 * r['snapshot_device_s']:.2f} ms, restore "
                          f"{1e3 * r['restore_device_s']:.2f} ms, TTFT via restore {r['ttft_restore_device_s']:.4f} s"
                          f" ({r['speedup_device']:.1f}x vs cold)")
        return 0
    conc = tuple(int(x) for x in args.concurrency.split(",") if x)
    sizes = (128, 512) if args.quick else (128, 512, 1024)
    if device == "cuda":
        sizes = sizes + (2048,)
    out = {"device": device, "model": lm.name, "load_profile_s": lm.profile, "load_notes": lm.notes,
           "model_only": bench_model(lm, sizes=sizes, repeats=1 if args.quick else 3,
                                     decode_steps=32 if args.quick else 128)}
    out["engine_journal_off"] = bench_engine(lm, conc, max_tokens=32 if args.quick else 64, journal=False)
    jconc = tuple(c for c in (1, 8) if c in conc) or conc[:1]
    out["engine_journal_on"] = bench_engine(lm, jconc, max_tokens=32 if args.quick else 64, journal=True)
    if args.json:
        print(json.dumps(out))
        return 0
    mo = out["model_only"]
    print(f"device {device}, model {lm.name}")
    for n, r in mo["prefill_tok_s"].items():
        print(f"prefill {n:>5} tokens: {r:9.1f} tok/s")
    print(f"decode batch 1     : {mo['decode_tok_s']:9.1f} tok/s (model alone, greedy)")
    print("concurrent  aggregate tok/s  TTFT s  tick device ms  tick host ms   (engine, journal off)")
    for k, r in out["engine_journal_off"].items():
        print(f"{k:>10}  {r['aggregate_decode_tok_s']:>15.1f}  {r['ttft_s_mean']:>6.3f}  {r['tick_device_ms']:>14.2f}"
              f"  {r['tick_host_ms']:>12.2f}")
    for k, r in out["engine_journal_on"].items():
        off = out["engine_journal_off"].get(k, {}).get("aggregate_decode_tok_s")
        ratio = f"  on/off {r['aggregate_decode_tok_s'] / off:.3f}" if off else ""
        print(f"journal on, {k} conv: {r['aggregate_decode_tok_s']:.1f} tok/s{ratio}, receipt p50 "
              f"{r.get('receipt_p50_ms', 0)} ms, p99 {r.get('receipt_p99_ms', 0)} ms")
    return 0
