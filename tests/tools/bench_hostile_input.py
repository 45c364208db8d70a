"""Hostile input against a streaming client: the largest inter-token gap it sees (issue 15).

Run from the repository root (the lead runs it on a quiet machine; unset
OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for the command when the machine sets them):

    python -m tests.tools.bench_hostile_input [--model PATH] [--tokens 300] [--json]

One client streams a long greedy reply (a raw prompt, so no chat template is
involved) from an `aotx serve` engine; its inter-token gaps are measured alone
(the baseline), then while another client sends, one attack per row:

* ``10 MB message``: one 10 MB chat message over the engine socket;
* ``8 x 1 MB (gateway)``: eight parallel 1 MB chat completions through
  `aotx gateway` (its own process, in front of the same engine);
* ``hostile template``: a chat message to an engine whose model carries
  ``{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}``
  as its chat template (the default model's file rewritten with that template).

Prints a table: the baseline's and the attack's largest gap, their ratio (the
issue asks for under 2x; before this work: 9.6 s and 4.9 s against a 0.16 s
baseline), how long the attack took to be answered, how many tokens the stream
received meanwhile (the window the gap covers: use enough ``--tokens`` that the
stream outlives the attack), what the attack was answered with, and the
engine's peak RSS (VmHWM) after the row. Each engine runs with 4
slots and a 4,096-token context on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
STREAM_PROMPT = "Count from one to fifty: one, two,"


# ---- a GGUF with another chat template ------------------------------------------

def _gguf_string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _gguf_value(vtype: int, v) -> bytes:
    from aotx.engine.model import gguf_file as G

    if vtype == G.STRING:
        return _gguf_string(v.encode())
    if vtype == G.ARRAY:
        if not v:
            return struct.pack("<IQ", G.UINT8, 0)
        if isinstance(v[0], str):
            return struct.pack("<IQ", G.STRING, len(v)) + b"".join(_gguf_string(x.encode()) for x in v)
        etype = G.FLOAT32 if isinstance(v[0], float) else G.BOOL if isinstance(v[0], bool) else G.INT32
        import numpy as np

        arr = np.asarray(v, dtype=G._SCALAR_DTYPES[etype])
        return struct.pack("<IQ", etype, len(v)) + arr.tobytes()
    import numpy as np

    return np.asarray(v, dtype=G._SCALAR_DTYPES[vtype]).tobytes()


def with_template(src: Path, dst: Path, template: str) -> Path:
    """Write ``src`` to ``dst`` with ``tokenizer.chat_template`` replaced (metadata
    rewritten, tensor infos and data copied as they are)."""
    from aotx.engine.model import gguf_file as G

    blob = memoryview(src.read_bytes())
    parsed = G.parse(blob)
    meta, types = dict(parsed.metadata), dict(parsed.value_types)
    meta["tokenizer.chat_template"], types["tokenizer.chat_template"] = template, G.STRING
    out = bytearray(b"GGUF" + struct.pack("<IQQ", parsed.version, len(parsed.tensors), len(meta)))
    for k, v in meta.items():
        out += _gguf_string(k.encode()) + struct.pack("<I", types[k]) + _gguf_value(types[k], v)
    for t in parsed.tensors:
        out += _gguf_string(t.name.encode()) + struct.pack("<I", len(t.shape))
        out += b"".join(struct.pack("<Q", d) for d in t.shape) + struct.pack("<IQ", t.type_id, t.offset)
    out += b"\0" * (-len(out) % parsed.alignment)
    with open(dst, "wb") as fh:
        fh.write(out)
        fh.write(blob[parsed.data_start:])
    return dst


# ---- processes ----------------------------------------------------------------------

class Engine:
    """`aotx serve` in a subprocess with its own AOTX_HOME."""

    def __init__(self, home: Path, model: Path | None, name: str):
        self.home, self.sock = home, home / f"{name}.sock"
        self.log = open(home / f"{name}.log", "wb")
        args = [sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(self.sock), "--slots", "4",
                "--context", "4096", "--device", "cpu"] + (["--model", str(model)] if model else [])
        self.proc = subprocess.Popen(args, env=dict(os.environ, AOTX_HOME=str(home)), stdout=self.log,
                                     stderr=self.log)

    async def wait_ready(self, timeout: float = 600) -> None:
        from aotx.engine.ipc.client import EngineClient

        deadline = time.monotonic() + timeout
        while True:
            try:
                c = await EngineClient.connect(self.sock, spawn=False)
                await c.close()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not start: see {self.log.name}") from None
                await asyncio.sleep(0.5)

    def peak_rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Gateway:
    """`aotx gateway` in front of an engine; ``url`` and ``key`` once started."""

    def __init__(self, home: Path, sock: Path):
        self.err = open(home / "gateway.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "gateway", "--socket", str(sock),
                                      "--port", "0"], env=dict(os.environ, AOTX_HOME=str(home)),
                                     stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.monotonic() + 120
        while True:
            self.err.seek(0)
            m = re.search(r"at (http://\S+/v1)", self.err.read())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.2)
        lines = (home / "gateway" / "api_keys").read_text().splitlines()
        self.key = next(x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#"))

    def chat(self, text: str) -> tuple[int, str]:
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
        req = urllib.request.Request(self.url + "/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {self.key}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read().decode()[:200]
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()[:200]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.err.close()


# ---- measuring ----------------------------------------------------------------------

async def stream(sock: Path, n_tokens: int, started: asyncio.Event | None = None) -> list[float]:
    """Token arrival times of one greedy raw reply of ``n_tokens`` tokens."""
    from aotx.engine import protocol as P
    from aotx.engine.ipc.client import EngineClient

    c = await EngineClient.connect(sock, spawn=False, client_name="bench-stream")
    conv = await c.create_conversation(title="stream")
    times: list[float] = []
    async for ev in c.submit(conv.conv_id, STREAM_PROMPT, raw=True, wait_durable=False,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=n_tokens)):
        if isinstance(ev, P.Token):
            times.append(time.monotonic())
            if started is not None and len(times) == 20:
                started.set()
    await c.close()
    return times


def max_gap(times: list[float], t0: float = 0.0, t1: float = float("inf")) -> float:
    """The largest gap between consecutive tokens that ends inside [t0, t1] (seconds)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if t0 <= b <= t1 + 1.0]
    return max(gaps) if gaps else float("nan")


