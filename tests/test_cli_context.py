"""``aotx run`` on a conversation that outgrows its context: the cut is said on stderr (one
line, the numbers), ``--json`` carries it (the notice's ``cut``, the done event's
``context``), and ``--context-policy stop`` refuses with the way to go on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import cli_support
from tests.gateway_support import start_engine, stop_engine

aotx = cli_support.aotx
LONG = ("Here is some background about my garden, which has roses, tulips, daisies, a small pond with fish, "
        "an old apple tree, a bench under the tree, a path of stones and a fence painted green. ") * 3


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-context")


@pytest.fixture(scope="module")
def engine(home, default_model_path):
    proc, sock = start_engine(home, None, slots=1, context=256, timeout=180,
                              sock=Path(f"/tmp/aotx-cc-{os.getpid()}.sock"))
    yield sock
    stop_engine(proc)
    sock.unlink(missing_ok=True)


def run(home, engine, *args):
    return aotx(home, "run", "--socket", str(engine), "--temperature", "0", "--max-tokens", "2", *args)


@pytest.mark.realmodel
def test_run_says_where_earlier_messages_left_the_prompt(home, engine):
    first = run(home, engine, "--json", LONG)
    assert first.returncode == 0, first.stderr
    conv = next(e for e in map(json.loads, first.stdout.splitlines()) if e["event"] == "done")["conversation"]
    second = run(home, engine, "--conversation", conv, LONG)
    assert second.returncode == 0, second.stderr
    lines = [x for x in second.stderr.splitlines() if "left the prompt" in x]
    assert len(lines) == 1 and lines[0].startswith("aotx: 2 earlier messages"), second.stderr
    assert "context policy rolling" in lines[0] and "journal keeps every message" in lines[0]
    third = run(home, engine, "--conversation", conv, "--json", LONG)
    assert third.returncode == 0, third.stderr
    events = [json.loads(x) for x in third.stdout.splitlines()]
    notice = next(e for e in events if e["event"] == "notice" and e["kind"] == "context")
    cut = notice["cut"]
    assert cut["policy"] == "rolling" and cut["n_messages"] == 2 and cut["n_out"] == 4 and cut["n_tokens"] > 0
    assert next(e for e in events if e["event"] == "done")["context"] == [cut]
    stopped = run(home, engine, "--conversation", conv, "--context-policy", "stop", LONG + LONG)
    assert stopped.returncode == 2
    assert "`/context rolling`" in stopped.stderr and "context holds 256" in stopped.stderr, stopped.stderr
    shown = aotx(home, "conversations", "show", conv, "--socket", str(engine))
    assert shown.returncode == 0, shown.stderr
    assert "context policy: stop" in shown.stdout
    assert shown.stdout.count("✂ 2 earlier messages") == 2, shown.stdout      # the two replies whose prompts were cut
