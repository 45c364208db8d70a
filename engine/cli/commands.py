"""The ``aotx`` command line: argument parsing and dispatch, one line per error.

Owns: the subcommands' flags and turning every ``AotxError`` into one line on
stderr with exit code 2 (and Ctrl-C into exit 130). The work lives elsewhere:
``serve.py`` (the engine process), ``cli_client.py`` (commands that talk to the
engine), ``cli_local.py`` (commands that open the model in-process).
"""

from __future__ import annotations

import argparse
import re
import sys

from aotx.engine.errors import AotxError, UsageError, friendly_error
from aotx.engine.present import config as cli_config
from aotx.engine.protocol import (CONTEXT_POLICIES, SAMPLING_LIMITS, SPECULATIVE_MODES, Limit, SamplingParams,
                                  limit_problem)


class _Parser(argparse.ArgumentParser):
    """argparse with AOTX's error line: exit code 2, one line, no internal names, and a
    "did you mean" for a mistyped command or option (never ``aotx: aotx: argument cmd: ...``)."""

    def error(self, message: str) -> None:  # argparse's default prints usage and exits 2: keep 2, one line
        raise UsageError(friendly_error(self, message))


def _check_model_name_before_spawning(args) -> None:
    """``aotx run --model NAME`` with no engine on the default socket: a name the models
    folder does not know is refused here (the engine's own words, its did-you-mean), not
    after starting an engine that loads the default model only to refuse it. With an
    engine running (it may know names from its own ``--model``) or an explicit
    ``--socket``, the engine decides."""
    if not args.model or getattr(args, "socket", None):
        return
    from aotx.engine import paths
    from aotx.engine.ipc.client import _socket_lock_held
    from aotx.engine.runtime.catalog import Catalog

    if _socket_lock_held(paths.socket_path()):
        return
    Catalog().resolve(args.model)     # NotFound: one line, exit 2


