"""``aotx run`` with no prompt: chat in the terminal, as ``ollama run`` and
``llama-cli -cnv`` do, on the same engine, journal and conversations as aotx-chat.

Owns: the read-eval loop (line editing and history through ``readline``; ``\"\"\"``
starts and ends a multi-line message), the slash commands, streaming a reply to the
terminal with Ctrl-C cancelling it, and the line after each reply that shows where
the turn stands with aotx-chat's markers (``● durable``, ``◑ interrupted``,
``⊘ cancelled``, ``✗ failed``), its speed and the context used.
Leaves to others: the engine connection (the caller passes ``connect``), attachments'
checks (``attach.py``), the paste parser (``paste.py``), words (``format.py``).

Commands: ``/help``, ``/bye`` (also ``/exit``, ``/quit``, Ctrl-D), ``/attach PATH...``,
``/system [TEXT]``, ``/set [NAME VALUE]`` (temperature, top_k, top_p, min_p,
repeat_penalty, max_tokens, seed, speculative), ``/context [POLICY]``, ``/fork``,
``/new``, ``/show``, ``/export PATH``. Settings and the system prompt are the conversation's own (saved
in the journal, so aotx-chat's F4 shows them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from aotx.engine.units import plural, short_title
from aotx.engine.present.attach import make_attachment
from aotx.engine.present.format import GLYPHS, error_text, fork_title, media_text, notice_text
from aotx.engine.present.paste import parse_pasted_paths
from aotx.engine.errors import AotxError
from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost, model_label, model_ref

PROMPT = ">>> "
MORE = "... "
SETTINGS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                             "repeat_penalty": float, "max_tokens": int, "seed": int, "speculative": str}
HELP = """Commands:
  /attach PATH...    attach images or audio to the next message
                     (quoted or escaped paths work)
  /system [TEXT]     set (or show) the system prompt of this conversation
  /set [NAME VALUE]  set (or show) sampling: temperature, top_k, top_p, min_p,
                     repeat_penalty, max_tokens (a number, or "context"),
                     seed, speculative (auto, ngram, draft, off)
  /context [POLICY]  set (or show) what this conversation does once it outgrows
                     the context: rolling (older turns leave the prompt), middle
                     (the first exchange stays too) or stop; the journal keeps
                     every message
  /fork              branch this conversation here and continue in the branch
  /new               start a new conversation
  /show              this conversation's id, title and settings
  /export PATH       write it as Markdown (.md) or JSON (.json)
  /bye               leave (also /exit, /quit, Ctrl-D); the engine keeps
                     running
Start and end a multi-line message with \"\"\". Ctrl-C cancels a reply being
written."""


class NotSent(ConnectionLost):
    """The connection was lost before the engine accepted a message (nothing journaled)."""


@dataclass(frozen=True)
class Command:
    name: str  # without the slash, lower case
    arg: str   # the rest of the line, stripped


def parse_command(line: str) -> Command | None:
    """``/set temperature 0.2`` -> Command("set", "temperature 0.2"); None for a message.
    ``//text`` sends ``/text`` as a message."""
    s = line.strip()
    if not s.startswith("/") or s.startswith("//"):
        return None
    name, _, arg = s[1:].partition(" ")
    return Command(name.lower(), arg.strip())


