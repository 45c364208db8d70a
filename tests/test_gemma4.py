"""gemma4 on the CPU (the tiny file of tests/models/gemma4.py: sliding and global layers of
different head sizes, per-layer embeddings, KV shared by the last layers): the executor
against the float64 interpreter of the same Program; every row bit-identical however it
is batched (prefill chunks, decode steps, another slot's rows beside it); capsules of a
cache whose layers differ in shape, byte-exact and token-identical, a prefix of one too;
and bad files refused naming the tensor or key (a stray router among them). The
mixture-of-experts variant: tests/test_gemma4moe.py. Fidelity against llama.cpp:
tests/test_refs_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import Segment
from aotx.engine.state import capsule as C
from tests.program_reference import reference_logits
from tests.test_refs_hybrid import _build


@pytest.fixture(scope="module")
def g4(tiny_tokenizer, tmp_path_factory):
    from tests.models import gemma4

    return gemma4.write(tmp_path_factory.mktemp("g4") / "gemma4.gguf", tiny_tokenizer)


def _ids(n, seed=3):
    return np.random.default_rng(seed).integers(0, 49152, n).astype(np.int32)


def test_cpu_program_matches_the_float64_interpreter(g4):
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import gemma4
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build

    gf = GGUFFile.open(g4)
    model = build(ModelConfig.from_metadata(gf.metadata, str(g4)), gf, CpuBackend(), gemma4)
    ids = _ids(40)
    got = model.forward(ids, [Segment(0, 0, 40, all_logits=True)], model.new_kv_cache(1, 48, "f32"))
    want = reference_logits(model.program, ids, n_ctx=48)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_rows_do_not_depend_on_their_batch(g4):
    """Windows of 8 and shared KV across prefill chunks, decode steps and a batch shared
    with another slot: the bits of the whole sequence at once."""
    model = _build(g4)
    ids, other = _ids(30), _ids(12, seed=9)
    whole = model.forward(ids, [Segment(0, 0, 30, all_logits=True)], model.new_kv_cache(1, 32))
    kv = model.new_kv_cache(2, 32)
    rows = [model.forward(ids[:11], [Segment(1, 0, 11, all_logits=True)], kv)]
    for p in range(11, 14):
        toks = np.concatenate([ids[p:p + 1], other[:2 if p == 11 else 0]])
        segs = [Segment(1, p, 1)] + ([Segment(0, 0, 2, logits=False)] if p == 11 else [])
        rows.append(model.forward(toks, segs, kv))
    rows.append(model.forward(np.concatenate([other[2:5], ids[14:]]),
                              [Segment(0, 2, 3, logits=False), Segment(1, 14, 16, all_logits=True)], kv))
    assert np.array_equal(np.concatenate(rows), whole)


def test_capsules_of_layers_of_different_shapes(g4, tmp_path):
    """K and V of 2x16 and 1x32 heads in one capsule (the per-position flat layout), through
    the disk: byte-exact, greedy decode token-identical after a restore, and a prefix of
    the capsule restores as KV alone allows."""
    model = _build(g4)
    ids = list(_ids(20))
    kv = model.new_kv_cache(2, 64)

    def greedy(slot, pos, tok, n):
        out = []
        for i in range(n):
            tok = int(np.argmax(model.forward(np.asarray([tok], np.int32), [Segment(slot, pos + i, 1)], kv)[0]))
            out.append(tok)
        return out

    first = int(np.argmax(model.forward(np.asarray(ids, np.int32), [Segment(0, 0, 20)], kv)[0]))
    cap = C.snapshot(kv, 0, ids, fingerprint="g4")
    assert cap.k.shape == (1, 1, 20, 2 * 16 + 1 * 32)
    straight = greedy(0, 20, first, 12)
    C.save(cap, tmp_path / "g.caps")
    back = C.load(tmp_path / "g.caps")
    model.forward(np.asarray(_ids(30, seed=5), np.int32), [Segment(1, 0, 30)], kv)   # slot 1 busy first
    C.restore(back, kv, 1, fingerprint="g4")
    again = C.snapshot(kv, 1, ids, fingerprint="g4")
    assert again.k.tobytes() == cap.k.tobytes() and again.v.tobytes() == cap.v.tobytes()
    assert greedy(1, 20, first, 12) == straight
    # a prefix: 15 positions back, the last 5 prompt tokens fed again
    C.restore(back, kv, 1, fingerprint="g4", n=15)
    row = model.forward(np.asarray(ids[15:], np.int32), [Segment(1, 15, 5)], kv)[0]
    assert int(np.argmax(row)) == first


BAD = [
    (dict(skip=["per_layer_token_embd.weight"]), r"'per_layer_token_embd\.weight' is missing"),
    (dict(skip=["rope_freqs.weight"]), r"'rope_freqs\.weight' is missing"),
    (dict(skip=["blk.1.attn_k.weight"]), r"'blk\.1\.attn_k\.weight' is missing"),
    (dict(metadata={"gemma4.attention.key_length_swa": None}), r"'gemma4\.attention\.key_length_swa' is missing"),
    (dict(metadata={"gemma4.attention.sliding_window_pattern": [True, True, True, False]}),
     r"shared_kv_layers 2: the last layers reuse"),
    (dict(metadata={"gemma4.embedding_length_per_layer_input": None}),
     r"'gemma4\.embedding_length_per_layer_input' is missing"),
]


@pytest.mark.parametrize("defects, msg", BAD)
def test_bad_files_are_refused_naming_what_is_wrong(defects, msg, tiny_tokenizer, tmp_path):
    from tests.models import gemma4

    path = gemma4.write(tmp_path / "bad.gguf", tiny_tokenizer, **defects)
    with pytest.raises(ModelError, match=msg) as e:
        _build(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_router_without_expert_count_is_refused_by_name(g4, tmp_path):
    """A router tensor (``ffn_gate_inp``) in a file without ``expert_count`` is a variant
    AOTX does not know (the mixture-of-experts variant: tests/test_gemma4moe.py)."""
    from tests.test_qwen35 import _with_extra_tensor

    path = _with_extra_tensor(g4, tmp_path / "moe.gguf", "blk.0.ffn_gate_inp.weight", np.zeros((8, 64), np.float32))
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.ffn_gate_inp\.weight' is not part of the gemma4"):
        _build(path)


def test_the_gemma4_tokenizer_follows_llama_cpp(tmp_path):
    """tokenizer.ggml.model "gemma4" (BPE over raw UTF-8, ``▁`` spaces, ``<0xXX>`` bytes,
    newline runs looked up whole, BOS always added): a synthetic vocabulary of that kind
    (tests/models/gemma4.synthetic_vocab) tokenized and detokenized as llama.cpp does
    (tests/data/refs/hybrid/gemma4_tokenizer.json)."""
    import json
    from pathlib import Path

    from tests.models import gemma4

    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer

    path = gemma4.write(tmp_path / "vocab.gguf", gemma4.synthetic_vocab())
    tok = Tokenizer.from_metadata(GGUFFile.open(path).metadata)
    ref = json.loads((Path(__file__).resolve().parent / "data" / "refs" / "hybrid" / "gemma4_tokenizer.json")
                     .read_text(encoding="utf-8"))
    bad = []
    for s in ref["strings"]:
        for mode, parse in (("special_true", True), ("special_false", False)):
            want = s[mode]
            ids = tok.encode(s["text"], add_special=True, parse_special=parse)
            if ids != want["ids"]:
                bad.append(f"{s['name']} {mode}: {ids} != llama.cpp {want['ids']}")
            for unparse, skip in (("true", False), ("false", True)):
                got = tok.decode(want["ids"], skip_special=skip)
                if got != want[f"llama_detokenize_special_{unparse}"]:
                    bad.append(f"{s['name']} {mode} decode(skip_special={skip}): {got!r} != "
                               f"{want[f'llama_detokenize_special_{unparse}']!r}")
    assert not bad, "\n".join(bad)
