"""The command line of several models: aotx models, run --model, unload, models add/remove.

``aotx models`` without an engine reads the models folder; the rest runs against an
``aotx serve`` subprocess on the default model, with a tiny llama file in its models
folder that ``aotx run --model`` loads beside the default without a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import aotx as cli_aotx, one_line
from tests.gateway_support import start_engine, stop_engine

pytestmark = pytest.mark.realmodel


def aotx(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    h = tmp_path_factory.mktemp("cli-models")
    (h / "models").mkdir()
    tiny_gguf.write_tiny_llama(h / "models" / "tiny-a.gguf", seed=1)
    return h


def test_models_without_an_engine_reads_the_folder(home):
    r = aotx(home, "models", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["engine"] is False
    by = {m["name"]: m for m in d["models"]}
    assert by["tiny-a"]["arch"] == "llama" and by["tiny-a"]["quant"] == "Q8_0" and by["tiny-a"]["needs_bytes"] > 0
    assert any(m.get("default") for m in d["models"])
    text = aotx(home, "models").stdout
    assert "tiny-a" in text and "estimated for 8 slots" in text
    # regression: the "context" column showed the trained context,
    # not what the engine would serve; now that column is the served one, "trained" the file's
    header = text.splitlines()[0].split()
    assert header[4:6] == ["context", "trained"], header
    row = next(line.split() for line in text.splitlines() if "tiny-a" in line)
    n_train = by["tiny-a"]["n_ctx_train"]
    assert int(row[header.index("trained") + 1]) == n_train      # +1: the size is two words ("9.5 KiB")
    assert int(row[header.index("context") + 1]) == min(4096, n_train)


def test_models_add_and_remove_a_remote_entry(home):
    r = aotx(home, "models", "add", "cluster", "--url", "http://gpu-box:8000/v1", "--remote-model", "Qwen/Q-72B",
             "--api-key-env", "VLLM_KEY")
    assert r.returncode == 0, r.stderr
    entry = home / "models" / "cluster.remote.json"
    assert json.loads(entry.read_text()) == {"url": "http://gpu-box:8000/v1", "model": "Qwen/Q-72B",
                                             "api_key_env": "VLLM_KEY"}
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    listed = {m["name"]: m for m in json.loads(aotx(home, "models", "--json").stdout)["models"]}
    assert listed["cluster"]["kind"] == "remote" and listed["cluster"]["url"] == "http://gpu-box:8000/v1"
    bad = aotx(home, "models", "add", "x", "--url", "gpu-box:8000")
    assert bad.returncode == 2 and "http(s) base URL" in bad.stderr and len(bad.stderr.splitlines()) == 1
    assert aotx(home, "models", "remove", "cluster").returncode == 0 and not entry.exists()
    gone = aotx(home, "models", "remove", "cluster")
    assert gone.returncode == 2 and "no remote model entry" in gone.stderr


@pytest.fixture(scope="module")
def engine(home):
    proc, sock = start_engine(home, None, slots=2, context=256, timeout=180,
                              sock=Path(f"/tmp/aotx-cm-{os.getpid()}.sock"))
    yield sock
    stop_engine(proc)
    sock.unlink(missing_ok=True)


def test_run_model_loads_beside_the_default_then_unload(home, engine):
    sock = str(engine)
    r = aotx(home, "run", "--socket", sock, "--model", "tiny-a", "--json", "--temperature", "0", "--max-tokens", "3",
             "hello")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert any(e["event"] == "notice" and "loading model tiny-a" in e["message"] for e in events), events
    done = next(e for e in events if e["event"] == "done")  # a "durable" receipt may follow it
    assert max(done["prompt_ids"]) < 300  # tiny-a's vocabulary
    listed = json.loads(aotx(home, "models", "--socket", sock, "--json").stdout)
    assert listed["engine"] is True
    by = {m["name"]: m for m in listed["models"]}
    assert by["tiny-a"]["loaded"] is True and by["tiny-a"]["needs_bytes"] > 0
    st = aotx(home, "status", "--socket", sock)
    assert "tiny-a" in st.stdout and "models  (loaded)" in st.stdout
    # the same conversation goes on on its model
    conv = done["conversation"]
    r2 = aotx(home, "run", "--socket", sock, "--conversation", conv, "--json", "--temperature", "0",
              "--max-tokens", "2", "again")
    assert r2.returncode == 0, r2.stderr
    done2 = next(e for e in map(json.loads, r2.stdout.splitlines()) if e["event"] == "done")
    assert max(done2["prompt_ids"]) < 300
    assert aotx(home, "unload", "tiny-a", "--socket", sock).returncode == 0
    again = aotx(home, "unload", "tiny-a", "--socket", sock)
    assert again.returncode == 2 and "is not loaded" in again.stderr
    unknown = aotx(home, "run", "--socket", sock, "--model", "tiny-b", "--max-tokens", "2", "x")
    assert unknown.returncode == 2 and "did you mean tiny-a?" in unknown.stderr, unknown.stderr


def test_bug_models_shows_the_default_models_size_quant_and_served_context(home, engine):
    """Regression: `aotx models` showed size `-`, quant `-` and the trained context (8192)
    for the loaded default model while `aotx status` said the engine serves 4096."""
    sock = str(engine)
    listed = json.loads(aotx(home, "models", "--socket", sock, "--json").stdout)
    d = next(m for m in listed["models"] if m["default"])
    assert d["loaded"] is True
    assert d["size_bytes"] > 0 and d["quant"], d
    assert d["n_ctx"] == 256, d
    text = aotx(home, "models", "--socket", sock).stdout
    row = next(line for line in text.splitlines() if d["name"] in line)
    assert " 256 " in row and d["quant"] in row, row


def test_bug_run_refused_by_the_engine_leaves_no_empty_conversation(home, engine):
    """Regression: a run the engine refuses (an unknown model name) left "0 messages" behind."""
    sock = str(engine)
    before = json.loads(aotx(home, "conversations", "list", "--socket", sock, "--json").stdout or "[]")
    bad = aotx(home, "run", "--socket", sock, "--model", "no-such-model-here", "--max-tokens", "2", "x")
    assert bad.returncode == 2 and "no model named" in bad.stderr, bad.stderr
    after = json.loads(aotx(home, "conversations", "list", "--socket", sock, "--json").stdout or "[]")
    assert len(after) == len(before), after


def test_bug_a_loaded_model_whose_file_was_deleted_still_answers_by_name(home, engine, tiny_gguf):
    """A new user deleted the file of a loaded model: `aotx models` still listed it loaded, but
    `aotx run --model NAME` said "no model named NAME" (the new conversation resolved the
    name in the folder only). A loaded model's own name now comes first: it answers until
    unloaded."""
    sock = str(engine)
    f = home / "models" / "tiny-gone.gguf"
    tiny_gguf.write_tiny_llama(f, seed=3)
    r = aotx(home, "run", "--socket", sock, "--model", "tiny-gone", "--temperature", "0", "--max-tokens", "2", "hi")
    assert r.returncode == 0, r.stderr
    f.unlink()
    r = aotx(home, "run", "--socket", sock, "--model", "tiny-gone", "--temperature", "0", "--max-tokens", "2", "hi")
    assert r.returncode == 0 and "no model named" not in r.stderr, r.stderr
    assert aotx(home, "unload", "tiny-gone", "--socket", sock).returncode == 0
    r = aotx(home, "run", "--socket", sock, "--model", "tiny-gone", "--max-tokens", "2", "hi")
    assert r.returncode == 2 and "no model named 'tiny-gone'" in r.stderr, r.stderr


def test_unload_of_the_default_model_is_refused_and_it_stays_loaded(home, engine):
    """Regression: `aotx unload <default model>` said "unloaded" and left no model loaded
    although the README says the default model stays."""
    default = json.loads(cli_aotx(home, "status", "--socket", str(engine), "--json").stdout)["model"]
    r = cli_aotx(home, "unload", default, "--socket", str(engine))
    assert r.returncode == 2 and r.stdout == ""
    assert one_line(r) == (f"aotx: {default} is the engine's default model: it stays loaded (unload the models "
                           f"loaded beside it; `aotx stop` frees all of them)")
    listed = json.loads(cli_aotx(home, "models", "--socket", str(engine), "--json").stdout)
    assert next(m for m in listed["models"] if m["name"] == default)["loaded"] is True


def test_models_add_refuses_an_existing_name_unless_replace(tmp_path):
    """Regression: ``models add`` silently replaced an entry of the same name."""
    r = cli_aotx(tmp_path, "models", "add", "big", "--url", "http://a/v1", "--remote-model", "Qwen/Qwen2.5-72B",
             timeout=120)
    assert r.returncode == 0, r.stderr
    r = cli_aotx(tmp_path, "models", "add", "big", "--url", "http://b/v1", timeout=120)
    assert r.returncode == 2
    assert "a remote model named 'big' exists (-> http://a/v1); add --replace" in one_line(r)
    entry = (tmp_path / "models" / "big.remote.json").read_text()
    assert "http://a/v1" in entry and "Qwen2.5-72B" in entry          # nothing was written
    r = cli_aotx(tmp_path, "models", "add", "big", "--url", "http://b/v1", "--replace", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("replaced remote model big -> http://b/v1")
    assert "http://b/v1" in (tmp_path / "models" / "big.remote.json").read_text()


def test_models_add_refuses_a_local_models_name(tmp_path, default_model_path):
    r = cli_aotx(tmp_path, "models", "add", default_model_path.stem, "--url", "http://x/v1", timeout=120)
    assert r.returncode == 2
    assert "is already the name of a local model" in one_line(r)
    assert not list((tmp_path / "models").glob("*.remote.json"))


def test_tokenize_with_a_mistyped_model_name_suggests_the_close_one(tmp_path, default_model_path):
    """Regression: `aotx tokenize --model smolm2` named no model to try instead."""
    r = cli_aotx(tmp_path, "tokenize", "--model", "smolm2", "hi", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"did you mean {default_model_path.stem}?" in one_line(r)
    r = cli_aotx(tmp_path, "tokenize", "--model", "zzzz", "hi", timeout=120)
    assert r.returncode == 2 and "did you mean" not in one_line(r)