def apply_setting(sp: P.SamplingParams, arg: str) -> P.SamplingParams:
    """``temperature 0.2`` -> a copy of ``sp`` with it. Raises ValueError naming the problem."""
    name, _, value = arg.strip().partition(" ")
    name, value = name.strip().lower().replace("-", "_"), value.strip()
    if name not in SETTINGS:
        raise ValueError(f"/set: unknown setting {name!r} (one of {', '.join(SETTINGS)})")
    if not value:
        raise ValueError(f"/set {name}: give a value, e.g. /set {name} {getattr(sp, name)}")
    kind = SETTINGS[name]
    if name == "seed" and value.lower() in ("none", "random"):
        return msgspec.structs.replace(sp, seed=None)
    if name == "max_tokens" and value.lower() in ("context", "none", "off"):
        return msgspec.structs.replace(sp, max_tokens=P.UNTIL_CONTEXT)
    try:
        v = kind(value)
    except ValueError:
        raise ValueError(f"/set {name}: {value!r} is not a valid {kind.__name__}") from None
    if name == "speculative" and v not in ("", "auto", "ngram", "draft", "off"):
        raise ValueError(f"/set speculative: {v!r} is not one of auto, ngram, draft, off")
    if kind in (int, float) and v != v:  # NaN
        raise ValueError(f"/set {name}: not a number")
    if name in ("top_p", "min_p") and not 0.0 <= v <= 1.0:
        raise ValueError(f"/set {name}: must be between 0 and 1, got {v}")
    if name in ("temperature", "repeat_penalty", "top_k", "seed") and v < 0:
        raise ValueError(f"/set {name}: must not be negative, got {v}")
    if name in ("max_tokens", "repeat_penalty") and v <= 0:
        raise ValueError(f"/set {name}: must be positive, got {v}")
    return msgspec.structs.replace(sp, **{name: v})


def settings_line(sp: P.SamplingParams) -> str:
    def shown(k: str) -> str:
        v = getattr(sp, k)
        if k == "max_tokens" and v >= P.UNTIL_CONTEXT:
            return "context"
        return "-" if v in (None, "") else str(v)

    return " ".join(f"{k}={shown(k)}" for k in SETTINGS)


