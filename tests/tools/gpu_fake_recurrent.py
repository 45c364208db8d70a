"""Fake CuPy's view of ``engine/backend/cuda/kernels/recurrent.cu``: per-launch extent checks
and a numpy emulation of each kernel, line for line (segments found from the row table, a
segment at position 0 starting from zero, padding rows on ``skip_slot``, the undo data of
segments of 2 .. 16 rows).

``install(fake)`` adds both to ``tests/tools/gpu_fake_cupy.py`` (the checks run on every
launch; the emulation, like the fake's others, only while ``fake.emulate`` is on).
``tests/tools/gpu_dryrun_hybrid.py`` uses the emulation to hold the steps' own launches
(``cuda/recurrent.py``) against the CPU's kernels (``cpu/recurrent.py``). The emulation
mirrors the CUDA source by hand: what it proves is the host code and the kernels' logic as
written here, not NVRTC's output (the GPU run does that: tests/test_cuda_hybrid.py).
"""

from __future__ import annotations

import numpy as np

UNDO_ROWS = 16           # REC_UNDO_ROWS
F = np.float32


def _cont(slot, pos, r: int) -> bool:
    """rec_continues: row r continues row r - 1's segment."""
    return r > 0 and slot[r - 1] == slot[r] and pos[r - 1] + 1 == pos[r]


def install(fake) -> None:
    base = fake._extents

    def extents(name, grid, a):
        base(name, grid, a)
        check = _CHECKS.get(name.split("<")[0])
        if check is not None:
            check(fake, grid, _with_s(name, a))

    fake._extents = extents
    fake._EMULATED.update({k: _bound(fake, f) for k, f in _EMU.items()})


def _bound(fake, f):
    """The fake's emulation signature (name, grid, args) for ``f(fake, args)``."""
    return lambda name, grid, a: f(fake, _with_s(name, a))


def _with_s(name: str, a: dict) -> dict:
    """The launch's arguments, with delta_rule<S>'s template argument as ``S``."""
    return {**a, "S": int(name[name.index("<") + 1:-1])} if name.startswith("delta_rule<") else a


def _ints(a, *names):
    return [int(a[n]) for n in names]


def _tables(fake, a, n: int):
    slot, pos = fake._i32(fake._addr(a["slot"]), n), fake._i32(fake._addr(a["pos"]), n)
    return slot, pos


# ---- extent checks ---------------------------------------------------------------------------

def _check_conv(fake, grid, a, state_kernel: bool) -> None:
    w = "kernel " + ("conv_state" if state_kernel else "short_conv")
    ldx, C, K, n, skip = _ints(a, "ldx", "C", "K", "n_rows", "skip_slot")
    if grid[1] != n or grid[0] * a["__block__"][0] < C or ldx < C or K < 2:
        raise fake.LaunchError(f"{w}: grid {grid} for {n} rows of {C} channels (ldx {ldx}, K {K})")
    fake._need(w, a["x"], 4 * ((n - 1) * ldx + C), "x rows")
    if not state_kernel:
        fake._need(w, a["w"], 4 * C * K, "w")
        fake._need(w, a["out"], 4 * ((n - 1) * int(a["ldo"]) + C), "out rows")
    slot, _ = _tables(fake, a, n)
    one = 4 * (K - 1) * C
    for s in set(slot.tolist()) - {skip}:
        fake._need(w, fake._addr(a["state"]) + s * one, one, f"slot {s}'s state")
        if state_kernel and fake._addr(a["undo_pre"]):
            fake._need(w, fake._addr(a["undo_pre"]) + s * one, one, f"slot {s}'s undo state")
            fake._need(w, fake._addr(a["undo_x"]) + s * 4 * UNDO_ROWS * C, 4 * UNDO_ROWS * C, f"slot {s}'s undo rows")


def _check_delta(fake, grid, a) -> None:
    w = "kernel delta_rule"
    H, Hk, S, n, skip, uld = _ints(a, "H", "Hk", "S", "n_rows", "skip_slot", "undo_ld")
    if grid[:2] != (H, n) or a["__block__"][0] != S or S not in (16, 32, 64, 128) or H % Hk:
        raise fake.LaunchError(f"{w}: grid {grid}, block {a['__block__']} for {H} heads of {S} ({Hk} key heads), "
                               f"{n} rows")
    for p, ld, width in (("q", "ldq", Hk * S), ("k", "ldk", Hk * S), ("v", "ldv", H * S), ("alpha", "lda", H),
                         ("beta", "ldb", H), ("out", "ldo", H * S)):
        if int(a[ld]) < width:
            raise fake.LaunchError(f"{w}: {ld} {int(a[ld])} < {width}")
        fake._need(w, a[p], 4 * ((n - 1) * int(a[ld]) + width), f"{p} rows")
    fake._need(w, a["a"], 4 * H, "a")
    fake._need(w, a["dtb"], 4 * H, "dt_bias")
    slot, _ = _tables(fake, a, n)
    one = 4 * H * S * S
    for s in set(slot.tolist()) - {skip}:
        fake._need(w, fake._addr(a["state"]) + s * one, one, f"slot {s}'s state")
        if fake._addr(a["undo_pre"]):
            if uld < 2 * Hk * S + H * S + 2 * H:
                raise fake.LaunchError(f"{w}: undo_ld {uld} too narrow")
            fake._need(w, fake._addr(a["undo_pre"]) + s * one, one, f"slot {s}'s undo state")
            fake._need(w, fake._addr(a["undo_in"]) + s * 4 * UNDO_ROWS * uld, 4 * UNDO_ROWS * uld,
                       f"slot {s}'s undo rows")


