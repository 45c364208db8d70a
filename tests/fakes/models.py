"""Model doubles for engine tests: a loaded model wrapped to declare, or hide, device sampling.

The model interface the runtime calls (engine/model/interface.py): ``device_path`` says whether
``sample(tokens, segments, kv, rows, tick)`` and ``greedy(tokens, segments, kv)``
exist ("device-sampling"); they return ids only (the CUDA model). ``HostDeviceSampler``
gives a CPU model that contract, picking ids by the host's own sampler chain on its
logits and accepting the rows the CUDA sampler accepts, so the engine's device path runs
on any machine; ``HostOnly`` hides it.
"""

from __future__ import annotations

import numpy as np

from aotx.engine.runtime.sampling import SamplerState, sample


class ModelProxy:
    """Wraps a loaded model: every attribute it does not define is the model's."""

    def __init__(self, model):
        self._m = model

    def __getattr__(self, name):
        return getattr(self._m, name)


def host_chain(logits: np.ndarray, rows: list | None) -> np.ndarray:
    """The ids the CUDA model's ``sample(rows)`` returns for (R, vocab) ``logits``: each
    row through ``sampling.sample`` on a copy of its state (the caller mirrors the draws);
    ``rows`` None is greedy everywhere."""
    out = []
    for i in range(logits.shape[0]):
        if rows is None:
            out.append(int(np.argmax(logits[i])))
            continue
        cfg, st, extra = rows[i]
        st2 = SamplerState(st.seed, st.step, list(st.history) + list(extra))
        out.append(sample(logits[i].copy(), cfg, st2))
    return np.asarray(out, np.int32)


class HostDeviceSampler(ModelProxy):
    """A model with the device-sampling contract, its ids picked on the host; it takes the
    rows the CUDA sampler takes (``cuda_sampling.device_ok``, ``fits_history``)."""

    device_path = "device-sampling"

    def samples_exactly(self, cfg, state, n_drafts=0):
        from aotx.engine.backend.cuda.sampling import device_ok, fits_history

        return device_ok(cfg, n_drafts) and fits_history(cfg, state)

    def greedy(self, tokens, segments, kv):
        return self.sample(tokens, segments, kv, None)

    def sample(self, tokens, segments, kv, rows, tick=0):
        return host_chain(self._m.forward(tokens, segments, kv), rows)


class HostOnly(ModelProxy):
    """Hides device sampling: logits come back and the engine samples on the host."""

    device_path = "host"
