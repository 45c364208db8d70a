"""The bits of the CUDA backend's logits, printed as sha256 per configuration, to compare two
trees on one GPU (tests/tools/gpu_reshape_check.sh runs it on the tree before a reshaping
commit and on the tree after it; the same lines mean the same bits).

``python tests/tools/gpu_bits.py write DIR``: writes the test models into DIR with this
tree's writers (tests/models), so both trees read the same files. ``python
tests/tools/gpu_bits.py run DIR [--fake]``: with whichever ``aotx`` the PYTHONPATH names
(run as a file, the ``run`` step imports nothing of ``tests``), builds each configuration on
the CUDA backend, runs fixed token sequences through prefill (eager: 4 slots of 40 rows per
batch, past the graphs' 128 rows) and greedy decode ticks through the captured graphs at
buckets of 1, 3 (bucket 4) and 8 rows, and prints ``<config> <sha256>`` of every logits row
and id in order (then a line ``bits done``). ``--fake``: on ``gpu_fake_cupy`` (no GPU: the
numbers are garbage, the paths run; the CPU test suite's smoke test).

Configurations: llama with the default model's mix (Q4_1 layers, Q8_0 tied embedding) in
float32 activations; a Q4_K_M-like llama (Q4_K, Q6_K V/down/output) and a Q8_0 / Q4_0 / Q5_K
/ IQ4_NL llama with int8 activations (``int8_min_bytes=0``: the engine's numerics on big
models); qwen3moe (experts on the CPU tier: the host step; and every expert on the GPU tier:
the device step, inside the graph); gemma3 (its sliding window, post-norms, GEGLU, QK-norm).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

VOCAB = 512
SLOTS = 8
#: config -> (model file, CudaBackend keyword arguments, expert placement or None)
CONFIGS = {
    "llama-q4_1-f32": ("llama_q41.gguf", {}, None),
    "llama-q4_k_m-int8": ("llama_q4km.gguf", {"int8_activations": True, "int8_min_bytes": 0}, None),
    "llama-mixed-int8": ("llama_mixed.gguf", {"int8_activations": True, "int8_min_bytes": 0}, None),
    "llama-mixed-f32-kv32": ("llama_mixed.gguf", {}, None),
    "qwen3moe-host-step": ("qwen3moe.gguf", {}, "host"),
    "qwen3moe-device-step": ("qwen3moe.gguf", {}, "gpu"),
    "gemma3-f32": ("gemma3.gguf", {}, None),
    "gemma3-int8": ("gemma3.gguf", {"int8_activations": True, "int8_min_bytes": 0}, None),
}


def write(d: Path) -> None:
    """The models of ``CONFIGS`` (this tree's writers, fixed seeds: the same bytes every run)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType as V

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import models as tm
    from tests.models.cuda_testmodel import write_llama

    d.mkdir(parents=True, exist_ok=True)
    write_llama(d / "llama_q41.gguf", n_layers=2, d_model=192, n_heads=3, n_kv_heads=1, ffn=512, vocab=VOCAB,
                qtype=T.Q4_1, emb_qtype=T.Q8_0, seed=5)
    write_llama(d / "llama_q4km.gguf", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn=768, vocab=VOCAB,
                qtype=T.Q4_K, emb_qtype=T.Q4_K, out_qtype=T.Q6_K,
                layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}, seed=6)
    write_llama(d / "llama_mixed.gguf", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=VOCAB,
                qtype=T.Q8_0, emb_qtype=T.Q4_0, out_qtype=T.Q5_K,
                layer_types={"attn_q.weight": T.IQ4_NL, "ffn_up.weight": T.Q4_0}, seed=7)
    toks = tuple(f"t{i}" for i in range(VOCAB))
    tok = tm.common.Tokenizer((("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
                               ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY)), VOCAB)
    tm.qwen3moe.write(d / "qwen3moe.gguf", tok)
    tm.gemma3.write(d / "gemma3.gguf", tok)
    for p in sorted(d.glob("*.gguf")):
        print(p.name, hashlib.sha256(p.read_bytes()).hexdigest()[:16])


def _backend(**kw):
    try:
        from aotx.engine.backend.cuda.backend import CudaBackend       # engine/backend/cuda/ (a package)
    except ModuleNotFoundError:
        from aotx.engine.backend.cuda import CudaBackend               # engine/backend/cuda.py (before it)
    return CudaBackend(**kw)


def _build(path: Path, kw: dict, placement):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    m = build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, _backend(**kw))
    if placement is not None:
        from aotx.engine.model import experts as X

        tiers = tuple(tuple([placement] * L.n_expert) for L in X.moe_layers(m.program))
        m.compiled.place_experts(X.Plan(tiers))
    return m


def _run(m, kv_type: str) -> str:
    """sha256 of every logits row and id of the fixed sequence (module docstring)."""
    import cupy as cp

    from aotx.engine.model.batch import Segment

    h = hashlib.sha256()
    vocab = int(m.cfg.vocab_size)

    def add(a) -> None:
        a = np.ascontiguousarray(cp.asnumpy(a) if not isinstance(a, np.ndarray) else a)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())

    rng = np.random.default_rng(1234)
    kv = m.new_kv_cache(SLOTS, 128, kv_type)
    prompts = rng.integers(0, min(vocab, VOCAB), (SLOTS, 40)).astype(np.int32)
    for s in range(0, SLOTS, 4):           # four slots per batch: 160 rows, past the graphs' 128 (eager)
        out = m.forward(prompts[s:s + 4].reshape(-1), [Segment(s + j, 0, 40) for j in range(4)], kv)
        add(out)
    pos = [40] * SLOTS
    cur = prompts[:, -1].copy()
    for rows in (1, 3, 8, 1, 8):           # graph buckets 1, 4, 8
        segs = [Segment(s, pos[s], 1) for s in range(rows)]
        ids = m.greedy(cur[:rows].copy(), segs, kv)
        add(m.last_logits())
        add(np.asarray(ids, np.int32))
        for s in range(rows):
            cur[s] = int(ids[s]) % vocab
            pos[s] += 1
    # a verify-like window of 5 rows of one slot through the graph, all logits
    out = m.forward(cur[:5].copy(), [Segment(0, pos[0], 5, all_logits=True)], kv)
    add(out)
    return h.hexdigest()


def run(d: Path, fake: bool) -> int:
    if fake:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_fake_cupy

        gpu_fake_cupy.install()
    for name, (fname, kw, placement) in CONFIGS.items():
        kv_type = "f32" if name.endswith("kv32") else "f16"
        try:
            m = _build(d / fname, dict(kw), placement)
            print(f"{name} {_run(m, kv_type)}", flush=True)
        except Exception as e:  # noqa: BLE001 - one configuration's failure is a line, not the run's end
            print(f"{name} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    print("bits done", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("write", "run"):
        print("usage: gpu_bits.py write DIR | run DIR [--fake]", file=sys.stderr)
        return 2
    d = Path(argv[1])
    if argv[0] == "write":
        write(d)
        return 0
    return run(d, "--fake" in argv[2:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
