"""Embeddings, tokenization and detokenization of a loaded model: the engine's answers to
``Embed``, ``Tokenize`` and ``Detokenize``.

Owns: the hidden-state program of a model (its traced forward cut after the output
norm, ``result_norm``: the (rows, d_model) state llama.cpp's ``--embeddings`` pools,
compiled once by the model's backend on first use), running it over each text in a
scratch KV cache of its own (one slot, sized to the text: the slots and KV of the
conversations are never touched), the pooling (llama.cpp's mean, last, cls) and the L2
normalization; and the tokenizer's encode / decode for ``/tokenize`` and
``/detokenize``. Leaves the forward to the model and its backend, and routing to
``engine.py``.

Runs on the engine thread, between ticks (an embedding of a few hundred tokens on the
default model takes milliseconds; the numba pool belongs to that thread). The scratch
KV is not counted by admission: it lives for one call and is sized to the text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aotx.engine import protocol as P
from aotx.engine.backend.ops import Node, Program, Value
from aotx.engine.errors import RequestError
from aotx.engine.model.batch import Segment

HIDDEN = "result_norm"  # the name every architecture gives the output norm (common.output_head)


def hidden_program(program: Program) -> Program:
    """``program`` cut after its output norm: (R, d_model) hidden states instead of logits.
    A scale by 1 makes the output (the CPU executor writes a program's output into a
    fresh array, which a norm does not). Raises RequestError when there is no output norm."""
    at = next((i for i, n in enumerate(program.nodes) if n.out.name == HIDDEN), None)
    if at is None:
        raise RequestError("this model's forward has no output norm to take embeddings from")
    src = program.nodes[at].out
    out = Value(len(program.values), src.rows, src.width, "embeddings")
    nodes = (*program.nodes[:at + 1], Node("scale", (src,), (out,), {"s": 1.0}))
    return Program(nodes, (*program.values, out), out, program.d_model, program.kv_layers)


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One (d,) float64 vector from a text's (n, d) hidden states: "mean" of every row,
    "last" row or "cls" (the first row), as llama.cpp's pooling types."""
    if pooling == "mean":
        return rows.astype(np.float64).mean(axis=0)
    if pooling == "last":
        return rows[-1].astype(np.float64)
    if pooling == "cls":
        return rows[0].astype(np.float64)
    raise RequestError(f"pooling {pooling!r}: use {', '.join(P.POOLINGS)}")


class Embedder:
    """The embeddings of one loaded model (``lm``: a ``loader.LoadedModel``) with a
    context of ``n_ctx`` tokens. The hidden-state program is compiled on first use."""

    def __init__(self, lm: Any, n_ctx: int, kv_type: str = "f16"):
        self.lm = lm
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self._compiled: Any = None

    def _program(self) -> Any:
        if self._compiled is None:
            model = self.lm.model
            try:
                self._compiled = model.backend.compile(hidden_program(model.program))
            except (ValueError, NotImplementedError) as e:  # a backend that cannot run it
                raise RequestError(f"embeddings are not available for {self.lm.name} on this backend ({e})") from None
        return self._compiled

    def tokens(self, text: str, truncate: bool, where: str) -> list[int]:
        """The text's ids with the model's BOS/EOS. Raises RequestError past the context
        (unless ``truncate``: then its first ``n_ctx`` ids)."""
        ids = self.lm.tokenizer.encode(text, add_special=True, parse_special=False)
        if not ids:
            raise RequestError(f"{where}: the text has no tokens")
        if len(ids) > self.n_ctx:
            if not truncate:
                raise RequestError(f"{where}: the text is {len(ids):,} tokens, past the context of {self.n_ctx:,}; "
                                   "shorten it (or ask for truncation)")
            ids = ids[:self.n_ctx]
        return ids

    def embed(self, op: P.Embed) -> P.Embeddings:
        ids = [self.tokens(t, op.truncate, f"texts[{i}]") for i, t in enumerate(op.texts)]
        prog = self._program()
        kv = self.lm.model.new_kv_cache(1, max(map(len, ids)), self.kv_type)
        vectors: list[list[float]] = []
        for t in ids:
            kv.clear(0, 0, kv.n_ctx)
            layout = _layout([Segment(0, 0, len(t), all_logits=True)])
            rows = np.asarray(prog.forward(np.asarray(t, np.int32), layout, kv, None))
            v = pool(rows, op.pooling)
            if op.normalize:
                norm = float(np.linalg.norm(v))
                v = v / norm if norm > 0 else v
            vectors.append([float(x) for x in v.astype(np.float32)])
        return P.Embeddings(id=op.id, vectors=vectors, n_tokens=[len(t) for t in ids], model=self.lm.name)


def _layout(segments: list[Segment]) -> Any:
    from aotx.engine.model.batch import BatchLayout

    return BatchLayout.of(segments)


def tokenize(lm: Any, op: P.Tokenize) -> P.TokenList:
    tok = lm.tokenizer
    ids = tok.encode(op.text, add_special=op.add_special, parse_special=op.parse_special)
    return P.TokenList(id=op.id, ids=ids, pieces=[tok.token_bytes(i) for i in ids], model=lm.name)


def detokenize(lm: Any, op: P.Detokenize) -> P.Detokenized:
    tok = lm.tokenizer
    bad = next((i for i, t in enumerate(op.ids) if t >= tok.vocab_size), None)
    if bad is not None:
        raise RequestError(f"ids[{bad}] is {op.ids[bad]}, past the vocabulary of {tok.vocab_size:,} tokens")
    return P.Detokenized(id=op.id, text=tok.decode(op.ids), model=lm.name)