async def socket_message(sock: Path, text: str) -> str:
    from aotx.engine import protocol as P
    from aotx.engine.ipc.client import EngineClient

    c = await EngineClient.connect(sock, spawn=False, client_name="bench-attack")
    conv = await c.create_conversation(title="attack")
    outcome = "accepted"
    async for ev in c.submit(conv.conv_id, text, wait_durable=False, sampling=P.SamplingParams(max_tokens=4)):
        if isinstance(ev, P.Error):
            outcome = f"{ev.code}: {ev.message}"
    await c.close()
    return outcome


async def row(name: str, sock: Path, n_tokens: int, attack) -> dict:
    """Baseline stream, then the stream with ``attack`` (an async callable) started
    after its 20th token."""
    base = await stream(sock, n_tokens)
    started = asyncio.Event()
    task = asyncio.create_task(stream(sock, n_tokens, started))
    await started.wait()
    t0 = time.monotonic()
    outcome = await attack()
    t1 = time.monotonic()
    times = await task
    window_end = max(t1, t0 + 0.5)
    b, a = max_gap(base), max_gap(times, t0, window_end)
    return {"attack": name, "baseline_max_gap_s": round(b, 3), "attack_max_gap_s": round(a, 3),
            "ratio": round(a / b, 2), "answered_in_s": round(t1 - t0, 2),
            "tokens_during_attack": sum(1 for t in times if t0 <= t <= t1), "outcome": outcome[:120]}


async def main_async(args) -> list[dict]:
    from aotx.engine.model.loader import default_model_path

    home = Path(tempfile.mkdtemp(prefix="aotx-hostile-"))
    rows: list[dict] = []
    try:
        model = Path(args.model) if args.model else default_model_path()
        eng = Engine(home, model, "normal")
        await eng.wait_ready()
        try:
            r = await row("10 MB message", eng.sock, args.tokens,
                          lambda: socket_message(eng.sock, "word " * 2_000_000))
            rows.append(r | {"engine_peak_rss_mb": round(eng.peak_rss_mb())})
            gw = Gateway(home, eng.sock)
            try:
                async def eight() -> str:
                    loop = asyncio.get_running_loop()
                    with ThreadPoolExecutor(8) as pool:
                        res = await asyncio.gather(*[loop.run_in_executor(pool, gw.chat, "word " * 200_000)
                                                     for _ in range(8)])
                    codes = sorted({c for c, _ in res})
                    return f"HTTP {codes}: {res[0][1]}"

                r = await row("8 x 1 MB (gateway)", eng.sock, args.tokens, eight)
                rows.append(r | {"engine_peak_rss_mb": round(eng.peak_rss_mb())})
            finally:
                gw.stop()
        finally:
            eng.stop()
        evil = with_template(model, home / "evil.gguf", HOSTILE)
        eng = Engine(home, evil, "evil")
        await eng.wait_ready()
        try:
            r = await row("hostile template", eng.sock, args.tokens, lambda: socket_message(eng.sock, "hi"))
            rows.append(r | {"engine_peak_rss_mb": round(eng.peak_rss_mb())})
        finally:
            eng.stop()
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"logs in {home}", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| attack | baseline max gap (s) | max gap under attack (s) | ratio | answered in (s) | "
            "stream tokens meanwhile | engine peak RSS (MB) | answer |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['attack']} | {r['baseline_max_gap_s']} | {r['attack_max_gap_s']} | {r['ratio']} | "
                     f"{r['answered_in_s']} | {r['tokens_during_attack']} | {r['engine_peak_rss_mb']} | "
                     f"{r['outcome']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF to serve (default: the default model)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens of the streamed reply (default 300)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument("--keep", action="store_true", help="keep the temporary data dir (engine logs)")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
