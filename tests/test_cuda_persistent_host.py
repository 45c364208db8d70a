"""The persistent decode step's host side (tests/tools/persistent_step.py), without a GPU:
the parameter layout and packing of a recorded launch, the generated source's switch, the
step table and the residency rule. The device run is tests/test_cuda_persistent.py; the
whole path on the fake CuPy is tests/test_cuda_host.py's dry run."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from aotx.engine.backend.cuda import source as S
from tests.tools import persistent_step as PS


def test_every_covered_kernel_has_a_block_function_with_its_parameters():
    sigs = PS.signatures(S.SRC)
    for base, (fn, dims) in PS.BLOCK_FUNCTIONS.items():
        assert base in sigs
        assert f"void {fn}(" in S.SRC
        # the block function takes the block index, then exactly the kernel's parameters
        head = S.SRC.split(f"void {fn}(", 1)[1].split(")", 1)[0]
        names = [p.name for p in sigs[base]]
        assert head.count(",") == len(names) + dims - 1, (fn, head)


def test_layout_aligns_each_parameter_naturally():
    ps = [PS.Param("int", "int", "a"), PS.Param("const u8*", "ptr", "w"), PS.Param("float", "float", "f"),
          PS.Param("long long", "i64", "rb"), PS.Param("int", "int", "b")]
    assert PS.layout(ps) == [0, 8, 16, 24, 32]
    too_many = [PS.Param("const u8*", "ptr", f"p{i}") for i in range(PS.ARG_BYTES // 8 + 1)]
    with pytest.raises(ValueError, match="more than"):
        PS.layout(too_many)


def test_pack_writes_each_argument_at_its_offset():
    ps = [PS.Param("int", "int", "a"), PS.Param("const u8*", "ptr", "w"), PS.Param("float", "float", "f"),
          PS.Param("long long", "i64", "rb")]
    buf = PS.pack(ps, (np.int32(-3), np.uint64(0xDEADBEEF00), np.float32(0.5), np.int64(-7)))
    assert struct.unpack_from("<i", buf, 0)[0] == -3
    assert struct.unpack_from("<Q", buf, 8)[0] == 0xDEADBEEF00
    assert struct.unpack_from("<f", buf, 16)[0] == 0.5
    assert struct.unpack_from("<q", buf, 24)[0] == -7
    with pytest.raises(ValueError, match="arguments for"):
        PS.pack(ps, (1, 2))


def test_the_gemv_layout_fits_a_step():
    sigs = PS.signatures(S.SRC)
    offs = PS.layout(sigs["gemv"])
    assert offs[-1] + 4 <= PS.ARG_BYTES


def test_source_runs_each_kind_as_its_block_function():
    kinds = ["attn_decode<64,1>", "embed<8>", "gather_rows", "gemv<3,3,1,5,1>"]
    src = PS.source(S.SRC, kinds)
    assert "__restrict__" not in src            # no read-only-path loads of data written in the launch
    assert "case 0: attn_block<64,1>(bx, by, bz, " in src
    assert "case 1: embed_block<8>(bx, by, " in src
    assert "case 2: gather_block(bx, " in src
    assert "case 3: gemv_block<3,3,1,5,1>(bx, by, " in src
    assert 'extern "C" __global__ void __launch_bounds__(128) persistent_step(' in src
    with pytest.raises(ValueError, match="no block function"):
        PS.source(S.SRC, ["row_scale"])


def test_step_table_rows_hold_kind_grid_and_arguments():
    sigs = PS.signatures(S.SRC)
    kinds = ["gather_rows", "embed<8>"]
    calls = [("embed<8>", (3, 2), (128,), (np.uint64(4096), np.int64(34), np.uint64(8192), np.int32(576),
                                             np.uint64(12288), np.int32(576), np.float32(1.0))),
             ("gather_rows", (1,), (128,), (np.uint64(1), np.int32(576), np.uint64(2), np.uint64(3)))]
    t = PS.step_table(calls, kinds, sigs)
    assert t.shape == (2, PS.HEADER_WORDS + PS.ARG_BYTES // 4)
    assert list(t[0, :4]) == [1, 6, 3, 2]
    assert list(t[1, :4]) == [0, 1, 1, 1]
    assert not t[:, 4:PS.HEADER_WORDS].any()          # no weights to prefetch for these
    assert struct.unpack_from("<q", t[0, PS.HEADER_WORDS:].tobytes(), 8)[0] == 34
    with pytest.raises(ValueError, match="blocks of"):
        PS.step_table([("gather_rows", (1,), (256,), calls[1][3])], kinds, sigs)


def test_prefetch_ranges_are_the_gemvs_weight_rows():
    sigs = PS.signatures(S.SRC)
    n = len(sigs["gemv"])
    lin = (np.uint64(1 << 20), np.uint64(1 << 20), np.int64(360), np.int64(360), np.int32(2), np.int32(1),
           np.int32(288)) + (np.int32(0),) * (n - 7)
    glu = (np.uint64(1 << 20), np.uint64(3 << 20), np.int64(360), np.int64(200), np.int32(1), np.int32(0),
           np.int32(1536)) + (np.int32(0),) * (n - 7)
    assert PS.weight_ranges("gemv<3,3,1,1,1>", lin) == [(1 << 20, (288 * 2 - 1) * 360)]
    assert PS.weight_ranges("gemv<3,3,1,2,1>", glu) == [(1 << 20, 1536 * 360), (3 << 20, 1536 * 200)]
    assert PS.weight_ranges("attn_decode<64,1>", ()) == []
    t = PS.step_table([("gemv<3,3,1,2,1>", (384, 1), (128,), glu)], ["gemv<3,3,1,2,1>"], sigs)
    head = t[0, 4:PS.HEADER_WORDS].tobytes()
    assert struct.unpack_from("<QQii", head) == (1 << 20, 3 << 20, 1536 * 360, 1536 * 200)
    assert "cp.async.bulk.prefetch.L2.global" in PS.source(S.SRC, ["gemv<3,3,1,2,1>"])
    assert "#define AOTX_PERSISTENT_PREFETCH 0" in PS.source(S.SRC, ["gemv<3,3,1,2,1>"], prefetch=False)


@pytest.mark.parametrize("regs,smem,want,fits", [(190, 2260, 2, 2), (190, 2260, 4, 2), (64, 2260, 4, 4),
                                                 (255, 0, 4, 2), (190, 120 * 1024, 2, 1), (32, 200 * 1024, 2, 1)])
def test_blocks_per_sm_is_what_fits_at_once(regs, smem, want, fits):
    assert PS.blocks_per_sm(regs, smem, want) == fits


def test_recorder_keeps_launches_in_order():
    r = PS.Recorder()
    r["a"]((1,), (128,), (1, 2))
    r["b"]((2, 3), (128,), ())
    assert [c[0] for c in r.calls] == ["a", "b"] and r.calls[1][1] == (2, 3)
