"""The host sampler's logit bias and frequency/presence penalties against llama.cpp's
definition, computed in float64 numpy here (``llama_sampler_penalties_apply``: for each
distinct id of the last ``penalty_last_n`` tokens, the repetition penalty, then minus
``count * freq + present``; the logit bias added first)."""

from __future__ import annotations

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, apply_penalties, sample


def _reference(logits, history, rep, freq, pres, last_n, bias):
    x = logits.astype(np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    win = history[-last_n:] if last_n > 0 else list(history)
    for t in set(win):
        c = win.count(t)
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] -= c * freq + (c > 0) * pres
    return x


@pytest.mark.parametrize("seed", range(6))
def test_penalties_and_bias_equal_llama_cpps_definition(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, 200).astype(np.float32)
    history = list(rng.integers(0, 200, 40))
    sp = P.SamplingParams(repeat_penalty=float(rng.uniform(1, 1.5)), frequency_penalty=float(rng.uniform(-2, 2)),
                          presence_penalty=float(rng.uniform(-2, 2)), repeat_last_n=int(rng.integers(1, 50)),
                          logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, 200, 5)})
    cfg = SamplerConfig.of(sp)
    got = logits.copy()
    apply_penalties(got, history, cfg)
    want = _reference(logits, history, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty,
                      sp.repeat_last_n, sp.logit_bias)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert cfg.host_only and SamplerConfig.of(P.SamplingParams()).host_only is False


def test_greedy_takes_the_biased_token_and_a_penalty_moves_it():
    logits = np.array([1.0, 5.0, 4.9, 0.0], np.float32)
    st = SamplerState(seed=1)
    assert sample(logits.copy(), SamplerConfig.of(P.SamplingParams(temperature=0)), st) == 1
    banned = SamplerConfig.of(P.SamplingParams(temperature=0, logit_bias={1: -100}))
    assert sample(logits.copy(), banned, SamplerState(seed=1)) == 2
    pres = SamplerConfig.of(P.SamplingParams(temperature=0, repeat_penalty=1.0, presence_penalty=0.5))
    assert sample(logits.copy(), pres, SamplerState(seed=1, history=[1])) == 2


@pytest.mark.parametrize("sp,word", [
    (P.SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
    (P.SamplingParams(logit_bias={3: 101.0}), "logit_bias[3]"),
    (P.SamplingParams(logit_bias={-1: 1.0}), "token id"),
])
def test_out_of_range_values_are_refused(sp, word):
    assert word in P.sampling_problem(sp)