def chosen_parser(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand parser ``args`` went through (``aotx conversations show``)."""
    parser = ap
    for dest in ("cmd", "ccmd", "jcmd"):
        name = getattr(args, dest, None)
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not name or sub is None or name not in sub.choices:
            break
        parser = sub.choices[name]
    return parser


def not_utf8(text: str) -> str | None:
    """Where ``text`` is not valid Unicode, in words ("byte 0xff at character 3"), or None.
    Python hands bytes that are not UTF-8 (in argv, on a pipe) over as lone surrogates."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        ch = text[e.start]
        what = f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"U+{ord(ch):04X}"
        return f"{what} at character {e.start}"


def check_text_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse any command-line text that is not valid UTF-8, naming its flag (or the
    positional argument) and where: it could not be sent to the engine or written."""
    names = {}
    for a in parser._actions:
        names[a.dest] = a.option_strings[-1] if a.option_strings else f"the {a.dest.replace('_', ' ')}"
    for dest, value in vars(args).items():
        for text in (value if isinstance(value, list) else [value]):
            where = not_utf8(text) if isinstance(text, str) else None
            if where:
                raise UsageError(f"{names.get(dest, '--' + dest.replace('_', '-'))}: not valid UTF-8 ({where}); "
                                 "give the text in UTF-8")


def version() -> str:
    try:
        from importlib.metadata import version as _version

        return _version("aotx")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a bare checkout)
        return "unknown"


def _checked(name: str, limit: Limit):
    """An argparse type for a number in ``limit``, with the message the engine gives
    for the same value in an operation (``protocol.limit_problem``)."""
    def parse(text: str) -> float | int:
        try:
            v: float | int = int(text) if limit.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(limit_problem(name, text, limit)) from None
        why = limit_problem(name, v, limit)
        if why:
            raise argparse.ArgumentTypeError(why)
        return v

    return parse


def _int_list(name: str, lo: int, hi: int):
    """An argparse type for a comma-separated list of integers in [lo, hi] (one at least),
    returned as the text it was given (the bench parses it again)."""
    def parse(text: str) -> str:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{name}: expected integers separated by commas, got {text!r}")
        for t in parts:
            try:
                v = int(t)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name}: {t!r} is not an integer") from None
            if not lo <= v <= hi:
                raise argparse.ArgumentTypeError(f"{name}: {v} is outside {lo}..{hi}")
        return ",".join(parts)

    return parse


def _float(name: str, lo: float | None = None, hi: float | None = None):
    return _checked(name, Limit(lo, hi))


def _int(name: str, lo: int | None = None):
    return _checked(name, Limit(lo, None, integer=True))


def _sampling(field: str):
    """The flag ``--field-name`` of a sampling parameter: its type checks the shared range."""
    return _checked("--" + field.replace("_", "-"), SAMPLING_LIMITS[field])


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags that choose and size the engine (serve, and clients that may start one)."""
    p.add_argument("--model", help="GGUF file or a name in the models folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--slots", type=_int("--slots", 1), default=None, help="concurrent generations (default 8)")
    p.add_argument("--context", type=_int("--context", 16), default=None,
                   help="tokens of context per slot (default 4096, at most the model's)")
    p.add_argument("--memory-budget", default=None, help="bytes the engine may use, e.g. 4G (default: half the RAM)")
    p.add_argument("--kv-type", choices=["f16", "f32", "q8_0", "q4_0"], default=None,
                   help="KV cache element type (default f16: half the memory of f32, as llama.cpp; q8_0 and q4_0: "
                        "llama.cpp's 8-bit and 4-bit blocks, about 1/2 and 1/4 of f16's memory)")
    p.add_argument("--context-policy", choices=list(CONTEXT_POLICIES), default=None,
                   help="what a conversation does once its history outgrows the context: rolling (default: the "
                        "oldest turns leave the prompt, the system prompt and the newest turns stay), middle (the "
                        "first exchange stays too) or stop (refuse; a reply ends at the end of the context); the "
                        "journal keeps every message. A conversation may set its own (/context)")
    p.add_argument("--expert-cache", choices=["static", "lru", "lfu"], default=None,
                   help="mixture-of-experts models: the GPU expert cache keeps the calibrated plan's experts "
                        "(static, default) or learns hot experts from traffic (lru, lfu)")
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="vision projector GGUF (llama.cpp's mmproj) for images; default: a file named mmproj*.gguf "
                        "beside the model; 'none' turns images into text by OCR")
    p.add_argument("--no-journal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket",
                   help="Unix socket of the engine (default: in the runtime dir; under $AOTX_HOME when set)")
    p.add_argument("--draft-model", help="a smaller GGUF with the same vocabulary, for --speculative draft")
    p.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="unload a model loaded beside the default after it has been idle this long (5m, 1h; "
                        "default 0 = never)")
    p.add_argument("--evict-idle", action="store_true",
                   help="when a model to load does not fit the budget, unload the least recently used idle models "
                        "(default: refuse the load with the numbers)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The sampling flags: names, ranges and defaults from ``protocol.SamplingParams``."""
    d = SamplingParams()
    helps = {"max_tokens": "reply length limit (default: none short of the context)",
             "repeat_penalty": f"penalty on the last {d.repeat_last_n} tokens (1 = off; default {d.repeat_penalty})"}
    for field in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed"):
        p.add_argument("--" + field.replace("_", "-"), type=_sampling(field), default=getattr(d, field),
                       help=helps.get(field))
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--speculative", choices=[m for m in SPECULATIVE_MODES if m], default=d.speculative,
                   help="speculative decoding for this reply: auto (prompt lookup where it pays), ngram "
                        "(prompt lookup), draft (the engine's --draft-model), mtp (the model's own MTP head) or off "
                        "(default: the engine's choice)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aotx", description="AOTX: a local assistant runtime for GGUF models")
    ap.add_argument("--version", action="version", version=f"aotx {version()}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("run", help="ask the model and stream the answer; with no prompt, chat in the terminal")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is the text")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--profile", action="store_true", help="print the startup profile (seconds per stage) as JSON")
    p.add_argument("--conversation", help="continue this conversation id")
    p.add_argument("--attach", action="append", default=[], help="attach a media file")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt ('-' reads standard input); none: an interactive chat (/help lists its "
                        "commands), or standard input when it is not a terminal")

    p = sub.add_parser("serve", help="run the engine in the foreground")
    add_engine_flags(p)
    p.add_argument("--speculative", choices=["auto", "ngram", "draft", "mtp", "off"], default=None,
                   help="default speculative decoding: auto (prompt lookup on the CPU after 2-token "
                        "matches, off on CUDA), ngram (prompt lookup), draft (--draft-model), mtp (the "
                        "model's multi-token-prediction head, for files with nextn layers) or off "
                        "(default: draft with --draft-model, else auto; see BENCHMARKS.md)")
    p.add_argument("--draft-p-min", type=_float("--draft-p-min", 0.0, 1.0), default=None,
                   help="stop drafting when the draft model's top probability falls below this (default 0.75)")
    p.add_argument("--prefill-chunk", type=_int("--prefill-chunk", 1), default=256, help=argparse.SUPPRESS)

    p = sub.add_parser("gateway", help="serve an OpenAI-compatible HTTP API (bearer API keys) in front of the engine")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other needs "
                   "--api-key-file)")
    p.add_argument("--port", type=_checked("--port", Limit(0, 65535, integer=True)), default=8080,
                   help="TCP port, 0 to 65535 (default 8080; 0: a free port, printed at start)")
    p.add_argument("--api-key-file", help="API keys, one per line (default: <data dir>/gateway/api_keys, "
                   "generated on first start)")
    p.add_argument("--max-tokens-ceiling", type=_int("--max-tokens-ceiling", 1), default=None,
                   help="cap every reply at this many tokens (a request asking more is served up to it, finish "
                   "reason 'length'); default: none, a reply runs until it ends, its max_tokens or the context")
    p.add_argument("--per-key-concurrency", type=_int("--per-key-concurrency", 1), default=16)
    p.add_argument("--max-queue", type=_int("--max-queue", 1), default=64,
                   help="generations in flight across all keys before 429")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="a browser origin (https://chat.example; * for any) whose pages may call the API; "
                   "repeatable (default: none, CORS off)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the certificate's private key (with --tls-cert)")

    sub.add_parser("config", help="the defaults in effect (model, device, context, slots, theme, api_key_file): "
                   "each one's value and where it came from (the config file: `aotx config` names it)")
    p = sub.add_parser("completion", help='print a shell completion script: eval "$(aotx completion bash)"')
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])

    p = sub.add_parser("stop", help="stop the engine serving the socket")
    p.add_argument("--socket")

    p = sub.add_parser("status", help="the engine's budget table and slots")
    p.add_argument("--socket")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("models", help="the installed models (files, remote endpoints), which are loaded, what each "
                       "needs in memory")
    p.add_argument("--json", action="store_true")
    p.add_argument("--socket")
    msub = p.add_subparsers(dest="mcmd", parser_class=_Parser)
    q = msub.add_parser("add", help="install a GGUF file under a name (aotx models add NAME PATH), or add a remote "
                        "OpenAI-compatible endpoint (vLLM, SGLang, llama-server, Ollama) with --url")
    q.add_argument("name")
    q.add_argument("path", nargs="?", help="the GGUF file (it stays where it is; the name points at it)")
    q.add_argument("--url", help="a remote endpoint's base URL, e.g. http://gpu-box:8000/v1")
    q.add_argument("--remote-model", help="the model's id on the server (default: NAME)")
    q.add_argument("--api-key-env", help="environment variable holding the API key, read from the engine's "
                   "environment (set it where the engine starts)")
    q.add_argument("--api-key-file", help="file holding the API key")
    q.add_argument("--api-key", help="the API key itself (stored in the entry, mode 0600)")
    q.add_argument("--context", type=_int("--context", 0), default=None, help="the server's context in tokens")
    q.add_argument("--replace", action="store_true", help="replace an entry of that name (a running engine "
                   "unloads the old one first)")
    q = msub.add_parser("remove", help="remove an installed name or a remote entry (the file itself stays; a running "
                        "engine unloads the model first)")
    q.add_argument("name")
    q.add_argument("--socket", default=argparse.SUPPRESS)  # (or before "remove": the models' own --socket)

    p = sub.add_parser("unload", help="unload a model from the running engine")
    p.add_argument("name")
    p.add_argument("--socket")

    p = sub.add_parser("pull", help="download a GGUF into the models folder (hf:ORG/REPO/FILE.gguf), checked "
                       "against the memory budget before the download")
    p.add_argument("ref", help="hf:ORG/REPO/FILE.gguf (optionally hf:ORG/REPO/FILE.gguf@REVISION)")
    p.add_argument("--memory-budget", default=None, help="the budget to check against (default: the engine's, or "
                   "half the RAM)")
    p.add_argument("--slots", type=_int("--slots", 1), default=None)
    p.add_argument("--context", type=_int("--context", 16), default=None)
    p.add_argument("--force", action="store_true", help="download even when it would not fit the budget")
    p.add_argument("--name", help="file name in the models folder (default: the file's own)")

    p = sub.add_parser("tokenize", help="print the token ids of TEXT")
    p.add_argument("--model")
    p.add_argument("--json", action="store_true")
    p.add_argument("--special", action="store_true", help="parse special-token text such as <|im_start|>")
    p.add_argument("text")

    p = sub.add_parser("logits", help="one teacher-forced pass: the top-K logits at every position")
    p.add_argument("--model")
    p.add_argument("--top", type=_int("--top", 1), default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--ids", help="comma-separated token ids instead of TEXT")
    p.add_argument("text", nargs="?")

    p = sub.add_parser("bench", help="measure prefill and decode speed")
    p.add_argument("--model")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--concurrency", default="1,2,4,8,16", type=_int_list("--concurrency", 1, 256),
                   help="aggregate decode at these slot counts (1-256)")
    p.add_argument("--capsules", metavar="SIZES", type=_int_list("--capsules", 16, 131072),
                   help="capsule benchmark at these context sizes (16-131072 tokens), e.g. 512,2048,8192")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding off vs prompt lookup vs a draft model (acceptance, tokens per "
                        "pass, speed)")
    p.add_argument("--draft-model", help="draft model for --speculative (default: the model itself, which shows "
                   "acceptance but not speed)")
    p.add_argument("--engine-path", action="store_true",
                   help="prefill and decode as aotx run --json reports them, from an engine built as aotx serve "
                        "builds it, next to the model alone")
    p.add_argument("--peer", metavar="PYTHON",
                   help="with --engine-path: a Python with llama-cpp-python; llama.cpp runs on the same file "
                        "before and after AOTX and the table shows the ratios")

    p = sub.add_parser("tune", help="time the CUDA kernel candidates for a model on this GPU and record the winners")
    p.add_argument("--model")
    p.add_argument("--budget", type=_float("--budget", 1.0), default=600.0,
                   help="most seconds spent timing (default 600; sites after that keep their default kernel)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("journal", help="verify, dump, repair or compact the journal")
    jsub = p.add_subparsers(dest="jcmd", metavar="ACTION", parser_class=_Parser)
    for name, what in (("verify", "check every record's checksum (exit 1 on a problem)"),
                       ("dump", "print every record"),
                       ("repair", "salvage a damaged journal (damaged bytes kept in a .damaged copy)"),
                       ("compact", "replace the journal by one checkpoint of the live conversations (a deleted "
                                   "conversation's text leaves the disk)")):
        q = jsub.add_parser(name, help=what)
        q.add_argument("--json", action="store_true")

    p = sub.add_parser("conversations", help="list, show, export, fork or delete conversations")
    csub = p.add_subparsers(dest="ccmd", metavar="ACTION", parser_class=_Parser)
    q = csub.add_parser("list", help="every conversation (read from the journal; from the engine while one runs)")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("fork", help="branch a conversation at a message, reusing its state")
    q.add_argument("id")
    q.add_argument("--at", default="", help="message id to fork at (default: the last)")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("delete", help="delete a conversation (as F8 in aotx-chat)")
    q.add_argument("id")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("show", help="messages, token ids and receipts of a conversation")
    q.add_argument("id")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("export", help="write a conversation as Markdown or JSON")
    q.add_argument("id")
    q.add_argument("--format", choices=["md", "json"], default=None,
                   help="md (Markdown, the default) or json; default from the --output extension")
    q.add_argument("-o", "--output", help="file to write (default: standard output)")
    q.add_argument("--socket")
    return ap


def join_negative_values(argv: list[str]) -> list[str]:
    """``--memory-budget -4G`` -> ``--memory-budget=-4G``: argparse reads a value that
    starts with a dash and a digit as an option and said "expected one argument", hiding
    the real problem (a negative value), which the option's own check then names."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", a) and out[-1] != "--":
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotx`` console script. Returns the exit code."""
    argv = join_negative_values(sys.argv[1:] if argv is None else argv)
    try:
        ap = build_parser()
        settings, cpath = cli_config.load()
        cli_config.apply(ap, settings, cpath)  # the config file's defaults; flags still win
        args, extra = ap.parse_known_args(argv)
        if extra:  # name the subcommand whose options were meant, and suggest one of them
            chosen_parser(ap, args).error(f"unrecognized arguments: {' '.join(extra)}")
        check_text_args(chosen_parser(ap, args), args)
        if not args.cmd:
            ap.print_help()
            return 2
        if args.cmd == "config":
            cli_config.show(ap, settings, cpath)
            return 0
        if args.cmd == "completion":
            print(cli_config.completion(ap, args.shell))
            return 0
        if args.cmd == "serve":
            from aotx.engine.cli.serve import serve

            return serve(args)
        if args.cmd == "gateway":
            from aotx.engine.cli import client as cli_client
            from aotx.engine.gateway.server import run_gateway

            return run_gateway(args, lambda: cli_client.connect(args, spawn=True))
        if args.cmd in ("models", "unload"):
            from aotx.engine.cli import models as cli_models

            return getattr(cli_models, f"cmd_{args.cmd}")(args)
        if args.cmd == "pull":
            from aotx.engine.cli.pull import cmd_pull

            return cmd_pull(args)
        if args.cmd in ("tokenize", "logits", "models", "bench", "journal", "tune"):
            from aotx.engine.cli import local as cli_local

            return getattr(cli_local, f"cmd_{args.cmd}")(args)
        if args.cmd == "status":
            import asyncio

            from aotx.engine.cli.status import status

            return asyncio.run(status(args))
        if args.cmd == "conversations" and not args.ccmd:
            raise UsageError("conversations: choose list, show, export, fork or delete")
        if args.cmd == "conversations" and args.ccmd in ("list", "show", "export"):
            from aotx.engine.cli import local as cli_local  # the journal itself; the engine while one runs

            return cli_local.cmd_conversations(args)
        if args.cmd == "run":  # a missing or non-GGUF --model file: refused before anything starts
            from aotx.engine.model.loader import check_model_arg

            check_model_arg(args.model)
            _check_model_name_before_spawning(args)
        if args.cmd == "run" and args.prompt is None and not args.json and sys.stdin.isatty():
            from aotx.engine.cli.repl import run_repl  # no prompt at a terminal: chat there
            from aotx.engine.cli import client as cli_client

            return run_repl(args, connect=lambda: cli_client.connect(args),
                            reconnect=lambda engine_args: cli_client.reconnect(args, engine_args))
        from aotx.engine.cli import client as cli_client

        if args.cmd == "conversations":  # fork: named as aotx-chat names forks
            from aotx.engine.present.format import fork_title

            return cli_client.dispatch(args, fork_title=fork_title)
        return cli_client.dispatch(args)
    except AotxError as e:
        print(f"aotx: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("aotx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
