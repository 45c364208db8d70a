"""Embeddings of the default model against llama.cpp's on the same file.

The reference (``tests/data/embeddings_smollm2_llama_cpp.json``) is llama.cpp's embedding
output (llama-cpp-python 0.3.36, ``Llama(embedding=True, pooling_type=mean|last|cls)``,
not normalized), made by ``tests/tools/make_embedding_refs.py``. AOTX's CPU backend
quantizes activations to int8 where llama.cpp uses its q8_1 blocks, so the vectors agree
to a cosine of 0.999 and a few percent in L2, not bit for bit (measured: cosine 0.9994 to
0.9999, relative L2 0.014 to 0.034).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from aotx.engine import protocol as P

REF = Path(__file__).resolve().parent / "data" / "embeddings_smollm2_llama_cpp.json"


@pytest.fixture(scope="module")
def embedder(default_model_path):
    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime.embeddings import Embedder

    ref = json.loads(REF.read_text())
    if hashlib.sha256(default_model_path.read_bytes()).hexdigest() != ref["model_sha256"]:
        pytest.skip("the installed default model is not the file the reference was made from")
    return Embedder(load_model(default_model_path, device="cpu"), 512), ref


@pytest.mark.parametrize("pooling", P.POOLINGS)
def test_pooled_embeddings_match_llama_cpp(embedder, pooling):
    e, ref = embedder
    want = ref["pooling"][pooling]
    got = e.embed(P.Embed(id=1, texts=ref["texts"], pooling=pooling, normalize=False))
    assert got.n_tokens == want["n_tokens"]
    a, b = np.asarray(got.vectors, np.float64), np.asarray(want["vectors"], np.float64)
    cos = (a @ b.T) / np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
    assert np.all(np.diag(cos) > 0.999), np.diag(cos)
    dist = np.linalg.norm(a[:, None, :] - b[None, :, :], axis=2) / np.linalg.norm(b, axis=1)[None, :]
    rel = np.diag(dist)
    assert np.all(rel < 0.05), rel
    off = dist + np.eye(len(a)) * 1e9
    # each text's vector is nearer its own reference than any other text's (with cls, every text's
    # first position is near the same attention-sink state: the others are only 3% away)
    assert np.all(rel < off.min(axis=1)), dist


def test_normalized_is_the_unit_vector_and_texts_do_not_mix(embedder):
    e, ref = embedder
    raw = e.embed(P.Embed(id=1, texts=ref["texts"][:2], normalize=False)).vectors
    unit = e.embed(P.Embed(id=1, texts=ref["texts"][:2])).vectors
    for r, u in zip(raw, unit):
        assert np.allclose(np.asarray(r) / np.linalg.norm(r), u, atol=1e-6)
    alone = e.embed(P.Embed(id=1, texts=[ref["texts"][1]])).vectors[0]
    assert np.allclose(alone, unit[1], atol=1e-6)


def test_a_text_past_the_context_is_refused_or_truncated(embedder):
    from aotx.engine.errors import RequestError

    e, _ = embedder
    long = "word " * 2000
    with pytest.raises(RequestError, match=r"texts\[0\].*past the context of 512"):
        e.embed(P.Embed(id=1, texts=[long]))
    assert e.embed(P.Embed(id=1, texts=[long], truncate=True)).n_tokens == [512]
