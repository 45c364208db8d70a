"""The device token-mask path of constrained decoding, run on the CPU against the fake CuPy.

The CUDA sampler reads a constrained row's bitmask through the device address in words
16-17 of its sampler-table row (``cuda_sampling.fill_row`` writes ``mask_ptr``;
``MaskTable.load`` puts the masks in device memory). What can go wrong on the host is
found here without a GPU: the executor's row-to-mask mapping (``Executor._device_rows``
through the model's ``load_masks``,
a verify window's rows included), the address written into the table, the table reaching
the kernel on the graph path (uploaded before the replay) and on the eager path (the
kernel's argument), and the mask table's growth.

``tests/tools/gpu_fake_cupy.py`` checks every launch; kernels do not run there, so this
file emulates ``sample_rows``'s greedy mode with a mask (forbidden ids to -inf, then the
argmax) at each launch, reading the mask from the address the kernel would read. Each
row's mask allows exactly one id, so the id the emulated kernel picks proves which mask
the row's address pointed at. Runs in a subprocess: the fake must not replace a real
CuPy in the test process. The real kernel on a GPU: tests/test_gateway_cuda.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_mask_path_on_the_fake_cupy():
    p = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "mask path OK" in p.stdout, p.stdout
    for path in ("graph", "eager", "grown"):
        assert f"ok {path}" in p.stdout, p.stdout


# ---- the subprocess -------------------------------------------------------------------------

def _main() -> int:  # noqa: C901 - one scenario, told in order
    import ctypes
    import tempfile
    from types import SimpleNamespace

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from tests.tools import gpu_fake_cupy as F

    F.install()
    import cupy as cp

    if not hasattr(cp.cuda.runtime, "memcpy"):  # MaskTable's synchronous copy
        cp.cuda.runtime.memcpy = lambda dst, src, n, kind: F._memcpy(dst, src, n, kind)

    from gguf import GGMLQuantizationType as T

    from aotx.engine.backend.cuda import sampling as CS
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build
    from aotx.engine.runtime.executor import Executor
    from aotx.engine.runtime.sampling import SamplerConfig, SamplerState
    from tests.models.cuda_testmodel import write_llama

    V = 301  # not a multiple of 32: the mask's last word is partial
    path = write_llama(Path(tempfile.mkdtemp(prefix="aotx-maskdry-")) / "m.gguf", n_layers=1, d_model=128,
                       n_heads=2, n_kv_heads=1, ffn=256, vocab=V, qtype=T.Q8_0)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    model = build(cfg, gf, CudaBackend())
    prog = model.compiled
    W = (V + 31) // 32

    def host(a, n_bytes):
        """A numpy view of a fake device argument (an array, or a u64 address)."""
        if isinstance(a, F.FakeArray):
            return np.asarray(a)
        p = int(a)
        if not F._span_ok(p, n_bytes):
            raise AssertionError(f"address {p:#x} ({n_bytes} bytes) is outside every device allocation")
        return np.ctypeslib.as_array((ctypes.c_uint8 * n_bytes).from_address(p))

    seen_masks: list[list[int]] = []

    def emulate(args, R):
        logits, ld, vocab, prm, _hist, _slot, _pos, _out, ids, rec = args
        ld, vocab = int(ld), int(vocab)
        lg = np.asarray(logits).reshape(-1)
        P = np.asarray(prm).reshape(-1, CS.P_WORDS)
        out_ids, out_rec = np.asarray(ids).reshape(-1), np.asarray(rec).reshape(-1, CS.REC_WORDS)
        addrs = []
        for b in range(R):
            if P[b, 0] == CS.MODE_SKIP:
                out_ids[b] = -1
                continue
            assert P[b, 0] == CS.MODE_GREEDY, P[b]
            row = lg[b * ld:b * ld + vocab].astype(np.float64)
            addr = int(P[b, 16:18].copy().view(np.uint64)[0])
            addrs.append(addr)
            if addr:
                m = host(np.uint64(addr), W * 4).view(np.uint32)
                allowed = ((m[np.arange(vocab) >> 5] >> (np.arange(vocab) & 31)) & 1).astype(bool)
                row = np.where(allowed, np.nan_to_num(row, nan=0.0), -np.inf)
            out_ids[b] = int(np.argmax(row))
            out_rec[b] = (P[b, 3], 0, 0, out_ids[b])
        seen_masks.append(addrs)

    real_ks = prog.ks
    captured = {}

    def ks(grid, block, args, shared_mem=0):
        real_ks(grid, block, args, shared_mem)      # the fake's signature and pointer checks
        s = cp.cuda.get_current_stream()
        if getattr(s, "capturing", False):
            captured["args"], captured["R"] = args, int(grid[0])
        else:
            emulate(args, int(grid[0]))

    prog.ks = ks
    end_capture = F.Stream.end_capture

    def end(self):
        g = end_capture(self)
        a, R = captured.pop("args"), captured.pop("R")
        g.launch = lambda s=None: emulate(a, R)     # a replay runs the captured sampler launch
        return g

    F.Stream.end_capture = end

    lm = SimpleNamespace(model=model, config=SimpleNamespace(vocab_size=V, d_model=cfg.d_model))
    kv = model.new_kv_cache(4, 256, "f16")
    ex = Executor(lm, kv, device="cuda")

    def one_hot(ids):
        m = np.zeros((len(ids), W), np.uint32)
        for i, t in enumerate(ids):
            m[i, t >> 5] |= np.uint32(1 << (t & 31))
        return m.view(np.int32)

    greedy = SamplerConfig(temperature=0.0, repeat_penalty=1.0)  # a verify window on the device: no penalty

    def req(seed):
        return SimpleNamespace(sampler=greedy, sampler_state=SamplerState(seed=seed))

    # graph path: three slots, one decode row each, the second a verify window of 2 drafts
    a, b, c = req(1), req(2), req(3)
    rows = [(a, []), (b, [5, 6]), (c, [])]
    masks = {id(a): one_hot([300]), id(b): one_hot([7, 40, 299]), id(c): None}
    masks = {k: v for k, v in masks.items() if v is not None}   # c is not constrained
    srows = ex._device_rows(rows, masks)
    assert len(srows) == 5 and srows[4][1] is c.sampler_state, srows
    segs = [Segment(0, 10, 1), Segment(1, 20, 3, all_logits=True), Segment(2, 30, 1)]
    toks = np.array([1, 2, 5, 6, 3], np.int32)
    got = model.sample(toks, segs, kv, srows, tick=7)
    assert got[:4].tolist() == [300, 7, 40, 299], got
    t = prog._state(kv).tables
    words = np.asarray(t.prm).reshape(-1, CS.P_WORDS)[:5, 16:18].copy().view(np.uint64).ravel()
    tab = prog.mask_table
    base, step = tab.dev.data.ptr, W * 4
    assert words.tolist()[:4] == [base + i * step for i in range(4)] and words[4] == 0, words
    print("ok graph: 5 rows, masks at", [hex(int(w)) for w in words])

    # eager path (one slot twice): a constrained row after an unconstrained one
    d, e = req(4), req(5)
    srows = ex._device_rows([(d, []), (e, [])], {id(e): one_hot([123])})
    got = model.sample(np.arange(11, dtype=np.int32), [Segment(3, 0, 10), Segment(3, 10, 1)], kv, srows, tick=8)
    assert int(got[1]) == 123 and seen_masks[-1][0] == 0 and seen_masks[-1][1] == prog.mask_table.dev.data.ptr, \
        (got, seen_masks[-1])
    print("ok eager: ids", got.tolist())

    # the table grows past its 64 rows; every address inside the new table, each its own mask
    many = one_hot([i % V for i in range(100)])
    addrs = prog.load_masks(many)
    assert prog.mask_table.rows >= 100 and len(set(addrs)) == 100
    for i in (0, 63, 64, 99):
        m = host(np.uint64(addrs[i]), W * 4).view(np.int32)
        assert (m == many[i]).all(), i
    try:
        prog.load_masks(np.zeros((1, W + 1), np.int32))
        raise AssertionError("a mask of the wrong width was accepted")
    except ValueError:
        pass
    print("ok grown: 100 rows")
    print("mask path OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
