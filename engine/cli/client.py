"""Commands that talk to the engine over its socket: run, status, stop, conversations.

Owns: turning protocol events into terminal output (text, or one JSON object
per line with ``--json``), and Ctrl-C into a cancel. ``aotx run`` starts an
engine in the background when none answers, and says so on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import msgspec

from aotx.engine.errors import AotxError, EngineError, ErrorCode, UsageError
from aotx.engine.units import parse_size, plural, short_title
from aotx.engine import protocol as P
from aotx.engine.ipc.client import CancelOnSignal, ConnectionLost, EngineClient, model_ref
from aotx.media.kinds import kind_of_name


def engine_args(args) -> list[str]:
    """The ``serve`` flags to pass on when a client has to start an engine."""
    out: list[str] = []
    for flag, attr in (("--model", "model"), ("--device", "device"), ("--slots", "slots"),
                       ("--context", "context"), ("--memory-budget", "memory_budget"),
                       ("--draft-model", "draft_model"), ("--mmproj", "mmproj"), ("--keep-alive", "keep_alive"),
                       ("--kv-type", "kv_type"), ("--expert-cache", "expert_cache"),
                       ("--context-policy", "context_policy")):
        v = getattr(args, attr, None)
        if attr == "model" and v is not None and not _is_model_file(v):
            continue  # a remote entry, or a name the engine's catalog resolves: loaded beside the default
        if v is not None and not (attr == "device" and v == "auto"):
            out += [flag, str(v)]
    if getattr(args, "evict_idle", False):
        out.append("--evict-idle")
    return out


def _is_model_file(arg: str) -> bool:
    from aotx.engine.errors import ModelError
    from aotx.engine.model.loader import resolve_model_path

    try:
        resolve_model_path(arg)
        return True
    except ModelError:
        return False


_ENGINE_ONLY = ("device", "slots", "context", "kv_type", "memory_budget", "mmproj", "keep_alive", "expert_cache",
                "evict_idle")


def ignored_engine_flags(args, st: P.StatusReply) -> list[str]:
    """The engine flags in ``args`` that a running engine (its ``status``) does not have:
    ``--slots 4 (it has 2)``. They only apply when an engine starts, so a client that
    reuses one says so instead of ignoring them silently. A flag the engine does not
    report (``--mmproj``, ``--keep-alive``, ...) is named without the engine's value."""
    out: list[str] = []
    device = getattr(args, "device", None)
    if device not in (None, "auto") and device != st.device:
        out.append(f"--device {device} (it runs on the {st.device})")
    slots = getattr(args, "slots", None)
    if slots is not None and st.n_slots and slots != st.n_slots:
        out.append(f"--slots {slots} (it has {st.n_slots})")
    elif slots is not None and not st.n_slots:
        out.append(f"--slots {slots}")
    context = getattr(args, "context", None)
    if context is not None and context != st.n_ctx:
        out.append(f"--context {context} (it has {st.n_ctx} tokens per slot)")
    kv_type = getattr(args, "kv_type", None)
    if kv_type is not None and kv_type != st.kv_type:
        out.append(f"--kv-type {kv_type} (it has {st.kv_type})" if st.kv_type else f"--kv-type {kv_type}")
    budget = getattr(args, "memory_budget", None)
    if budget is not None:
        try:
            same = parse_size(budget) == st.budget_bytes
        except ValueError:
            same = False
        if not same:
            from aotx.engine.units import fmt_bytes

            out.append(f"--memory-budget {budget} (it has {fmt_bytes(st.budget_bytes)})")
    for flag, attr in (("--mmproj", "mmproj"), ("--keep-alive", "keep_alive"), ("--expert-cache", "expert_cache")):
        v = getattr(args, attr, None)
        if v is not None:
            out.append(f"{flag} {v}")
    if getattr(args, "evict_idle", False):
        out.append("--evict-idle")
    return out


