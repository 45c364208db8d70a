"""Sampling on the GPU: the sampler chain of ``runtime/sampling.py`` as one CUDA kernel.

Owns: the ``sample_rows`` kernel, the per-row sampler table it reads (the "device
tables" of DESIGN.md: sampling parameters, RNG key and counter, penalty
history), the publication records it writes, and the host helpers that fill the
table from a request's ``SamplerConfig`` / ``SamplerState`` (the runtime's objects, read by
attribute: a backend does not import the runtime). Leaves the order of
launches and the CUDA graph to ``program.py``, the kernel itself to
``kernels/sampling.cu``, and the bookkeeping of the sampler
state (step counter, history) to the runtime, which mirrors what the kernel did.

The chain is the host's, step for step (llama.cpp's default order, common/sampling.cpp):
repetition penalty on the distinct ids of the row's history (float32, in place, so the
logits then match the host's), then greedy argmax (ties to the lowest id) or: top-k by
radix select over order-preserving integer keys (4 passes of 8 bits) and a bitonic
sort of the k candidates by (logit descending, id ascending); probabilities at
temperature 1 in float64 for top-p (cumulative < top_p, plus one) and min-p
(p >= min_p * p_max); temperature; a draw with ``u`` from Philox4x64-10 keyed by
the request's seed at counter ``step + 1``, word 0, ``(x >> 11) * 2^-53``: exactly
``numpy.random.Generator(Philox(key=seed, counter=step)).random()`` (Salmon et al.
2011; numpy's ``_philox.pyx`` increments the counter before each block), so the
device and the host draw the same number for the same (seed, step). The float64
sums run sequentially in one thread; numpy sums pairwise, so a draw that lands
within a few ulps of a cumulative boundary may pick the neighbour: measure zero in
practice, and the tests compare thousands of draws.

A constrained row (the runtime's grammar state, ``runtime/constraints.py``) brings a token
bitmask: ``MaskTable.load`` copies the tick's masks to a device table and each row's
sampler-table words 16-17 hold the device address of its mask (0: none; ``fill_row`` reads
``mask_ptr`` from the row's state). The kernel first sets every logit the mask forbids to
-inf, then runs the chain unchanged: greedy picks the best allowed id, sampling draws among
allowed ones only, exactly as ``sampling.apply_mask`` does on the host. The address lives in
the table (uploaded every replay), not in the kernel's arguments, so captured graphs need
no change.

Limits (the runtime falls back to host sampling): top-k between 1 and ``K_MAX``
(1024) when sampling; a penalty window of at most ``H_MAX`` (256) tokens (staged in the
kernel's shared memory; each distinct id is penalized once, at its first place in the
window, whatever the vocabulary's size).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from aotx.engine.backend.cuda import source

# the runtime's sampling.SamplerConfig (frozen: temperature, top_k, top_p, min_p,
# repeat_penalty, repeat_last_n) and SamplerState (seed, step, history)
SamplerConfig = SamplerState = Any

K_MAX = 1024      # most top-k candidates the kernel sorts
H_MAX = 256       # most penalty-history tokens per row
P_WORDS = 18      # int32 words of one row of the sampler table (16, 17: the row's mask address)
REC_WORDS = 4     # int32 words of one publication record: tick, slot, position, token

MODE_SKIP, MODE_GREEDY, MODE_SAMPLE = 0, 1, 2

#: the sampler module's source (``kernels/sampling.cu``, as NVRTC gets it)
SRC = source.SAMPLING.text


def device_ok(cfg: SamplerConfig, n_drafts: int = 0) -> bool:
    """Whether ``sample_rows`` computes exactly what ``sampling.sample`` would for a row
    of this request (else the runtime samples on the host from copied logits)."""
    if cfg.temperature <= 0.0:
        return n_drafts == 0 or cfg.repeat_penalty == 1.0
    if n_drafts:
        return False          # speculative sampling's acceptance runs on the host
    return 0 < cfg.top_k <= K_MAX and (cfg.repeat_penalty == 1.0 or 0 <= cfg.repeat_last_n)


@functools.lru_cache(maxsize=512)
def _template(cfg: SamplerConfig) -> np.ndarray:
    """The request-constant words of a sampler-table row for ``cfg`` (read-only)."""
    prm = np.zeros(P_WORDS, np.int32)
    f = prm.view(np.float32)
    penalty = cfg.repeat_penalty != 1.0 and cfg.repeat_last_n != 0
    f[4] = np.float32(cfg.repeat_penalty if penalty else 1.0)
    if cfg.temperature <= 0.0:
        prm[0] = MODE_GREEDY
    else:
        prm[0] = MODE_SAMPLE
        prm[1] = cfg.top_k
        prm[6:12].view(np.float64)[:] = (cfg.temperature, cfg.top_p, cfg.min_p)
    prm.setflags(write=False)
    return prm


def fill_row(prm: np.ndarray, hist: np.ndarray, cfg: SamplerConfig | None, st: SamplerState | None,
             tick: int, extra_history=()) -> bool:
    """Write one row of the sampler table: ``prm`` (P_WORDS,) int32 view, ``hist`` (H_MAX,)
    int32 view. ``cfg`` None marks a row without output (skip). ``extra_history``: tokens
    already accepted in this tick before the row (greedy verify windows). Returns whether
    the row needs the history table (penalty on). Raises ValueError when the distinct
    penalty ids do not fit ``H_MAX`` (``fits_history`` says so beforehand)."""
    if cfg is None:
        prm[:] = 0
        return False
    prm[:] = _template(cfg)
    prm[3] = tick & 0x7FFFFFFF
    if prm[0] == MODE_SAMPLE:
        prm[12:16].view(np.uint64)[:] = (st.seed & ((1 << 64) - 1), st.step)
    mask_ptr = getattr(st, "mask_ptr", 0)
    if mask_ptr:
        prm[16:18].view(np.uint64)[0] = mask_ptr
    if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0:
        return False
    h = st.history[-cfg.repeat_last_n:] if cfg.repeat_last_n > 0 else st.history
    if extra_history:
        h = list(h) + list(extra_history)
        if cfg.repeat_last_n > 0:
            h = h[-cfg.repeat_last_n:]
    if len(h) > H_MAX:
        raise ValueError(f"a penalty window of {len(h)} tokens (the device table holds {H_MAX})")
    prm[2] = len(h)
    hist[:len(h)] = h
    return True


class MaskTable:
    """The device table of token bitmasks for one tick's constrained rows (grown as
    needed), with a pinned host mirror. ``load`` copies masks in and returns each row's
    device address for ``fill_row`` (``mask_ptr`` of the row's state). The copy is
    synchronous (pinned source): it is complete before the tick's graph or kernels
    launch, on whichever stream they run, and no earlier tick still reads the table (the
    model synchronizes at the end of every call)."""

    def __init__(self, vocab: int, rows: int = 64):
        self.words = (vocab + 31) // 32
        self.rows = 0
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        import cupy as cp

        self.rows = rows
        self.dev = cp.zeros((rows, self.words), cp.int32)
        mem = cp.cuda.alloc_pinned_memory(rows * self.words * 4)
        self.host = np.frombuffer(mem, np.int32, rows * self.words).reshape(rows, self.words)

    @property
    def nbytes(self) -> int:
        return int(self.dev.nbytes)

    def load(self, masks: np.ndarray) -> list[int]:
        """Copy (n, words) int32 masks to the device; the device address of each row."""
        import cupy as cp

        n = int(masks.shape[0])
        if masks.shape[1] != self.words:
            raise ValueError(f"masks of {masks.shape[1]} words for a table of {self.words}")
        if n > self.rows:
            r = self.rows
            while r < n:
                r *= 2
            self._grow(r)
        self.host[:n] = masks
        cp.cuda.runtime.memcpy(self.dev.data.ptr, self.host.ctypes.data, n * self.words * 4,
                               cp.cuda.runtime.memcpyHostToDevice)
        base, step = self.dev.data.ptr, self.words * 4
        return [base + i * step for i in range(n)]


_ONE_BITS = np.float32(1.0).view(np.int32)   # the sampler table's "no penalty" (1.0f) word


def fill_rows(prm: np.ndarray, hist: np.ndarray, rows, out, tick: int) -> bool:
    """Write the sampler table rows ``out`` (a list of rows, or a count R: rows 0 .. R-1;
    the other rows of ``prm`` must already be zero, i.e. skipped) for ``rows`` (one
    ``(SamplerConfig, SamplerState, extra_history)`` per row, or None: greedy without
    penalty everywhere); True when a penalty history is used. Raises ValueError when the
    counts differ."""
    if rows is None:
        sel = slice(0, out) if isinstance(out, int) else out
        prm[sel, 0] = MODE_GREEDY
        prm[sel, 3] = tick & 0x7FFFFFFF
        prm[sel, 4] = _ONE_BITS
        return False
    if isinstance(out, int):
        out = range(out)
    if len(rows) != len(out):
        raise ValueError(f"{len(rows)} sampler rows for {len(out)} logits rows")
    need = False
    for j, (cfg, st, extra) in zip(out, rows):
        need |= fill_row(prm[j], hist[j], cfg, st, tick, extra)
    return need


def fits_history(cfg: SamplerConfig, st: SamplerState) -> bool:
    """Whether the row's penalty window (plus a verify window's drafts) fits the device
    table."""
    if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0:
        return True
    n = min(cfg.repeat_last_n, len(st.history)) if cfg.repeat_last_n > 0 else len(st.history)
    return n <= H_MAX - 16