def _check_l2(fake, grid, a) -> None:
    ldx, ldo, hd = _ints(a, "ldx", "ldo", "hd")
    rows, width = grid[1], grid[0] * hd
    fake._need("kernel l2_norm_rows", a["x"], 4 * ((rows - 1) * ldx + width), "x rows")
    fake._need("kernel l2_norm_rows", a["out"], 4 * ((rows - 1) * ldo + width), "out rows")


def _check_rows(fake, grid, a, name: str, ins: tuple, width: int) -> None:
    rows = int(a["rows"])
    if grid[0] * a["__block__"][0] < rows * int(a.get("w", width)):
        raise fake.LaunchError(f"kernel {name}: grid {grid} short of {rows} rows")
    for p, ld, wd in ins:
        fake._need(f"kernel {name}", a[p], 4 * ((rows - 1) * int(a[ld]) + wd), f"{p} rows")


def _check_gate(fake, grid, a) -> None:
    w = int(a["w"])
    _check_rows(fake, grid, a, "sigmoid_gate_rows", (("x", "ldx", w), ("g", "ldg", w), ("out", "ldo", w)), w)


def _check_deint(fake, grid, a) -> None:
    heads, hd, parts, part = _ints(a, "heads", "hd", "parts", "part")
    if not 0 <= part < parts:
        raise fake.LaunchError(f"kernel deinterleave_rows: part {part} of {parts}")
    _check_rows(fake, grid, a, "deinterleave_rows", (("x", "ldx", heads * parts * hd), ("out", "ldo", heads * hd)),
                heads * hd)


_CHECKS = {"short_conv": lambda f, g, a: _check_conv(f, g, a, False),
           "conv_state": lambda f, g, a: _check_conv(f, g, a, True), "delta_rule": _check_delta,
           "l2_norm_rows": _check_l2, "sigmoid_gate_rows": _check_gate, "deinterleave_rows": _check_deint}


# ---- emulation (recurrent.cu, line for line) -------------------------------------------------

def _rows(fake, a, p: str, ld: int, n: int, width: int) -> np.ndarray:
    """(n, ld) float32 view of device rows (the last row cut to ``width``: read [:, :width])."""
    flat = fake._f32(fake._addr(a[p]), (n - 1) * ld + width)
    return np.lib.stride_tricks.as_strided(flat, (n, width), (4 * ld, 4))


def _emu_short_conv(fake, a) -> None:
    ldx, C, K, n, skip, silu, ldo = _ints(a, "ldx", "C", "K", "n_rows", "skip_slot", "silu", "ldo")
    x, out = _rows(fake, a, "x", ldx, n, C), _rows(fake, a, "out", ldo, n, C)
    w = fake._f32(fake._addr(a["w"]), C * K).reshape(C, K)
    slot, pos = _tables(fake, a, n)
    res = np.zeros((n, C), F)
    for r in range(n):
        s = int(slot[r])
        if s == skip:
            continue
        back = 0
        while back < K - 1 and _cont(slot, pos, r - back):
            back += 1
        fresh = back < K - 1 and pos[r - back] == 0
        st = fake._f32(fake._addr(a["state"]) + 4 * s * (K - 1) * C, (K - 1) * C).reshape(K - 1, C)
        acc = np.zeros(C, F)
        for j in range(K):
            d = K - 1 - j
            u = x[r - d] if d <= back else (np.zeros(C, F) if fresh else st[K - 1 + back - d])
            acc = acc + u * w[:, j]
        if silu:
            acc = acc / (F(1) + np.exp(-acc))
        res[r] = acc
    out[:] = res


def _emu_conv_state(fake, a) -> None:
    ldx, C, K, n, skip = _ints(a, "ldx", "C", "K", "n_rows", "skip_slot")
    x = _rows(fake, a, "x", ldx, n, C)
    slot, pos = _tables(fake, a, n)
    lim = max(K, UNDO_ROWS)
    for r in range(n):
        s = int(slot[r])
        if s == skip or (r + 1 < n and _cont(slot, pos, r + 1)):
            continue
        m = 1
        while m <= lim and _cont(slot, pos, r - m + 1):
            m += 1
        fresh = m <= lim and pos[r - m + 1] == 0
        st = fake._f32(fake._addr(a["state"]) + 4 * s * (K - 1) * C, (K - 1) * C).reshape(K - 1, C)
        if fake._addr(a["undo_pre"]) and 2 <= m <= UNDO_ROWS:
            up = fake._f32(fake._addr(a["undo_pre"]) + 4 * s * (K - 1) * C, (K - 1) * C).reshape(K - 1, C)
            up[:] = 0 if fresh else st
            ux = fake._f32(fake._addr(a["undo_x"]) + 4 * s * UNDO_ROWS * C, UNDO_ROWS * C).reshape(UNDO_ROWS, C)
            ux[:m] = x[r - m + 1:r + 1]
        for i in range(K - 1):
            src = m - (K - 1) + i
            st[i] = x[r - (K - 2) + i] if src >= 0 else (0 if fresh else st[i + m])


