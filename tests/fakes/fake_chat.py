"""aotx-chat on the scripted engine, in a real terminal: for tests that drive it through
tmux (pastes, keys typed while a message is sent) and for demos.

``python -m tests.fakes.fake_chat --log FILE`` (from the repository root) runs ChatApp
against a ``FakeEngine``; when it exits it writes FILE: JSON with every submitted text.
"""

from __future__ import annotations

import argparse
import json

from aotx.app.app import ChatApp
from tests.fakes.fake_engine import FakeEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    engine = FakeEngine(reply=lambda t: f"echo {t}")
    app = ChatApp(engine.connect, status_poll_s=0.5)
    try:
        app.run()
    finally:
        with open(args.log, "w") as fh:
            json.dump({"submitted": [text for _, text, _ in engine.submitted]}, fh)


if __name__ == "__main__":
    main()
