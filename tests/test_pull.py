"""``aotx pull`` against a local server in the Hub's URL layout.

The machines have no internet: ``tests/fakes/hub.py`` serves tiny GGUF files the way
the Hub does (resolve -> 302 to a CDN URL with the LFS sha256 and size; ranges on the
CDN), and ``huggingface_hub`` talks to it through ``$AOTX_HF_ENDPOINT``. Each test
runs the real command line (``cli.main``) in-process.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from aotx.engine.cli import commands as cli
from aotx.engine.cli.pull import parse_ref
from tests.fakes.hub import FakeHub

REPO = "tiny-org/Tiny-GGUF"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("AOTX_HF_ENDPOINT", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return tmp_path


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory, tiny_gguf) -> bytes:
    p = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("pull") / "t.gguf", seed=3)
    return Path(p).read_bytes()


def pull(*args: str) -> int:
    return cli.main(["pull", *args])


def models(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").glob("*.gguf"))


@pytest.mark.parametrize("text, want", [
    ("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
     ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", "main")),
    ("hf:org/repo/sub/dir/m.gguf@v1.0", ("org/repo", "sub/dir/m.gguf", "v1.0")),
    ("org/repo:m.gguf", ("org/repo", "m.gguf", "main")),
    ("https://huggingface.co/org/repo/resolve/abc123/m.gguf", ("org/repo", "m.gguf", "abc123")),
])
def test_references(text, want):
    r = parse_ref(text)
    assert (r.repo_id, r.filename, r.revision) == want


def test_pull_installs_the_file_checked(home, tiny_bytes, monkeypatch, capsys):
    with FakeHub({f"{REPO}/tiny-q8_0.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # AOTX_HF_ENDPOINT wins
        assert pull(f"hf:{REPO}/tiny-q8_0.gguf") == 0
    out = capsys.readouterr().out
    dest = home / "models" / "tiny-q8_0.gguf"
    assert dest.read_bytes() == tiny_bytes
    assert hashlib.sha256(tiny_bytes).hexdigest() in out and "llama" in out
    assert hub.downloads()[0].startswith("bytes=0-")  # the header first, by a range request
    assert not list((home / "models" / ".partial").iterdir())
    # it is a model now: aotx models lists it
    assert cli.main(["models", "--json"]) == 0
    assert '"tiny-q8_0"' in capsys.readouterr().out


def test_hf_endpoint_is_honoured(home, tiny_bytes, monkeypatch):
    with FakeHub({f"{REPO}/a.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        assert pull(f"{REPO}/a.gguf") == 0
    assert models(home) == ["a.gguf"]


def test_interrupted_download_resumes_where_it_stopped(home, tiny_bytes, monkeypatch, capsys):
    half = len(tiny_bytes) // 2
    with FakeHub({f"{REPO}/t.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        # huggingface_hub hands the body over in chunks of DOWNLOAD_CHUNK_SIZE (10 MB): a small
        # one here, as a real file of many chunks has
        monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
        hub.drop_at = half  # the connection breaks at half, every time
        assert pull(f"hf:{REPO}/t.gguf") == 2
        err = capsys.readouterr().err
        assert "pull again to resume" in err
        parts = list((home / "models" / ".partial").glob("*.part"))
        kept = parts[0].stat().st_size
        assert len(parts) == 1 and half - 4096 < kept <= half
        assert models(home) == []
        hub.drop_at = None
        n_before = len(hub.downloads())
        assert pull(f"hf:{REPO}/t.gguf") == 0
        assert "resuming at" in capsys.readouterr().out
        resumed = hub.downloads()[n_before:]
    assert f"bytes={kept}-" in resumed  # only what was missing was fetched
    assert (home / "models" / "t.gguf").read_bytes() == tiny_bytes


def test_checksum_mismatch_removes_the_download(home, tiny_bytes, monkeypatch, capsys):
    with FakeHub({f"{REPO}/t.gguf": tiny_bytes}) as hub:
        hub.publish_sha[f"{REPO}/t.gguf"] = "ab" * 32
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        assert pull(f"hf:{REPO}/t.gguf") == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "ab" * 32 in err and hashlib.sha256(tiny_bytes).hexdigest() in err
    assert models(home) == [] and not list((home / "models" / ".partial").glob("*.part"))


def test_over_budget_is_refused_before_the_download(home, tiny_bytes, monkeypatch, capsys):
    with FakeHub({f"{REPO}/t.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        assert pull(f"hf:{REPO}/t.gguf", "--memory-budget", "64K", "--slots", "1", "--context", "64") == 2
        err = capsys.readouterr().err
        assert "would not fit the memory budget" in err and "64.0 KiB" in err and "not downloaded" in err
        # only the header was read (one small range), nothing written
        assert all(r.startswith("bytes=0-") for r in hub.downloads())
    assert models(home) == [] and not list((home / "models" / ".partial").glob("*"))


def test_not_gguf_is_refused_before_it_takes_the_disk(home, monkeypatch, capsys):
    with FakeHub({f"{REPO}/fake.gguf": b"PK\x03\x04" + b"\0" * 5000}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        assert pull(f"hf:{REPO}/fake.gguf") == 2
        assert "is not a GGUF file" in capsys.readouterr().err
        assert pull(f"hf:{REPO}/model.safetensors") == 2
        assert "AOTX runs GGUF files" in capsys.readouterr().err
        assert pull(f"hf:{REPO}/missing.gguf") == 2
        assert "missing.gguf" in capsys.readouterr().err
    assert models(home) == []


def test_an_architecture_aotx_cannot_run_is_refused(home, tiny_gguf, tmp_path, monkeypatch, capsys):
    p = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", arch="mamba")
    with FakeHub({f"{REPO}/m.gguf": Path(p).read_bytes()}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        assert pull(f"hf:{REPO}/m.gguf") == 2
    err = capsys.readouterr().err
    assert "architecture 'mamba' is not supported" in err and "not downloaded" in err
    assert models(home) == []


def test_bug_resume_from_a_server_that_ignores_range_starts_over_not_corrupt(home, tiny_bytes, monkeypatch,
                                                                             capsys):
    """The bug: resuming against a server that ignores Range (200 and the whole file, not
    206) appended the whole file to the part, and the pull failed blaming the download
    (huggingface_hub 0.36: "Consistency check failed: file should be of size 106848 but
    has size 160096"; 2.x rewinds by itself). Now the 200 is noticed before the download,
    the part is emptied and the file is fetched whole from byte 0, whatever the library."""
    half = len(tiny_bytes) // 2
    with FakeHub({f"{REPO}/t.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
        hub.drop_at = half
        assert pull(f"hf:{REPO}/t.gguf") == 2
        kept = next((home / "models" / ".partial").glob("*.part")).stat().st_size
        assert 0 < kept <= half
        capsys.readouterr()
        hub.drop_at, hub.ignore_range = None, True
        n_before = len(hub.downloads())
        assert pull(f"hf:{REPO}/t.gguf") == 0, capsys.readouterr().err
        out = capsys.readouterr()
        resumed = hub.downloads()[n_before:]
    # the header read, the probe (answered 200), then the whole file from byte 0
    assert resumed[0].startswith("bytes=0-") and resumed[1:] == [f"bytes={kept}-", ""]
    assert "ignores range requests" in out.err and "starting over from byte 0" in out.err
    assert "resuming at" not in out.out
    assert (home / "models" / "t.gguf").read_bytes() == tiny_bytes
    assert not list((home / "models" / ".partial").glob("*.part"))


def test_bug_hub_errors_said_the_librarys_raw_text(home, tiny_bytes, monkeypatch, capsys):
    """A missing file printed httpx's "Client error '404 File not found' for url ..." and no
    network "[Errno -2] Name or service not known": one line each, but neither said what was
    wrong. Now a 404 says the repository has no such file and an unreachable server says so,
    naming the network (and HF_ENDPOINT)."""
    with FakeHub({f"{REPO}/t.gguf": tiny_bytes}) as hub:
        monkeypatch.setenv("AOTX_HF_ENDPOINT", hub.endpoint)
        assert pull(f"hf:{REPO}/missing.gguf") == 2
        err = capsys.readouterr().err
        assert f"{REPO} has no file missing.gguf (HTTP 404)" in err and "Client error" not in err
    with socket.socket() as s:                     # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AOTX_HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert pull(f"hf:{REPO}/t.gguf") == 2
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}" in err and "check the network connection" in err
    assert err.count("\n") == 1 and models(home) == []