def _emu_delta_rule(fake, a) -> None:
    H, Hk, S, grouped, n, skip, uld, ldo = _ints(a, "H", "Hk", "S", "grouped", "n_rows", "skip_slot", "undo_ld", "ldo")
    q = _rows(fake, a, "q", int(a["ldq"]), n, Hk * S)
    k = _rows(fake, a, "k", int(a["ldk"]), n, Hk * S)
    v = _rows(fake, a, "v", int(a["ldv"]), n, H * S)
    al = _rows(fake, a, "alpha", int(a["lda"]), n, H)
    be = _rows(fake, a, "beta", int(a["ldb"]), n, H)
    out = _rows(fake, a, "out", ldo, n, H * S)
    av, dtb = fake._f32(fake._addr(a["a"]), H), fake._f32(fake._addr(a["dtb"]), H)
    scale = F(a["scale"])
    slot, pos = _tables(fake, a, n)
    rep = H // Hk
    res = {}
    for h in range(H):
        for r in range(n):
            s = int(slot[r])
            if s == skip:
                res[(r, h)] = np.zeros(S, F)
                continue
            if _cont(slot, pos, r):
                continue
            m = 1
            while r + m < n and _cont(slot, pos, r + m):
                m += 1
            hk = h // rep if grouped else h % Hk
            first_of_key = (h % rep == 0) if grouped else (h < Hk)
            St = fake._f32(fake._addr(a["state"]) + 4 * (s * H + h) * S * S, S * S).reshape(S, S)
            if pos[r] == 0:
                St[:] = 0
            if fake._addr(a["undo_pre"]) and 2 <= m <= UNDO_ROWS:
                fake._f32(fake._addr(a["undo_pre"]) + 4 * (s * H + h) * S * S, S * S)[:] = St.reshape(-1)
                ui = fake._f32(fake._addr(a["undo_in"]) + 4 * s * UNDO_ROWS * uld, UNDO_ROWS * uld)
                ui = ui.reshape(UNDO_ROWS, uld)
                kw = Hk * S
                for t in range(m):
                    if first_of_key:
                        ui[t, hk * S:(hk + 1) * S] = q[r + t, hk * S:(hk + 1) * S]
                        ui[t, kw + hk * S:kw + (hk + 1) * S] = k[r + t, hk * S:(hk + 1) * S]
                    ui[t, 2 * kw + h * S:2 * kw + (h + 1) * S] = v[r + t, h * S:(h + 1) * S]
                    ui[t, 2 * kw + H * S + h] = al[r + t, h]
                    ui[t, 2 * kw + H * S + H + h] = be[r + t, h]
            for t in range(m):
                kk, qq = k[r + t, hk * S:(hk + 1) * S].copy(), q[r + t, hk * S:(hk + 1) * S].copy()
                xa = F(al[r + t, h] + dtb[h])
                sp = xa if xa > F(20) else F(np.log(F(1) + np.exp(xa)))
                eg = F(np.exp(F(av[h] * sp)))
                bt = F(F(1) / (F(1) + np.exp(-be[r + t, h])))
                St[:] = St * eg
                sm = (St * kk[:, None]).sum(axis=0, dtype=F)             # over i, per column j
                d = ((v[r + t, h * S:(h + 1) * S] - sm) * bt).astype(F)
                St[:] = St + kk[:, None] * d[None, :]
                res[(r + t, h)] = ((St * qq[:, None]).sum(axis=0, dtype=F) * scale).astype(F)
    for (r, h), o in res.items():
        out[r, h * S:(h + 1) * S] = o


def _emu_gate(fake, a) -> None:
    rows, w = _ints(a, "rows", "w")
    x = _rows(fake, a, "x", int(a["ldx"]), rows, w)
    g = _rows(fake, a, "g", int(a["ldg"]), rows, w)
    _rows(fake, a, "out", int(a["ldo"]), rows, w)[:] = x / (F(1) + np.exp(-g))


def _emu_deint(fake, a) -> None:
    rows, heads, hd, parts, part = _ints(a, "rows", "heads", "hd", "parts", "part")
    x = _rows(fake, a, "x", int(a["ldx"]), rows, heads * parts * hd).reshape(rows, heads, parts, hd)
    _rows(fake, a, "out", int(a["ldo"]), rows, heads * hd)[:] = x[:, :, part, :].reshape(rows, heads * hd)


_EMU = {"short_conv": _emu_short_conv, "conv_state": _emu_conv_state, "delta_rule": _emu_delta_rule,
        "sigmoid_gate_rows": _emu_gate, "deinterleave_rows": _emu_deint}