class Repl:
    """The loop. ``read(prompt)`` returns a line (raises EOFError at the end, and
    KeyboardInterrupt for Ctrl-C); ``write(text)`` prints without a newline."""

    def __init__(self, client, *, sampling: P.SamplingParams, conv_id: str | None = None,
                 system: str | None = None, read: Callable[[str], str] = input,
                 write: Callable[[str], None] | None = None, err: Callable[[str], None] | None = None,
                 model: str = "", reconnect: Callable[[list[str]], Awaitable] | None = None) -> None:
        self.client = client
        # reconnect(engine_args) -> a client, starting an engine with those flags when none
        # answers: after the engine was stopped (or crashed) the next message starts one with
        # the flags of the engine that went away (its Welcome's); None: no restart
        self.reconnect = reconnect
        self.sampling = sampling
        self.model = model          # ``--model`` as the engine reads it ("" = the engine's default)
        self.conv_id = conv_id
        self.system = system
        self.read = read
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.err = err or (lambda s: print(s, file=sys.stderr))
        self.attachments: list[P.Attachment] = []
        self.title = ""
        self.n_ctx = 0
        self.context = ""           # this conversation's context policy ("": the engine's)
        self.default_context = ""   # the engine's
        self._rid = 0

    # ---- the loop ----------------------------------------------------------

    async def start(self) -> None:
        st = await self.client.status()
        self.n_ctx = st.n_ctx
        self.default_context = st.context_policy
        if self.conv_id:
            view = await self.client.show(self.conv_id)
            self.title, self.system, self.context = view.title, view.system_prompt, view.context
            if view.sampling is not None:
                self.sampling = view.sampling
            self.err(f"continuing “{view.title}” ({plural(len(view.messages), 'message')}); /help lists the commands")
        elif self.model:                   # --model: loaded beside the default at the first message
            self.err(f"{model_label(self.model)} on {st.device} (the engine's default is {st.model}); /help lists the commands, "
                     f"/bye leaves")
        else:
            self.err(f"{st.model} on {st.device}; /help lists the commands, /bye leaves")

    def read_message(self) -> str | None:
        """One message (or command) from the terminal; None at the end (Ctrl-D)."""
        while True:
            try:
                line = self.read(PROMPT)
            except EOFError:
                return None
            except KeyboardInterrupt:
                self.write("\n")
                self.err("(Ctrl-D or /bye leaves)")
                continue
            if line.strip().startswith('"""'):
                return self._multi_line(line.strip()[3:])
            if line.strip():
                return line

    def _multi_line(self, first: str) -> str | None:
        lines = [first] if first else []
        while True:
            try:
                line = self.read(MORE)
            except EOFError:
                return "\n".join(lines) or None
            except KeyboardInterrupt:
                self.write("\n")
                return ""
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    async def handle(self, line: str) -> bool:
        """Act on one line; False when the user leaves. When the engine went away since the
        last line (``aotx stop``, a crash), an engine is started again first, with the flags
        of the one that went away; a message the old one never accepted is sent to it."""
        cmd = parse_command(line)
        if cmd is not None and cmd.name in ("bye", "exit", "quit", "help", "?", "attach"):
            return await self.command(cmd)   # nothing here needs the engine
        await asyncio.sleep(0.01)             # let the connection read what came while we waited
        if self.client is None or self.client.closed:
            await self.restart()
        try:
            if cmd is None:
                await self.send(line[1:] if line.strip().startswith("//") else line)
                return True
            return await self.command(cmd)
        except NotSent:
            await self.restart()
            if cmd is None:
                await self.send(line[1:] if line.strip().startswith("//") else line)
                return True
            return await self.command(cmd)

    def went_away(self) -> str:
        """What to say when the connection is lost: a stop or a crash."""
        name = getattr(getattr(self.client, "welcome", None), "model", "") or "the same model"
        if getattr(self.client, "stopped", False):
            return f"the engine was stopped; your next message starts it again ({name})"
        return (f"the engine went away (it crashed or was killed); what was durable is kept, and your next "
                f"message starts it again ({name})")

    async def restart(self) -> None:
        """Start (or reach) an engine with the flags of the one that went away."""
        old = self.client
        if self.reconnect is None:
            raise ConnectionLost("the engine went away")
        args = list(getattr(getattr(old, "welcome", None), "engine_args", None) or [])
        if old is not None and not old.closed:
            await old.close()
        self.err("starting the engine again…")
        self.client = await self.reconnect(args)
        st = await self.client.status()
        self.n_ctx = st.n_ctx

    # ---- commands ----------------------------------------------------------

    async def command(self, cmd: Command) -> bool:
        name, arg = cmd.name, cmd.arg
        if name in ("bye", "exit", "quit"):
            return False
        if name in ("help", "?"):
            self.err(HELP)
        elif name == "attach":
            self.attach(arg)
        elif name == "system":
            if not arg:
                self.err(f"system prompt: {self.system!r}" if self.system else "no system prompt")
            else:
                self.system = None if arg.lower() in ("none", "off", '""') else arg
                await self._save_settings()
                self.err("system prompt set" if self.system else "system prompt cleared")
        elif name == "set":
            if not arg:
                self.err(settings_line(self.sampling))
            else:
                try:
                    self.sampling = apply_setting(self.sampling, arg)
                except ValueError as e:
                    self.err(str(e))
                    return True
                await self._save_settings()
                self.err(settings_line(self.sampling))
        elif name == "context":
            await self.set_context(arg)
        elif name == "fork":
            await self.fork()
        elif name == "new":
            self.conv_id, self.title, self.attachments = None, "", []
            self.err("new conversation: it starts with your next message")
        elif name == "show":
            where = f"{self.conv_id} “{self.title}”" if self.conv_id else "a new conversation (nothing sent yet)"
            self.err(f"{where}\nsystem prompt: {self.system or '-'}\n{settings_line(self.sampling)}\n"
                     f"{self.context_line()}")
        elif name == "export":
            await self.export(arg)
        else:
            self.err(f"unknown command /{name}; /help lists them")
        return True

    def context_line(self) -> str:
        policy = self.context or self.default_context or "rolling"
        whose = "" if self.context else " (the engine's default)"
        ctx = f"; the context holds {self.n_ctx:,} tokens" if self.n_ctx else ""
        return f"context policy: {policy}{whose}{ctx}"

    async def set_context(self, arg: str) -> None:
        """``/context``: show the policy, or set it (saved with the conversation)."""
        if not arg:
            self.err(f"{self.context_line()}; /context rolling, middle or stop sets it")
            return
        policy = arg.strip().lower()
        if policy not in P.CONTEXT_POLICIES:
            self.err(f"/context: {arg!r} is not one of {', '.join(P.CONTEXT_POLICIES)}")
            return
        if self.conv_id:
            await self.client.set_context(self.conv_id, policy)
        self.context = policy
        self.err(self.context_line())

    def attach(self, arg: str) -> None:
        items = parse_pasted_paths(arg)
        paths = [i.value for i in items if i.kind == "path"] or ([arg] if arg else [])
        if not paths:
            self.err("/attach PATH: give a file (an image or audio)")
            return
        for p in paths:
            r = make_attachment(p)
            if r.problem:
                self.err(f"not attached: {r.problem}")
            elif all(a.sha256 != r.attachment.sha256 for a in self.attachments):
                self.attachments.append(r.attachment)
        if self.attachments:
            self.err("attached to the next message: " + ", ".join(a.name for a in self.attachments))

    async def _save_settings(self) -> None:
        if self.conv_id:
            await self.client.update(self.conv_id, system_prompt=self.system, sampling=self.sampling)

    async def fork(self) -> None:
        if not self.conv_id:
            self.err("nothing to fork yet: send a message first")
            return
        parent = await self.client.show(self.conv_id)
        view = await self.client.fork(self.conv_id)
        title = fork_title(parent.title, [c.title for c in await self.client.list_conversations()])
        await self.client.rename(view.conv_id, title)
        self.err(f"forked “{parent.title}” ({plural(len(parent.messages), 'message')}) into {view.conv_id} “{title}”; "
                 "you are in the fork, the original is unchanged")
        self.conv_id, self.title = view.conv_id, title

    async def export(self, arg: str) -> None:
        from aotx.engine.present.export import default_path, write_export

        if not self.conv_id:
            self.err("nothing to export yet: send a message first")
            return
        view = await self.client.show(self.conv_id)
        path = write_export(view, arg or default_path(view))
        self.err(f"exported {plural(len(view.messages), 'message')} to {path}")

    # ---- a message ---------------------------------------------------------

    async def send(self, text: str) -> None:
        if self.conv_id is None:
            title = short_title(text)
            try:
                conv = await self.client.create_conversation(title=title, system_prompt=self.system,
                                                             sampling=self.sampling, model=self.model,
                                                             context=self.context)
            except ConnectionLost:
                raise NotSent("the engine went away before it accepted the message") from None
            self.conv_id, self.title = conv.conv_id, conv.title
        atts, self.attachments = self.attachments, []
        from aotx.engine.ipc.client import CancelOnSignal

        rid: list[int] = []
        # Ctrl-C cancels the reply and the chat goes on; SIGTERM or SIGHUP cancel it and end the chat
        stopper = CancelOnSignal(asyncio.get_running_loop(), lambda r: self.client.cancel(target=r)).__enter__()
        user_pos, reply_pos, finish, timings, n_prompt, n_done, streamed = "queued", "queued", "", {}, 0, 0, False
        refusal = None
        try:
            async for ev in self._events(text, atts, rid):
                if isinstance(ev, P.Accepted):
                    rid.append(ev.id)
                    stopper.accepted(ev.id)
                    user_pos, reply_pos, n_prompt = "accepted", "accepted", len(ev.prompt_ids)
                elif isinstance(ev, P.MediaInfo):
                    self.err(media_text(ev))
                elif isinstance(ev, P.Token):
                    reply_pos = "committed"
                    if ev.text:
                        self.write(ev.text)
                        streamed = True
                elif isinstance(ev, P.Notice) and ev.kind == "refused":
                    refusal = ev          # said once, with the Error after it
                elif isinstance(ev, P.Notice):
                    if ev.kind != "capsule":
                        self.err(f"[{notice_text(ev)}]")
                elif isinstance(ev, P.Error):
                    self.err(f"{GLYPHS['failed']} {error_text(ev, refusal)}")
                    if not rid:  # refused before it was accepted: nothing was journaled
                        self.attachments = atts
                    return
                elif isinstance(ev, P.Committed):
                    finish, timings = ev.finish_reason, dict(ev.timings)
                    reply_pos = "cancelled" if finish == "cancelled" else "committed"
                    n_prompt = ev.n_prompt or n_prompt
                    n_done = ev.n_completion
                elif isinstance(ev, P.Durable):
                    if user_pos == "accepted":
                        user_pos = "durable"
                    if finish and reply_pos == "committed":
                        reply_pos = "durable"
        finally:
            stopper.__exit__()
        if streamed:
            self.write("\n")
        self.err(self.turn_line(user_pos, reply_pos, finish, n_prompt, n_done, timings))
        if stopper.signum in (signal.SIGTERM, signal.SIGHUP):
            raise SystemExit(stopper.exit_code)

    async def _events(self, text: str, atts: list[P.Attachment], rid: list[int]):
        """The submitted message's events. A connection lost before the engine accepted it
        raises NotSent (nothing was journaled: send it again to the next engine); after,
        it says what is kept and ends the turn."""
        try:
            async for ev in self.client.submit(self.conv_id, text, attachments=atts, sampling=self.sampling,
                                               model=self.model):
                yield ev
        except ConnectionLost:
            if not rid:
                self.attachments = atts
                raise NotSent("the engine went away before it accepted the message") from None
            self.write("\n")
            self.err(f"{GLYPHS['interrupted']} {self.went_away()}")

    def turn_line(self, user_pos: str, reply_pos: str, finish: str, n_prompt: int, n_completion: int,
                  timings: dict) -> str:
        """``● you  ● reply · 42 tokens · 18.3 tok/s · context 120/4096`` (the glyphs of
        aotx-chat's legend; "(length)" when the reply hit its limit)."""
        reply = f"{GLYPHS.get(reply_pos, '?')} reply"
        if finish and finish not in ("stop", "cancelled"):
            reply += f" ({finish})"
        elif finish == "cancelled":
            reply += " cancelled"
        parts = [f"{GLYPHS.get(user_pos, '?')} you  {reply}", f"{n_completion} tokens"]
        tps = timings.get("decode_tokens_per_s", timings.get("tokens_per_s", 0.0))
        if tps:
            parts.append(f"{tps:.1f} tok/s")
        if self.n_ctx:
            parts.append(f"context {n_prompt + n_completion}/{self.n_ctx}")
        return " · ".join(parts)


