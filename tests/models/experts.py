"""Expert tensors for the tiny mixture-of-experts writers (``qwen3moe``, ``olmoe``,
``gptoss``): E random matrices stacked into one 3-D tensor as llama.cpp's converters write
them (numpy shape (E, out, in) -> ggml {in, out, E}), and per-expert biases ((E, n) ->
ggml {n, E}).

The values come from the writer's one seeded generator (``TinyWriter.rng``) in call
order, expert by expert, like every other tensor of the tiny files, and honour its
``types`` / ``skip`` / ``shapes`` defects (a skipped tensor is still drawn).
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import TinyWriter, random_matrix


def experts(tw: TinyWriter, name: str, n_expert: int, out: int, inp: int, qtype: T,
            std: float | None = None) -> None:
    """A stack of ``n_expert`` (out, inp) matrices of ``qtype`` (entries of std ``std``,
    default 1/sqrt(inp)) as the 3-D tensor ``name``. ``tw.shapes[name]`` may give
    (E, out, inp) instead."""
    qtype = tw.type_of(name, qtype)
    E, out, inp = tw.shapes.get(name, (n_expert, out, inp))
    s = std if std is not None else 1.0 / math.sqrt(inp)
    parts = [random_matrix(qtype, out, inp, tw.rng, s) for _ in range(E)]
    if name in tw.skip:
        return
    raw = parts[0][1]
    arr = np.stack([p[0] for p in parts])
    tw.counts[qtype] += E * out * inp
    tw.w.add_tensor(name, arr, raw_dtype=raw)


def expert_bias(tw: TinyWriter, name: str, n_expert: int, n: int, std: float = 0.1) -> None:
    """One float32 bias of length ``n`` per expert: numpy (E, n), ggml {n, E}."""
    shape = tw.shapes.get(name, (n_expert, n))
    arr = (std * tw.rng.standard_normal(shape)).astype(np.float32)
    if name not in tw.skip:
        tw.w.add_tensor(name, arr)