def check_engine_flags(args) -> None:
    """The engine flags a client can check itself, checked before it connects: one line
    and exit 2 whether an engine runs (it would ignore them) or would be started (it would
    exit with the reason after a 'started an engine' line). Raises UsageError."""
    from aotx.engine.units import parse_duration

    budget = getattr(args, "memory_budget", None)
    if budget is not None:
        try:
            parse_size(budget)
        except ValueError:
            raise UsageError(f"--memory-budget: cannot read {budget!r} as a size (e.g. 4G, 512M)") from None
    keep = getattr(args, "keep_alive", None)
    if keep is not None:
        try:
            parse_duration(keep)
        except ValueError:
            raise UsageError(f"--keep-alive: cannot read {keep!r} as a duration (e.g. 5m, 30s, 1h; 0: never "
                             f"unload)") from None
    mmproj = getattr(args, "mmproj", None)
    if mmproj and mmproj != "none" and not Path(mmproj).expanduser().is_file():
        raise UsageError(f"--mmproj {mmproj}: no such file (the vision projector GGUF, e.g. mmproj-model-f16.gguf)")


class StartupLine:
    """What a starting engine says, on stderr: at a terminal one line redrawn in place (its
    stage, a progress bar while a first start compiles kernels), else a line per change."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.open = False

    def __call__(self, p: dict) -> None:
        from aotx.engine.present.format import startup_text

        text = f"aotx: starting the engine: {startup_text(p)}"
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + text)
            sys.stderr.flush()
            self.open = True
        else:
            print(text, file=sys.stderr)

    def end(self) -> None:
        if self.open:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
            self.open = False


async def connect(args, *, spawn: bool = True) -> EngineClient:
    check_engine_flags(args)
    spawned: list[str] = []
    line = StartupLine()

    def notice(msg: str) -> None:
        spawned.append(msg)
        line.end()
        print(f"aotx: {msg}", file=sys.stderr)

    sock = getattr(args, "socket", None)
    draft = getattr(args, "draft_model", None)
    client = None
    if draft:  # refuse a mismatched draft model before starting an engine with it
        from aotx.engine.model.vocabulary import check_vocabulary_files

        if not getattr(args, "model", None):  # a running engine's model is the one meant
            try:
                client = await EngineClient.connect(sock, spawn=False, client_name="aotx-cli")
            except EngineError:
                client = None
        if client is None:
            check_vocabulary_files(getattr(args, "model", None), draft)
    if client is None and spawn and getattr(args, "device", None) == "cuda":
        # an engine this command would start must run on the GPU: refuse here, in one line,
        # rather than start one that exits with the reason in its log
        try:
            client = await EngineClient.connect(sock, spawn=False, client_name="aotx-cli")
        except EngineError:
            from aotx.engine.backend.device import pick_device

            pick_device("cuda")  # raises UsageError when it cannot run
    if client is None:
        try:
            client = await EngineClient.connect(sock, spawn=spawn, engine_args=engine_args(args),
                                                client_name="aotx-cli", on_spawn=notice, on_progress=line)
        finally:
            line.end()
    client.spawned = bool(spawned)  # this command started the engine (and waited for its load)
    if not spawned:  # a running engine keeps the settings it was started with: say which flags it ignores
        st = await client.status() if any(getattr(args, a, None) not in (None, False, "auto")
                                          for a in _ENGINE_ONLY) else None
        if st is not None and getattr(args, "device", None) == "cuda" and st.device != "cuda":
            await client.close()  # the GPU was asked for and this engine cannot give it: refuse
            raise UsageError(f"--device cuda: the running engine on {client.socket_path} runs on the {st.device}; "
                             f"engine flags apply when an engine starts (`aotx stop` first)")
        budget = getattr(args, "memory_budget", None)
        if budget is not None:  # a malformed size is a usage error, not a warning
            try:
                parse_size(budget)
            except ValueError:
                await client.close()
                raise UsageError(f"--memory-budget: cannot read {budget!r} as a size (e.g. 4G, 512M)") from None
        ignored = ignored_engine_flags(args, st) if st is not None else []
        if ignored:
            print(f"aotx: the running engine on {client.socket_path} ignores {', '.join(ignored)}: engine flags "
                  f"apply when an engine starts (`aotx stop` first)", file=sys.stderr)
    # --model names the model a command runs on: a running engine with another default
    # loads it beside its own (no restart); see _run
    if draft:
        from aotx.engine.model.loader import resolve_model_path

        want = resolve_model_path(draft).stem
        if client.welcome.draft_model != want:
            has = f"draft model {client.welcome.draft_model}" if client.welcome.draft_model else "no draft model"
            await client.close()
            raise UsageError(f"the engine on {client.socket_path} has {has}, not {want}; stop it with `aotx stop` "
                             f"or pass another --socket")
    return client


async def reconnect(args, engine_args: list[str]) -> EngineClient:
    """Reach the engine again after it went away (``aotx stop``, a crash): when none answers,
    start one with ``engine_args``, the flags of the engine that went away (its Welcome's),
    not this command's."""
    def notice(msg: str) -> None:
        print(f"aotx: {msg}", file=sys.stderr)

    line = StartupLine()
    try:
        client = await EngineClient.connect(getattr(args, "socket", None), spawn=True, engine_args=engine_args,
                                            client_name="aotx-cli", on_spawn=notice, on_progress=line)
    finally:
        line.end()
    client.spawned = True
    return client


def dispatch(args, **kw) -> int:
    cmd = args.cmd
    if cmd == "run":
        return asyncio.run(_run(args))
    if cmd == "stop":
        return _stop(args)
    if cmd == "conversations":
        return asyncio.run(_conversations(args, **kw))
    raise UsageError(f"unknown command {cmd}")


def capsule_words(n: P.Notice, continuing: bool) -> str:
    """A capsule notice on stderr, in the user's words and only when it helps: when an
    earlier conversation is continued (``--conversation``); a new one's shared start is
    no news. ``--json`` keeps the engine's own notice."""
    if not continuing or not n.message:
        return ""
    if n.message.startswith(("restored", "picked up")):
        return "picked up where this conversation left off"
    return "reading the earlier messages again (their saved state could not be used)"


def read_stdin_text(what: str) -> str:
    """All of standard input as text; ``UsageError`` naming ``what`` and the first bad byte
    when it is not UTF-8."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"run: standard input ({what}) is not valid UTF-8 (byte 0x{data[e.start]:02x} at byte "
                         f"{e.start}); give the text in UTF-8") from None


def _jprint(obj) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


PROMPT_FRAME_SLACK = 64 << 10  # bytes of a message frame that are not its prompt (ids, sampling, stops)


async def _run(args) -> int:
    prompt = read_stdin_text("the prompt") if args.prompt in ("-", None) else args.prompt
    if not prompt.strip():  # the CLI prints "aotx: " before it: no second prefix
        raise UsageError("run: the prompt is empty" if not prompt else "run: the prompt is blank (only whitespace)")
    size = len(prompt.encode())
    if size > P.MAX_FRAME - PROMPT_FRAME_SLACK:  # refused before a conversation is created for it
        raise UsageError(f"run: the prompt is {size:,} bytes; the engine takes at most {P.MAX_FRAME >> 20} MiB in "
                         "one message")
    t0 = time.perf_counter()
    from aotx.engine.model.loader import check_model_arg

    check_model_arg(args.model)  # a missing or non-GGUF file: refused before an engine or a conversation
    client = await connect(args)
    stopper = None
    watch = None  # says, once, that the receipt waits for a full disk
    try:
        st = await client.status()
        if args.profile:
            print(json.dumps({"stages_s": st.profile, "total_s": round(sum(st.profile.values()), 4),
                              "model": st.model, "device": st.device, "notes": st.notes}),
                  file=sys.stderr if args.json else sys.stdout)
        attachments = []
        for a in args.attach:
            p = Path(a).expanduser()
            if not p.is_file():
                raise UsageError(f"--attach {a}: no such file")
            kind = kind_of_name(p)  # None: the engine tells the kind from the content
            attachments.append(P.Attachment(path=str(p.resolve()), kind=kind.value if kind else "", name=p.name))
        sampling = P.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
                                    max_tokens=args.max_tokens, stop=list(args.stop),
                                    speculative=args.speculative)
        created = False
        policy = getattr(args, "context_policy", None) or ""   # the conversation's own (else the engine's)
        if args.conversation:
            conv_id = args.conversation
            if args.system is not None:
                await client.update(conv_id, system_prompt=args.system)
            if policy:
                await client.set_context(conv_id, policy)
        else:
            title = short_title(prompt)
            conv = await client.create_conversation(title=title, system_prompt=args.system,
                                                    model=model_ref(args.model), origin="run",
                                                    context=policy)
            conv_id = conv.conv_id
            created = True
        rid_box: list[int] = []
        # load_s: the model loading this request waited for (the engine's start when this
        # command started it, a model loaded beside the default for it), 0 when loaded already
        load_s = round(sum(st.profile.values()), 4) if getattr(client, "spawned", False) else 0.0
        t_loading = 0.0
        stopper = CancelOnSignal(asyncio.get_running_loop(), lambda rid: client.cancel(target=rid))
        stopper.__enter__()
        main = asyncio.current_task()
        code = 0
        prompt_ids: list[int] = []
        completion: list[int] = []
        refused = ""
        cuts: list[dict] = []    # where the prompt left earlier messages out (context notices)
        engine_stopping = False   # the engine said it is stopping: a cancelled finish is its, not Ctrl-C's
        try:
            async for ev in client.submit(conv_id, prompt, attachments=attachments, sampling=sampling, raw=args.raw,
                                          model=model_ref(args.model)):
                if isinstance(ev, P.Accepted):
                    rid_box.append(ev.id)
                    stopper.accepted(ev.id)
                    if t_loading:
                        load_s = round(load_s + time.perf_counter() - t_loading, 4)
                    prompt_ids = list(ev.prompt_ids)
                    if args.json:
                        _jprint({"event": "accepted", "conversation": ev.conv_id, "msg_id": ev.msg_id,
                                 "reply_id": ev.reply_id, "seq": ev.seq, "tick": ev.tick})
                elif isinstance(ev, P.Token):
                    completion.append(ev.token_id)
                    if args.json:
                        _jprint({"event": "token", "id": ev.token_id, "text": ev.text, "pos": ev.pos, "tick": ev.tick,
                                 "seq": ev.seq})
                    elif ev.text:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                elif isinstance(ev, P.MediaInfo):
                    if args.json:
                        _jprint({"event": "media", "kind": ev.kind, "route": ev.route, "name": ev.name, "text": ev.text,
                                 "via": ev.via, "seconds": ev.seconds, **({"error": ev.error} if ev.error else {})})
                    elif ev.error:
                        pass  # the Error that refuses the message names it and why: said once, there
                    elif ev.route == "encoder":
                        print(f"aotx: {ev.name} -> vision encoder {ev.via}: the model sees the picture",
                              file=sys.stderr)
                    else:
                        what = "transcript" if ev.kind == "audio" else \
                            "text read by OCR (the model sees text, not the picture)"
                        print(f"aotx: {ev.name} -> {ev.via}: {what}:\n{ev.text}\n", file=sys.stderr)
                elif isinstance(ev, P.Durable):
                    if args.json:
                        _jprint({"event": "durable", "receipt": {"segment": ev.receipt.segment,
                                                                 "offset": ev.receipt.offset,
                                                                 "last_seq": ev.receipt.last_seq},
                                 **({"msg_id": ev.msg_id} if ev.msg_id else {})})
                elif isinstance(ev, P.Notice):
                    engine_stopping = engine_stopping or ev.kind == "stopping"
                    if ev.cut is not None:
                        cuts.append(msgspec.to_builtins(ev.cut))
                    if ev.kind == "model" and ev.message.startswith("loading model") and not rid_box:
                        t_loading = time.perf_counter()
                    if args.json:
                        _jprint({"event": "notice", "kind": ev.kind, "resource": ev.resource, "message": ev.message,
                                 "asked": ev.asked, "free": ev.free, "position": ev.position,
                                 **({"cut": msgspec.to_builtins(ev.cut)} if ev.cut is not None else {})})
                    elif ev.kind == "capsule":
                        words = capsule_words(ev, continuing=bool(args.conversation))
                        if words:
                            print(f"aotx: {words}", file=sys.stderr)
                    elif ev.kind == "refused":
                        refused = ev.message      # the refusal's longer sentence: said with the error, once
                    else:
                        print(f"aotx: {ev.message}", file=sys.stderr)
                elif isinstance(ev, P.Error):
                    if args.json:
                        _jprint({"event": "error", "code": ev.code, "message": ev.message})
                    else:
                        line = refused or ev.message
                        if ev.code == ErrorCode.TOO_LONG and args.conversation:
                            line += (f"; start a new conversation, or fork this one at an earlier message "
                                     f"(aotx conversations fork {args.conversation} --at MSG_ID)")
                        print(f"aotx: {line}", file=sys.stderr)
                    code = 2
                    if created and not rid_box:  # refused before it began (a model the engine cannot load):
                        created = False           # the new conversation would stay behind empty
                        try:
                            await client.delete(conv_id)
                        except AotxError:
                            pass
                elif isinstance(ev, P.Committed):
                    t = ev.timings
                    if args.json:
                        _jprint({"event": "done", "conversation": conv_id, "prompt_ids": prompt_ids,
                                 "completion_ids": completion, "text": ev.text, "finish_reason": ev.finish_reason,
                                 "numerics": ev.numerics, **({"context": cuts} if cuts else {}),
                                 "timings": {"load_s": load_s,
                                             "engine_load_s": round(sum(st.profile.values()), 4),
                                             "prompt_tokens": int(t.get("prompt_tokens", 0)),
                                             "prompt_tokens_reused": int(t.get("prompt_tokens_reused", 0)),
                                             "prompt_tokens_per_s": t.get("prompt_tokens_per_s", 0.0),
                                             "ttft_s": t.get("ttft_s", 0.0),
                                             "completion_tokens": int(t.get("completion_tokens", 0)),
                                             "decode_tokens_per_s": t.get("decode_tokens_per_s", 0.0),
                                             "wall_s": round(time.perf_counter() - t0, 4)}})
                    else:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        if ev.finish_reason == "cancelled":
                            code = stopper.exit_code or (1 if engine_stopping else 130)
                            if engine_stopping:
                                print(f"aotx: `aotx run --conversation {conv_id} ...` continues it once an engine runs "
                                      f"again", file=sys.stderr)
                    welcome = getattr(client, "welcome", None)
                    if welcome is not None and welcome.journal:  # what is left is the receipt: a signal ends the wait
                        if stopper.signum:
                            _stopped_waiting(stopper, conv_id)
                            break
                        stopper.waiting_for_receipt(main.cancel)
                        watch = asyncio.create_task(_say_when_held(client))
        except asyncio.CancelledError:
            if not stopper.stopped_waiting:
                raise
            main.uncancel()
            _stopped_waiting(stopper, conv_id)
        except ConnectionLost:
            if not rid_box:
                raise
            # the engine went away mid-reply (a crash, kill -9): say what is kept and how to go on
            if not args.json:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"aotx: the engine went away in the middle of the reply (it crashed or was killed); the reply is "
                  f"kept up to its last durable token. `aotx run --conversation {conv_id} ...` continues the "
                  f"conversation (it starts an engine)", file=sys.stderr)
            return 1
        return stopper.exit_code or code
    finally:
        if watch is not None:
            watch.cancel()
        if stopper is not None:
            stopper.__exit__()
        await client.close()


RECEIPT_PATIENCE_S = 1.0  # a receipt later than this after the reply's end: ask the engine why


async def _say_when_held(client) -> None:
    """After the reply's end, while its receipt does not come: when the engine holds its
    work for a full disk, say so once on stderr (the engine's own line: which disk, how
    much it needs, how much is free)."""
    try:
        while True:
            await asyncio.sleep(RECEIPT_PATIENCE_S)
            st = await client.status()
            if st.degraded:
                print(f"aotx: the reply is complete but not yet durable: {st.degraded}; waiting for its receipt "
                      "(Ctrl-C or kill stops waiting: the engine keeps the reply and writes it when space returns)",
                      file=sys.stderr, flush=True)
                return
    except (AotxError, ConnectionLost, OSError):
        return


def _stopped_waiting(stopper, conv_id: str) -> None:
    print(f"aotx: stopped waiting for the reply's receipt ({signal.Signals(stopper.signum).name}): the reply is "
          f"complete in the engine but not yet durable; the engine writes it when it can (`aotx conversations "
          f"show {conv_id}` says when it is)", file=sys.stderr, flush=True)


def _stop(args) -> int:
    from aotx.engine import paths

    sock = Path(args.socket).expanduser() if args.socket else paths.socket_path()
    lock = Path(str(sock) + ".lock")
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        pid = 0
    if pid <= 0:
        raise EngineError(f"no engine is serving {sock}")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise EngineError(f"no engine is serving {sock} (pid {pid} is gone)") from None
    for _ in range(100):
        time.sleep(0.05)
        if _exited(pid):
            print(f"stopped the engine (pid {pid})")
            return 0
    print(f"asked the engine (pid {pid}) to stop; it is still shutting down")
    return 0


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent (aotx-chat, the
    gateway) has not reaped yet, which signal 0 still reaches."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("Z", "X")


async def fetch_conversations(args, conv_id: str | None = None):
    """The running engine's conversations (``conv_id``: that one, with its messages).
    Starts no engine: this is asked only while one holds the journal."""
    client = await connect(args, spawn=False)
    try:
        return await client.list_conversations() if conv_id is None else await client.show(conv_id)
    finally:
        await client.close()


async def _conversations(args, fork_title=None) -> int:
    """``aotx conversations fork``: the engine copies the messages and reuses the state;
    ``delete``: the engine journals the deletion (list, show and export read the journal:
    ``cli_local.cmd_conversations``).
    ``fork_title(parent title, existing titles)`` names the fork (the CLI passes
    aotx-chat's rule, so both name forks alike; None keeps the engine's title)."""
    client = await connect(args, spawn=True)
    if args.ccmd == "delete":
        try:
            view = await client.show(args.id)
            await client.delete(args.id)
        finally:
            await client.close()
        if args.json:
            _jprint({"id": args.id, "deleted": True, "title": view.title})
        else:
            print(f"deleted {args.id}  “{view.title}” ({plural(len(view.messages), 'message')}); its text leaves the disk "
                  f"at `aotx journal compact` (with the engine stopped)")
        return 0
    try:
        parent = await client.show(args.id)
        conv = await client.fork(args.id, args.at)
        if fork_title is not None:
            title = fork_title(parent.title, [c.title for c in await client.list_conversations()])
            await client.rename(conv.conv_id, title)
            conv.title = title
    finally:
        await client.close()
    if args.json:
        _jprint({"id": conv.conv_id, "title": conv.title, "messages": conv.n_messages, "parent": args.id})
    else:
        n = f"{conv.n_messages} message{'' if conv.n_messages == 1 else 's'}"
        print(f"{conv.conv_id}  “{conv.title}”, forked from {args.id} with {n}; continue "
              f"it with `aotx run --conversation {conv.conv_id} ...`")
    return 0