def _readline_history() -> None:
    """Line editing and a history file (``<data dir>/repl_history``) where readline exists."""
    try:
        import atexit
        import readline

        from aotx.engine import paths

        hist = paths.data_dir() / "repl_history"
        try:
            readline.read_history_file(hist)
        except OSError:
            pass
        readline.set_history_length(1000)
        atexit.register(lambda: _save_history(readline, hist))
    except ImportError:
        pass


def _save_history(readline, hist) -> None:
    try:
        readline.write_history_file(hist)
        os.chmod(hist, 0o600)
    except OSError:
        pass


def run_repl(args, connect: Callable[[], Awaitable],
             reconnect: Callable[[list[str]], Awaitable] | None = None) -> int:
    """The interactive ``aotx run``: ``connect()`` returns an EngineClient (the CLI's,
    which starts an engine when none answers); ``reconnect(engine_args)`` one after the
    engine went away (an engine started with those flags). Returns the exit code."""
    _readline_history()
    sampling = P.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
                                max_tokens=args.max_tokens, stop=list(args.stop), speculative=args.speculative)
    loop = asyncio.new_event_loop()
    client = None
    repl = None
    try:
        from aotx.engine.model.loader import check_model_arg

        check_model_arg(args.model)  # a missing or non-GGUF file: refused before an engine starts
        client = loop.run_until_complete(connect())
        repl = Repl(client, sampling=sampling, conv_id=args.conversation, system=args.system,
                    model=model_ref(args.model), reconnect=reconnect)
        loop.run_until_complete(repl.start())
        for path in args.attach:
            repl.attach(path)
        while True:
            line = repl.read_message()
            if line is None:
                sys.stdout.write("\n")
                break
            if not line.strip():
                continue
            try:
                if not loop.run_until_complete(repl.handle(line)):
                    break
            except ConnectionLost:
                if reconnect is None:
                    repl.err(f"aotx: {repl.went_away()}")
                    return 2
                repl.err(f"aotx: {repl.went_away()}")
            except AotxError as e:  # a refused request: say so, keep the conversation going
                repl.err(f"aotx: {e}")
        return 0
    finally:
        if repl is not None:
            client = repl.client
        if client is not None:
            loop.run_until_complete(client.close())
        loop.close()
