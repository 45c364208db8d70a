"""The ``aotx-chat`` console script: parse flags, build the client factory, run the app.

Flags that concern the engine (``--model``, ``--device``, ``--mmproj``) are passed to the engine
the app starts when none answers on the socket; a running engine keeps its own. ``--model``
also opens the app on a new conversation on that model (a running engine loads it beside
its default at the first message, as ``aotx run --model`` does).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from aotx.app.theming import THEMES


class _Parser(argparse.ArgumentParser):
    """argparse with the ``aotx`` command's error line: one line with a "did you mean" for a
    mistyped option (``--modle``), exit code 2, instead of argparse's usage block."""

    def error(self, message: str):
        from aotx.engine.errors import friendly_error

        print(f"aotx-chat: {friendly_error(self, message)}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="aotx-chat", description="Chat with a local model in the terminal.")
    p.add_argument("--model", help="GGUF model path for the engine (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="device for the engine (default: auto)")
    p.add_argument("--draft-model", help="a smaller GGUF with the model's vocabulary, for speculative decoding "
                   "(the engine started here drafts with it; F4 chooses per conversation)")
    p.add_argument("--mmproj", metavar="PATH", help="vision projector GGUF for images (default: mmproj*.gguf "
                                                    "beside the model; 'none' for OCR)")
    p.add_argument("--kv-type", choices=["f16", "f32"], help="KV cache element type for the engine (default: f16)")
    p.add_argument("--theme", choices=sorted(THEMES), help="colour theme (remembered; F6 switches)")
    p.add_argument("--socket",
                   help="Unix socket of the engine (default: in the runtime dir; under $AOTX_HOME when set)")
    from aotx.engine.present import config as cli_config
    from aotx.engine.errors import AotxError

    try:  # the config file's defaults (model, device, theme); flags still win
        cli_config.apply(p, *cli_config.load())
    except AotxError as e:
        p.exit(2, f"aotx-chat: {e}\n")
    return p.parse_args(argv)


def engine_args(ns: argparse.Namespace) -> list[str]:
    args: list[str] = []
    if ns.model:
        args += ["--model", ns.model]
    if ns.device:
        args += ["--device", ns.device]
    if ns.draft_model:
        args += ["--draft-model", ns.draft_model]
    if getattr(ns, "mmproj", None):
        args += ["--mmproj", ns.mmproj]
    if getattr(ns, "kv_type", None):
        args += ["--kv-type", ns.kv_type]
    return args


def client_factory(socket: str | None = None, args: list[str] | None = None, *, spawn: bool = True):
    """A factory that connects to the engine on ``socket`` and, when none answers and
    ``spawn``, starts one there with ``args`` (the app calls it again after a crash,
    so a dead engine is restarted with the same arguments; after a stop, with
    ``engine_args``: the stopped engine's own)."""
    from aotx.engine.ipc.client import EngineClient

    async def factory(on_spawn: Callable[[str], None], *, engine_args: list[str] | None = None,
                      spawn: bool = spawn):
        from aotx.engine.present.format import startup_text

        # what the starting engine says while it loads goes where the spawn line went: the status line
        return await EngineClient.connect(socket, spawn=spawn,
                                          engine_args=list(args or []) if engine_args is None else engine_args,
                                          client_name="aotx-chat", on_spawn=on_spawn,
                                          on_progress=lambda p: on_spawn(startup_text(p)))

    return factory


def make_client_factory(ns: argparse.Namespace):
    """The real factory: connect to (or start) the engine."""
    return client_factory(ns.socket, engine_args(ns))


def main(argv: list[str] | None = None) -> int:
    try:
        ns = parse_args(argv)
    except SystemExit as e:  # a usage error or an unreadable config file: said in one line already
        return e.code if isinstance(e.code, int) else 2
    if ns.model:  # a missing or non-GGUF file: one line and exit 2, before the TUI opens (as `aotx run`)
        from aotx.engine.errors import AotxError
        from aotx.engine.model.loader import check_model_arg

        try:
            check_model_arg(ns.model)
        except AotxError as e:
            print(f"aotx-chat: {e}", file=sys.stderr)
            return e.exit_code
    if ns.draft_model:  # refuse a mismatched draft model before starting anything
        from aotx.engine.errors import AotxError
        from aotx.engine.model.vocabulary import check_vocabulary_files

        try:
            check_vocabulary_files(ns.model, ns.draft_model)
        except AotxError as e:
            print(f"aotx-chat: {e}", file=sys.stderr)
            return e.exit_code
    from aotx.app.app import ChatApp
    from aotx.engine.errors import AotxError
    from aotx.engine.ipc.client import model_ref

    try:  # the data dir is read first (the app's saved state): a file where it should be, say
        app = ChatApp(make_client_factory(ns), theme=ns.theme, model=model_ref(ns.model))
    except AotxError as e:
        print(f"aotx-chat: {e}", file=sys.stderr)
        return e.exit_code
    app.run()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
