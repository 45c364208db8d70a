#!/usr/bin/env python3
"""Where does a Gemma 3 forward stand against llama.cpp's chat references? (issue 14; never
run by the tests.)

Three sources of logits for the teacher-forced rows of ``tests/data/refs/gemma3/chat_refs.json``
(the rows ``tests/refcheck.py`` compares), each saved to an ``.npz``, then compared pairwise:

* ``llama``  (run with llama-cpp-python's venv): llama.cpp with the references' settings, twice:
  ``inc`` = the way the references were made (the prompt in one eval, then one token per eval)
  and ``tf`` = the same tokens in one eval (teacher-forced, as refcheck feeds AOTX);
* ``exact``  (any venv with numpy + gguf): an independent float64 numpy forward of Gemma 3
  written from the Hugging Face modelling code (weights dequantized by gguf-py), the
  arithmetic an ideal port would do;
* ``aotx``   (the project's venv): AOTX's forward (``load_model`` on ``--device``).

    /work/coord/llama-venv/bin/python tests/tools/gemma3_check.py llama --model M --out /tmp/g3
    .venv/bin/python tests/tools/gemma3_check.py exact --model M --out /tmp/g3
    .venv/bin/python tests/tools/gemma3_check.py aotx  --model M --out /tmp/g3
    .venv/bin/python tests/tools/gemma3_check.py report --out /tmp/g3

``report`` prints, for every pair, the mean |logit difference| on the reference top-5 ids of
every row (refcheck's number), the mean over the whole vocabulary, and the rows whose argmax
differs where the reference gap is >= 0.5 (refcheck's strict rows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "tests" / "data" / "refs" / "gemma3" / "chat_refs.json"


def _cases():
    sys.path.insert(0, str(ROOT))
    from tests import refcheck

    return refcheck.cases(json.loads(REF.read_text(encoding="utf-8")))


def _rows(case, logits):
    return np.asarray(logits[case.first_row:case.first_row + len(case.top)], np.float32)


def run_llama(args) -> None:
    from llama_cpp import Llama

    method = json.loads(REF.read_text(encoding="utf-8"))["method"]
    m = Llama(model_path=args.model, n_ctx=method["n_ctx"], n_batch=method["n_batch"], n_ubatch=method["n_ubatch"],
              n_threads=method["n_threads"], seed=method["seed"], flash_attn=method["flash_attn"], logits_all=True,
              verbose=False)
    inc, tf = {}, {}
    for c in _cases():
        ids = [int(t) for t in c.ids]
        m.reset()
        m.eval(ids[:c.first_row + 1])
        for t in ids[c.first_row + 1:]:
            m.eval([t])
        inc[c.name] = _rows(c, np.array(m.scores[:len(ids)]))
        m.reset()
        m.eval(ids)
        tf[c.name] = _rows(c, np.array(m.scores[:len(ids)]))
        print(c.name, "done", flush=True)
    np.savez(Path(args.out) / "llama_inc.npz", **inc)
    np.savez(Path(args.out) / "llama_tf.npz", **tf)


class Exact:
    """Gemma 3 (text) in float64 numpy, after transformers' modeling_gemma3 (Gemma3TextModel):
    scaled embedding, pre/post sublayer RMS norms, per-head q/k RMS norms, NEOX rotary with
    the local base (10000) on sliding layers and rope.freq_base on every 6th, query scaled by
    query_pre_attn_scalar**-0.5 (= head_dim for all but the 27B), sliding causal window,
    gelu_pytorch_tanh gated FFN, tied output head. The GGUF's norm weights already hold 1 + w."""

    def __init__(self, path: str, emulate: bool = False):
        import gguf

        self.emulate = emulate
        self.types = {}

        r = gguf.GGUFReader(path)
        f = {k: v.contents() for k, v in r.fields.items() if k.startswith("gemma3.")}
        self.d = int(f["gemma3.embedding_length"])
        self.n_layer = int(f["gemma3.block_count"])
        self.n_head = int(f["gemma3.attention.head_count"])
        self.n_kv = int(f["gemma3.attention.head_count_kv"])
        self.hd = int(f["gemma3.attention.key_length"])
        self.eps = float(f["gemma3.attention.layer_norm_rms_epsilon"])
        self.base = float(f.get("gemma3.rope.freq_base", 1e6))
        self.base_swa = float(f.get("gemma3.rope.freq_base_swa", 10000.0))
        self.window = int(f.get("gemma3.attention.sliding_window", 0))
        self.w = {}
        for t in r.tensors:
            self.types[t.name] = t.tensor_type.name
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            a = a.reshape(tuple(int(x) for x in reversed(t.shape)))   # (rows = ne1, ne0)
            self.w[t.name] = a.astype(np.float32 if t.name == "token_embd.weight" else np.float64)

    def _f16(self, x):
        return x.astype(np.float16).astype(np.float64) if self.emulate else x

    def _qx(self, x, wtype: str):
        """x as llama.cpp's CPU rounds it before a dot product with weights of ``wtype``
        (ggml's vec_dot_type): Q8_K (256-blocks) for k-quants, Q8_0 (32-blocks, float16
        scale) for the others (Q5_0, Q8_0, ...). Unchanged unless emulating."""
        if not self.emulate:
            return x
        blk = 256 if wtype.endswith("_K") else 32
        xs = x.reshape(-1, blk)
        d = np.abs(xs).max(axis=1, keepdims=True) / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        q = np.clip(np.round(xs * inv), -127, 127)
        if blk == 32:
            d = d.astype(np.float16).astype(np.float64)
        return (q * d).reshape(x.shape)

    def _mm(self, x, name):
        return self._qx(x, self.types[name]) @ self.w[name].T

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos, base):  # x (n, h, hd), NEOX halves
        half = self.hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.hd)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def forward(self, ids, rows):
        W, n = self.w, len(ids)
        pos = np.arange(n)
        x = W["token_embd.weight"][np.asarray(ids)].astype(np.float64) * math.sqrt(self.d)
        gelu = lambda g: 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
        causal = pos[None, :] <= pos[:, None]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            swa = self.window > 0 and (i + 1) % 6 != 0
            mask = causal & ((pos[:, None] - pos[None, :] < self.window) if swa else True)
            h = self._norm(x, W[p + "attn_norm.weight"])
            q = self._mm(h, p + "attn_q.weight").reshape(n, self.n_head, self.hd)
            k = self._mm(h, p + "attn_k.weight").reshape(n, self.n_kv, self.hd)
            v = self._f16(self._mm(h, p + "attn_v.weight").reshape(n, self.n_kv, self.hd))
            q = self._rope(self._norm(q, W[p + "attn_q_norm.weight"]), pos, self.base_swa if swa else self.base)
            k = self._rope(self._norm(k, W[p + "attn_k_norm.weight"]), pos, self.base_swa if swa else self.base)
            k = self._f16(k)                               # the float16 KV cache
            q = self._f16(q / math.sqrt(self.hd))          # ggml converts Q to K's type for K.Q
            g = self.n_head // self.n_kv
            out = np.empty((n, self.n_head, self.hd))
            for hh in range(self.n_head):
                s = q[:, hh] @ k[:, hh // g].T
                s = np.where(mask, s, -np.inf)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                out[:, hh] = self._f16(s / s.sum(axis=1, keepdims=True)) @ v[:, hh // g]
            a = self._mm(out.reshape(n, -1), p + "attn_output.weight")
            x = x + self._norm(a, W[p + "post_attention_norm.weight"])
            h = self._norm(x, W[p + "ffn_norm.weight"])
            gate = self._f16(gelu(self._f16(self._mm(h, p + "ffn_gate.weight"))))   # ggml's float16 GELU table
            f = self._mm(gate * self._mm(h, p + "ffn_up.weight"), p + "ffn_down.weight")
            x = x + self._norm(f, W[p + "post_ffw_norm.weight"])
        x = self._norm(x[rows], W["output_norm.weight"])
        emb = W["token_embd.weight"]
        out = np.empty((len(x), emb.shape[0]), np.float64)
        x = self._qx(x, self.types["token_embd.weight"])
        for s in range(0, emb.shape[0], 32768):
            out[:, s:s + 32768] = x @ emb[s:s + 32768].astype(np.float64).T
        return out


def run_exact(args) -> None:
    ex = Exact(args.model, emulate=args.emulate)
    res = {}
    for c in _cases():
        rows = np.arange(c.first_row, c.first_row + len(c.top))
        res[c.name] = ex.forward(c.ids, rows).astype(np.float32)
        print(c.name, "done", flush=True)
    np.savez(Path(args.out) / ("exact_emulated.npz" if args.emulate else "exact.npz"), **res)


def run_aotx(args) -> None:
    sys.path.insert(0, str(ROOT))
    from aotx.engine.model.loader import load_model
    from tests import refcheck

    fwd = refcheck.model_forward(load_model(args.model, device=args.device))
    res = {}
    for c in _cases():
        res[c.name] = _rows(c, fwd(np.asarray(c.ids, np.int32)))
        print(c.name, "done", flush=True)
    np.savez(Path(args.out) / f"aotx_{args.device}.npz", **res)


def report(args) -> None:
    out = Path(args.out)
    srcs = {"ref": None}
    for f in sorted(out.glob("*.npz")):
        srcs[f.stem] = np.load(f)
    cases = _cases()
    names = list(srcs)

    def rows_of(src, c):
        if src == "ref":
            return None
        return srcs[src][c.name]

    print(f"{'pair':34s} {'top5 mad':>9s} {'top5 max':>9s} {'vocab mad':>10s}  strict argmax mismatches")
    for ia, a in enumerate(names):
        for b in names[ia + 1:]:
            top, full, mism, mx = [], [], [], 0.0
            for c in cases:
                rb = rows_of(b, c)
                ra = rows_of(a, c)
                for r, (t, gap) in enumerate(zip(c.top, c.gap)):
                    ids = [i for i, _ in t]
                    va = np.array([v for _, v in t]) if ra is None else ra[r][ids]
                    vb = rb[r][ids]
                    d = np.abs(va - vb)
                    top.extend(d)
                    mx = max(mx, float(d.max()))
                    am_a = t[0][0] if ra is None else int(np.argmax(ra[r]))
                    am_b = int(np.argmax(rb[r]))
                    if ra is not None:
                        full.append(float(np.mean(np.abs(ra[r].astype(np.float64) - rb[r]))))
                    if gap >= 0.5 and am_a != am_b:
                        mism.append(f"{c.name}:{c.first_row + r}")
            fm = f"{np.mean(full):10.4f}" if full else f"{'-':>10s}"
            print(f"{a + ' vs ' + b:34s} {np.mean(top):9.4f} {mx:9.3f} {fm}  {len(mism)} {' '.join(mism[:6])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["llama", "exact", "aotx", "report"])
    ap.add_argument("--model", default="/work/coord/models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", default="/tmp/gemma3_check")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--emulate", action="store_true",
                    help="exact: round as llama.cpp's CPU does (int8 activations per block for quantized "
                         "weights, float16 K/V cache, Q and softmax weights, float16 GELU table)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"llama": run_llama, "exact": run_exact, "aotx": run_aotx, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
