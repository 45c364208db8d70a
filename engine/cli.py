"""The ``aotx`` command line: argument parsing and dispatch, one line per error.

Owns: the subcommands' flags and turning every ``AotxError`` into one line on
stderr with exit code 2 (and Ctrl-C into exit 130). The work lives elsewhere:
``serve.py`` (the engine process), ``cli_client.py`` (commands that talk to the
engine), ``cli_local.py`` (commands that open the model in-process).
"""

from __future__ import annotations

import argparse
import sys

from aotx.engine.errors import AotxError, UsageError
from aotx.engine.ipc.protocol import SAMPLING_LIMITS, SPECULATIVE_MODES, Limit, SamplingParams, limit_problem


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage and exits 2: keep 2, one line
        raise UsageError(f"{self.prog}: {message}")


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
    p.add_argument("--kv-type", choices=["f16", "f32"], default=None,
                   help="KV cache element type (default f16: half the memory of f32, as llama.cpp)")
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="vision projector GGUF (llama.cpp's mmproj) for images; default: a file named mmproj*.gguf "
                        "beside the model; 'none' turns images into text by OCR")
    p.add_argument("--no-journal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", help="Unix socket of the engine (default: in the runtime dir)")
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
    for field in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed"):
        p.add_argument("--" + field.replace("_", "-"), type=_sampling(field), default=getattr(d, field))
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--speculative", choices=[m for m in SPECULATIVE_MODES if m], default=d.speculative,
                   help="speculative decoding for this reply: auto (prompt lookup where it pays), ngram "
                        "(prompt lookup), draft (the engine's --draft-model) or off (default: the engine's choice)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aotx", description="AOTX: a local assistant runtime for GGUF models")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)

    p = sub.add_parser("run", help="ask the model once and stream the answer to stdout")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is the text")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--profile", action="store_true", help="print the startup profile (seconds per stage) as JSON")
    p.add_argument("--conversation", help="continue this conversation id")
    p.add_argument("--attach", action="append", default=[], help="attach a media file")
    p.add_argument("prompt", help="the prompt ('-' reads standard input)")

    p = sub.add_parser("serve", help="run the engine in the foreground")
    add_engine_flags(p)
    p.add_argument("--speculative", choices=["auto", "ngram", "draft", "off"], default=None,
                   help="default speculative decoding: auto (prompt lookup on the CPU after 2-token "
                        "matches, off on CUDA), ngram (prompt lookup), draft (--draft-model) or off "
                        "(default: draft with --draft-model, else auto; see BENCHMARKS.md)")
    p.add_argument("--draft-p-min", type=_float("--draft-p-min", 0.0, 1.0), default=None,
                   help="stop drafting when the draft model's top probability falls below this (default 0.75)")
    p.add_argument("--prefill-chunk", type=_int("--prefill-chunk", 1), default=256, help=argparse.SUPPRESS)

    p = sub.add_parser("gateway", help="serve an OpenAI-compatible HTTP API (bearer API keys) in front of the engine")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other needs "
                   "--api-key-file)")
    p.add_argument("--port", type=_int("--port", 0), default=8080)
    p.add_argument("--api-key-file", help="API keys, one per line (default: <data dir>/gateway/api_keys, "
                   "generated on first start)")
    p.add_argument("--max-tokens-ceiling", type=_int("--max-tokens-ceiling", 1), default=4096)
    p.add_argument("--per-key-concurrency", type=_int("--per-key-concurrency", 1), default=16)
    p.add_argument("--max-queue", type=_int("--max-queue", 1), default=64,
                   help="generations in flight across all keys before 429")

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
    q = msub.add_parser("add", help="add a remote OpenAI-compatible endpoint (vLLM, SGLang, llama-server, Ollama) "
                        "as a model")
    q.add_argument("name")
    q.add_argument("--url", required=True, help="the endpoint's base URL, e.g. http://gpu-box:8000/v1")
    q.add_argument("--remote-model", help="the model's id on the server (default: NAME)")
    q.add_argument("--api-key-env", help="environment variable holding the API key")
    q.add_argument("--api-key-file", help="file holding the API key")
    q.add_argument("--api-key", help="the API key itself (stored in the entry, mode 0600)")
    q.add_argument("--context", type=_int("--context", 0), default=None, help="the server's context in tokens")
    q = msub.add_parser("remove", help="remove a remote model entry")
    q.add_argument("name")

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
    p.add_argument("--concurrency", default="1,2,4,8,16", help="aggregate decode at these slot counts")
    p.add_argument("--capsules", metavar="SIZES", help="capsule benchmark at these context sizes, e.g. 512,2048,8192")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding off vs prompt lookup vs a draft model (acceptance, tokens per "
                        "pass, speed)")
    p.add_argument("--draft-model", help="draft model for --speculative (default: the model itself, which shows "
                   "acceptance but not speed)")

    p = sub.add_parser("tune", help="time the CUDA kernel candidates for a model on this GPU and record the winners")
    p.add_argument("--model")
    p.add_argument("--budget", type=_float("--budget", 1.0), default=600.0,
                   help="most seconds spent timing (default 600; sites after that keep their default kernel)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("journal", help="check or print the journal")
    jsub = p.add_subparsers(dest="jcmd", parser_class=_Parser)
    for name in ("verify", "dump", "repair", "compact"):
        q = jsub.add_parser(name)
        q.add_argument("--json", action="store_true")

    p = sub.add_parser("conversations", help="list, show or fork conversations")
    csub = p.add_subparsers(dest="ccmd", parser_class=_Parser)
    q = csub.add_parser("list")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("fork", help="branch a conversation at a message, reusing its state")
    q.add_argument("id")
    q.add_argument("--at", default="", help="message id to fork at (default: the last)")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    q = csub.add_parser("show")
    q.add_argument("id")
    q.add_argument("--json", action="store_true")
    q.add_argument("--socket")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotx`` console script. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        ap = build_parser()
        args = ap.parse_args(argv)
        if not args.cmd:
            ap.print_help()
            return 2
        if args.cmd == "serve":
            from aotx.engine.serve import serve

            return serve(args)
        if args.cmd == "gateway":
            from aotx.engine import cli_client
            from aotx.engine.ipc.gateway import run_gateway

            return run_gateway(args, lambda: cli_client.connect(args, spawn=True))
        if args.cmd in ("models", "unload"):
            from aotx.engine import cli_models

            return getattr(cli_models, f"cmd_{args.cmd}")(args)
        if args.cmd == "pull":
            from aotx.engine.pull import cmd_pull

            return cmd_pull(args)
        if args.cmd in ("tokenize", "logits", "models", "bench", "journal", "tune"):
            from aotx.engine import cli_local

            return getattr(cli_local, f"cmd_{args.cmd}")(args)
        if args.cmd == "conversations" and not args.ccmd:
            raise UsageError("aotx conversations: choose list or show")
        from aotx.engine import cli_client

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
