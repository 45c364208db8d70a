"""Fake CuPy's part for the int8 GEMV and the MMQ (``tests/tools/gpu_fake_cupy.py`` calls it).

Owns: the launch checks of ``mmq`` (``extents``: the int8 GEMV's extents, plus its tile
geometry and the dynamic shared memory its layout needs, ``engine/backend/cuda/mmq.py``'s ``smem_bytes``), and, with the fake's
``emulate`` flag, the numbers of ``quant_rows``, the int8 ``gemv`` (Q8 1) and ``mmq``
computed from the memory their arguments address by ``tests/tools/mmq_model.py`` (float32
bit for bit in each kernel's own reduction order; every epilogue mode, RoPE and the KV write
included). So a dry run checks by value that the program hands the MMQ what it hands the
GEMV: the two must give the same bits (``tests/tools/gpu_dryrun_mmq.py``). Leaves the other
kernels, memory and graphs to ``gpu_fake_cupy``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tests.tools.gpu_fake_cupy import LaunchError, _addr, _f32, _i32, _i8, _need


def extents(w: str, tpl: list, grid, a: dict) -> None:
    """mmq<TA, TB, MODE, WN, WM, S>: the int8 GEMV's checks, plus its tile geometry and the dynamic
    shared memory its layout needs."""
    from aotx.engine.backend.cuda import mmq as MQ

    ta, tb, mode, wn, wm, sp = tpl
    i = lambda k: int(a[k])   # noqa: E731
    B, k, n_pairs = i("B"), i("k"), i("n_pairs")
    if a["__block__"] != (32 * wn * wm * sp,) or sp not in (1, 2, 4):
        raise LaunchError(f"{w}: block {a['__block__']} for {wn} x {wm} warps in {sp} sets")
    if grid[0] * 16 * wm < B or grid[1] * 8 * wn < n_pairs:
        raise LaunchError(f"{w}: grid {grid} does not cover {B} rows ({16 * wm} a block) and {n_pairs} pairs "
                          f"({8 * wn} a block)")
    need = MQ.smem_bytes(ta, tb, k, wn, wm, sp)
    if a["__smem__"] < need:
        raise LaunchError(f"{w}: {a['__smem__']} bytes of dynamic shared memory, its layout needs {need}")
    if mode in (3, 5):
        rows_a = rows_b = 2 * n_pairs
        ycols = 1
    else:
        max_ra = (n_pairs - 1) * i("a_stride")
        rows_a, rows_b = max_ra + 1, max_ra + i("b_off") + 1
        ycols = rows_b if mode in (0, 1) else n_pairs
        if mode in (0, 1) and ycols > i("ldy"):
            raise LaunchError(f"{w}: writes column {ycols - 1} of rows only {i('ldy')} wide")
    _need(w, a["Wa"], rows_a * i("rba"), "Wa")
    _need(w, a["Wb"], rows_b * i("rbb"), "Wb")
    _need(w, a["x"], (B - 1) * i("ldx") + k, "x (int8)")
    _need(w, a["xd"], 8 * ((B - 1) * i("ldd") + k // 32), "xd")
    if i("ldx") % 32 or i("ldd") * 32 != i("ldx"):
        raise LaunchError(f"{w}: int8 rows of {i('ldx')} bytes with {i('ldd')} block scales")
    if _addr(a["nw"]) and not _addr(a["xs"]):
        raise LaunchError(f"{w}: a norm needs the precomputed scales xs")
    _need(w, a["y"], 4 * ((B - 1) * i("ldy") + ycols), "y")
    _need(w, a["xs"], 4 * B, "norm scales")
    if mode in (3, 5):
        for t in ("tab_slot", "tab_pos"):
            _need(w, a[t], 4 * B, t)


def emu_quant_rows(name, grid, a) -> None:
    """quant_rows by tests/tools/mmq_model.py (its levels, block scales and butterfly sums)."""
    from tests.tools import mmq_model as MM

    n, k, ldx, ldq, ldd = grid[0], int(a["k"]), int(a["ldx"]), int(a["ldq"]), int(a["ldd"])
    x = np.stack([_f32(_addr(a["x"]) + 4 * r * ldx, k) for r in range(n)])
    nw = _f32(_addr(a["nw"]), k).copy() if _addr(a["nw"]) else None
    xq, dx, sx, xs = MM.quant_rows(x, nw, float(np.float32(a["eps"])))
    for r in range(n):
        _i8(_addr(a["xq"]) + r * ldq, k)[:] = xq[r]
        d = _f32(_addr(a["xd"]) + 8 * r * ldd, 2 * (k // 32)).reshape(-1, 2)
        d[:, 0], d[:, 1] = dx[r], sx[r]
    if nw is not None:
        _f32(_addr(a["xs"]), n)[:] = xs


def emu_mmq(name, grid, a) -> None:
    ta, tb, mode, _, _, sp = (int(t) for t in name[name.index("<") + 1:-1].split(","))
    emu_q8(ta, tb, mode, a, mmq=True, split=sp)


def _pair_rows(a: dict, mode: int, n_pairs: int):
    """pair_rows<QKV> for every pair: (ra, rb, sect, head, dd, da, db) arrays (gemv.cu)."""
    p = np.arange(n_pairs)
    if mode not in (3, 5):
        ra = p * int(a["a_stride"])
        z = np.zeros(n_pairs, np.int64)
        return ra, ra + int(a["b_off"]), z, z, z, z, z
    rb0, qd, kd, hd = int(a["row_base"]), int(a["qd"]), int(a["kd"]), int(a["hd"])
    rh, neox = int(a["rope_half"]), int(a["neox"])
    g = rb0 + 2 * p
    sect = np.where(g < qd, 0, np.where(g < qd + kd, 1, 2))
    s0 = np.where(sect == 0, 0, np.where(sect == 1, qd, qd + kd))
    head = (g - s0) // hd
    dd = g - s0 - head * hd
    rot = (neox != 0) & (sect < 2) & (dd < 2 * rh)
    da = np.where(rot, dd >> 1, dd)
    db = np.where(rot, (dd >> 1) + rh, dd + 1)
    return s0 + head * hd + da - rb0, s0 + head * hd + db - rb0, sect, head, dd, da, db


def emu_q8(ta: int, tb: int, mode: int, a: dict, mmq: bool, split: int = 1) -> None:
    """The int8 GEMV (``mmq`` False: its lanes, butterfly and group sums) or the MMQ (its leaf
    order and stacks, ``split`` warp sets) by tests/tools/mmq_model.py from the memory the arguments address, then
    gemv_out in every mode."""
    from tests.tools import mmq_model as MM

    n_pairs, k, B, ldx, ldd, ldy = (int(a[t]) for t in ("n_pairs", "k", "B", "ldx", "ldd", "ldy"))
    nu = k // 32
    ra, rb, sect, head, dd, da, db = _pair_rows(a, mode, n_pairs)
    xq = np.stack([_i8(_addr(a["x"]) + r * ldx, k) for r in range(B)])
    xd = np.stack([_f32(_addr(a["xd"]) + 8 * r * ldd, 2 * nu).reshape(nu, 2) for r in range(B)])
    sums = []
    for w, rows, qt, rbytes in ((a["Wa"], ra, ta, int(a["rba"])), (a["Wb"], rb, tb, int(a["rbb"]))):
        raw = np.frombuffer(ctypes.string_at(_addr(w), int(rows.max() + 1) * rbytes), np.uint8).reshape(-1, rbytes)
        terms = MM.block_terms(MM.q8_weights(raw[rows], qt, k), qt, xq, xd[:, :, 0].copy(), xd[:, :, 1].copy())
        sums.append(MM.mmq_sums(terms, split) if mmq else MM.gemv_sums(terms))
    sc = _f32(_addr(a["xs"]), B).copy() if _addr(a["nw"]) else None
    ba = _f32(_addr(a["bias_a"]), int(ra.max()) + 1)[ra] if _addr(a["bias_a"]) else np.zeros(n_pairs, np.float32)
    bb = _f32(_addr(a["bias_b"]), int(rb.max()) + 1)[rb] if _addr(a["bias_b"]) else np.zeros(n_pairs, np.float32)
    va, vc = MM.epilogue(sums[0], sums[1], mode if mode in (2, 4) else 0, sc, ba, bb)
    for b in range(B):
        if mode in (0, 1):
            yr = _f32(_addr(a["y"]) + 4 * b * ldy, int(max(ra.max(), rb.max())) + 1)
            if mode == 0:
                yr[ra], yr[rb] = va[:, b], vc[:, b]
            else:
                yr[ra] = (yr[ra] + va[:, b]).astype(np.float32)
                yr[rb] = (yr[rb] + vc[:, b]).astype(np.float32)
        elif mode in (2, 4):
            _f32(_addr(a["y"]) + 4 * b * ldy, n_pairs)[:] = va[:, b]
        else:
            _emu_qkv_out(a, mode, b, va[:, b], vc[:, b], sect, head, dd, da, db)


def _emu_qkv_out(a: dict, mode: int, b: int, av, cv, sect, head, dd, da, db) -> None:
    """gemv_out's QKV modes for batch row b: RoPE on q and k, q into y, k and v into the cache."""
    rh, neox, hd = int(a["rope_half"]), int(a["neox"]), int(a["hd"])
    pos = int(_i32(_addr(a["tab_pos"]) + 4 * b, 1)[0])
    slot = int(_i32(_addr(a["tab_slot"]) + 4 * b, 1)[0])
    jj = np.where(neox != 0, np.where(dd < 2 * rh, da, -1), np.where((dd >> 1) < rh, dd >> 1, -1))
    rot = (sect < 2) & (jj >= 0)
    if rot.any() and rh:
        cs = _f32(_addr(a["rcos"]) + 4 * pos * rh, rh)[np.where(rot, jj, 0)]
        sn = _f32(_addr(a["rsin"]) + 4 * pos * rh, rh)[np.where(rot, jj, 0)]
        a2 = ((av * cs).astype(np.float32) - (cv * sn).astype(np.float32)).astype(np.float32)
        c2 = ((av * sn).astype(np.float32) + (cv * cs).astype(np.float32)).astype(np.float32)
        av, cv = np.where(rot, a2, av), np.where(rot, c2, cv)
    q = sect == 0
    yr = _f32(_addr(a["y"]) + 4 * b * int(a["ldy"]), int((head[q] * hd + db[q]).max()) + 1 if q.any() else 1)
    yr[head[q] * hd + da[q]], yr[head[q] * hd + db[q]] = av[q], cv[q]
    n_kv, n_ctx = int(a["n_kv"]), int(a["n_ctx"])
    for s_, key in ((1, "kc"), (2, "vc")):
        m = sect == s_
        if not m.any():
            continue
        o = (((slot * n_kv + head[m]) * n_ctx + pos) * hd).astype(np.int64)
        n = int(max(o.max() + db[m].max(), o.max() + da[m].max())) + 1
        if mode == 5:
            c = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(_addr(a[key])))
            c[o + da[m]] = av[m].astype(np.float16).view(np.uint16)
            c[o + db[m]] = cv[m].astype(np.float16).view(np.uint16)
        else:
            c = _f32(_addr(a[key]), n)
            c[o + da[m]], c[o + db[m]] = av[m], cv[m]
