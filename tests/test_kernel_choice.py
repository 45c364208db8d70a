"""The kernel-choice artifact (DESIGN.md, "Kernel choice"), on the CPU.

``engine/backend/kernel_choice.py`` is pure Python: these tests drive it with fake timers
and fake checks, in every case the design names: first load on a device (missing: timed
and recorded), a later load (reused without timing), a stale artifact (another driver,
GPU, CuPy or kernel source), a corrupt one (not JSON, wrong schema, unreadable bytes), a
recorded winner that is no longer a candidate, a model with new shapes next to an
artifact of another's, an unwritable data dir, the timing budget, candidates that fail
their check or cannot run. In none of them does loading fail: the default runs and the
summary line says why. Also the CUDA backend's candidate lists (``cuda_choice``), which
are pure Python too.
"""

from __future__ import annotations

import json
import os

import pytest

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend import kernel_choice as KC

KEY = KC.DeviceKey(gpu="NVIDIA H200", driver="13000", cuda="13000", cupy="14.2.0", source="abc123")


class FakeTimer:
    """measure(c) -> the given seconds; counts calls per candidate."""

    def __init__(self, times: dict[str, float]):
        self.times = times
        self.calls: dict[str, int] = {}

    def __call__(self, c: str) -> float:
        self.calls[c] = self.calls.get(c, 0) + 1
        t = self.times[c]
        if isinstance(t, Exception):
            raise t
        return t

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def site(key="gemv/add/Q4_KxQ4_K/m4096/k4096/plain@b1", times=None, default="a", check=None, weight=1.0):
    times = times if times is not None else {"a": 3e-6, "b": 1e-6, "c": 2e-6}
    t = FakeTimer(times)
    return KC.Site(key, tuple(times), default, measure=t, check=check, weight=weight), t


def path_in(tmp_path):
    return KC.artifact_path(tmp_path, KEY.gpu)


def test_first_load_times_every_candidate_and_records_the_fastest(tmp_path):
    s, t = site()
    p = path_in(tmp_path)
    res = KC.resolve([s], KEY, p, "auto")
    assert res.status == "missing" and "no artifact" in res.reason
    assert res.choice[s.key] == "b" and res.source[s.key] == "tuned"
    assert t.calls == {"a": KC.ROUNDS, "b": KC.ROUNDS, "c": KC.ROUNDS}
    doc = json.loads(p.read_text())
    assert doc["key"] == KEY.as_dict()
    assert doc["sites"][s.key]["winner"] == "b"
    assert doc["sites"][s.key]["us"] == {"a": 3.0, "b": 1.0, "c": 2.0}
    assert res.written is True and "written to" in res.summary() and "1 timed now" in res.summary()
    assert [f for f in os.listdir(p.parent) if f.endswith(".tmp")] == []   # the atomic write left nothing behind


def test_a_later_load_reuses_the_artifact_without_timing(tmp_path):
    p = path_in(tmp_path)
    s, _ = site()
    KC.resolve([s], KEY, p, "auto")
    for policy in ("auto", "reuse"):
        s2, t2 = site(times={"a": 1e-9, "b": 5e-6, "c": 5e-6})   # a would win now: the artifact is what counts
        res = KC.resolve([s2], KEY, p, policy)
        assert res.status == "ok" and res.reason == ""
        assert res.choice[s2.key] == "b" and res.source[s2.key] == "artifact"
        assert t2.total == 0
        assert res.timings_us[s2.key] == {"a": 3.0, "b": 1.0, "c": 2.0}     # the recorded timings, for reports
        assert res.summary().startswith("1 of 1 sites from the artifact")


@pytest.mark.parametrize("field,value", [("driver", "13010"), ("gpu", "NVIDIA H100 80GB HBM3"), ("cupy", "14.3.0"),
                                         ("cuda", "12080"), ("source", "def456")])
def test_a_stale_artifact_runs_the_defaults_and_names_what_changed(tmp_path, field, value):
    p = path_in(tmp_path)
    KC.resolve([site()[0]], KEY, p, "auto")
    newkey = KC.DeviceKey(**{**KEY.as_dict(), field: value})
    s, t = site()
    res = KC.resolve([s], newkey, p, "reuse")
    assert res.status == "stale" and field in res.reason and value in res.reason
    assert res.choice[s.key] == "a" and res.source[s.key] == "default" and t.total == 0
    summary = res.summary()
    assert "artifact stale" in summary and "`aotx tune`" in summary and "on the default kernel" in summary
    # auto times again and replaces the artifact with one for the new key
    s, t = site()
    res = KC.resolve([s], newkey, p, "auto")
    assert res.choice[s.key] == "b" and t.total == 3 * KC.ROUNDS
    assert json.loads(p.read_text())["key"][field] == value


@pytest.mark.parametrize("content,why", [
    (b"{not json", "not JSON"),
    (b"", "not JSON"),
    (b"\xff\xfe\x00garbage", "cannot be read"),
    (b"[1, 2]", "top level"),
    (json.dumps({"format": "other", "version": 1}).encode(), "format"),
    (json.dumps({"format": KC.FORMAT, "version": 99}).encode(), "version"),
    (json.dumps({"format": KC.FORMAT, "version": 1, "key": {"gpu": 1}}).encode(), "'key'"),
    (json.dumps({"format": KC.FORMAT, "version": 1, "key": KEY.as_dict(), "sites": []}).encode(), "'sites'"),
    (json.dumps({"format": KC.FORMAT, "version": 1, "key": KEY.as_dict(),
                 "sites": {"x": {"winner": 3}}}).encode(), "winner"),
    (json.dumps({"format": KC.FORMAT, "version": 1, "key": KEY.as_dict(),
                 "sites": {"x": {"winner": "a", "us": {"a": "fast"}}}}).encode(), "'us'"),
])
def test_a_corrupt_artifact_never_fails_a_load(tmp_path, content, why):
    p = path_in(tmp_path)
    p.parent.mkdir(parents=True)
    p.write_bytes(content)
    s, t = site()
    res = KC.resolve([s], KEY, p, "reuse")
    assert res.status == "corrupt" and why in res.reason and str(p) in res.reason
    assert res.choice[s.key] == "a" and res.source[s.key] == "default" and t.total == 0
    assert "artifact corrupt" in res.summary()
    assert p.read_bytes() == content                  # reuse never writes
    res = KC.resolve([s], KEY, p, "auto")             # auto replaces it with a valid one
    assert res.choice[s.key] == "b"
    assert KC.read_artifact(p, KEY)[0] == "ok"


def test_a_truncated_artifact_is_corrupt(tmp_path):
    p = path_in(tmp_path)
    KC.resolve([site()[0]], KEY, p, "auto")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    status, reason, _ = KC.read_artifact(p, KEY)
    assert status == "corrupt" and "not JSON" in reason


def test_off_reads_and_writes_nothing(tmp_path):
    s, t = site()
    res = KC.resolve([s], KEY, None, "auto")
    assert res.status == "off" and res.choice[s.key] == "a" and t.total == 0
    p = path_in(tmp_path)
    res = KC.resolve([s], KEY, p, "off")
    assert res.choice[s.key] == "a" and not p.exists() and "kernel choice off" in res.summary()


def test_a_candidate_that_fails_its_check_is_never_chosen(tmp_path):
    """A GEMV variant whose bits differ from the default's would break batch invariance:
    it is rejected even when it is the fastest, and the artifact says why."""
    s, t = site(check=lambda c: "output differs from the default variant a (max |diff| 1e-07)" if c == "b" else None)
    p = path_in(tmp_path)
    res = KC.resolve([s], KEY, p, "auto")
    assert res.choice[s.key] == "c"
    assert "b" not in t.calls
    assert "b rejected: output differs" in res.notes[s.key]
    assert json.loads(p.read_text())["sites"][s.key]["rejected"]["b"].startswith("output differs")


def test_a_candidate_that_raises_or_times_nonsense_is_rejected(tmp_path):
    s, _ = site(times={"a": 3e-6, "b": RuntimeError("CUDA_ERROR_INVALID_VALUE"), "c": float("nan")})
    res = KC.resolve([s], KEY, path_in(tmp_path), "auto")
    assert res.choice[s.key] == "a"
    assert "RuntimeError: CUDA_ERROR_INVALID_VALUE" in res.notes[s.key] and "c rejected" in res.notes[s.key]


def test_when_every_candidate_fails_the_default_runs_and_nothing_is_recorded(tmp_path):
    s, _ = site(check=lambda c: "broken")
    p = path_in(tmp_path)
    res = KC.resolve([s], KEY, p, "auto")
    assert res.choice[s.key] == "a" and res.source[s.key] == "default"
    assert not p.exists()                             # tried again at the next load


def test_the_default_stays_unless_another_is_clearly_faster(tmp_path):
    s, _ = site(times={"a": 1.01e-6, "b": 1.0e-6, "c": 2e-6})
    assert KC.resolve([s], KEY, path_in(tmp_path), "auto").choice[s.key] == "a"
    s, _ = site(times={"a": 1.05e-6, "b": 1.0e-6, "c": 2e-6})
    assert KC.resolve([s], KEY, path_in(tmp_path), "force").choice[s.key] == "b"


def test_a_recorded_winner_that_is_no_longer_a_candidate(tmp_path):
    p = path_in(tmp_path)
    KC.resolve([site()[0]], KEY, p, "auto")          # records b
    s, t = site(times={"a": 3e-6, "c": 2e-6})        # b is gone (say, a variant removed)
    res = KC.resolve([s], KEY, p, "reuse")
    assert res.choice[s.key] == "a" and res.source[s.key] == "default"
    assert "no longer a candidate" in res.notes[s.key]
    res = KC.resolve([s], KEY, p, "auto")
    assert res.choice[s.key] == "c" and res.source[s.key] == "tuned"


def test_new_sites_are_timed_and_merged_with_the_recorded_ones(tmp_path):
    p = path_in(tmp_path)
    s1, _ = site(key="gemv/a@b1")
    KC.resolve([s1], KEY, p, "auto")
    s1b, t1 = site(key="gemv/a@b1")
    s2, t2 = site(key="gemv/other-model@b1", times={"a": 1e-6, "b": 2e-6})
    res = KC.resolve([s1b, s2], KEY, p, "auto")
    assert t1.total == 0 and t2.total == 2 * KC.ROUNDS
    assert res.source == {"gemv/a@b1": "artifact", "gemv/other-model@b1": "tuned"}
    assert set(json.loads(p.read_text())["sites"]) == {"gemv/a@b1", "gemv/other-model@b1"}


def test_force_times_every_site_again(tmp_path):
    p = path_in(tmp_path)
    KC.resolve([site()[0]], KEY, p, "auto")
    s, t = site(times={"a": 1e-6, "b": 5e-6, "c": 5e-6})
    res = KC.resolve([s], KEY, p, "force")
    assert t.total == 3 * KC.ROUNDS and res.choice[s.key] == "a"
    assert json.loads(p.read_text())["sites"][s.key]["winner"] == "a"


def test_the_budget_leaves_the_remaining_sites_on_their_defaults(tmp_path):
    now = [0.0]

    def clock():
        return now[0]

    sites = []
    for i, w in enumerate((1.0, 5.0, 3.0)):
        s, t = site(key=f"s{i}", weight=w)

        def measure(c, t=t):
            now[0] += 1.0                           # every measurement takes a second
            return t(c)
        s.measure = measure
        sites.append(s)
    res = KC.resolve(sites, KEY, path_in(tmp_path), "auto", budget_s=8.5, clock=clock)
    # the heaviest site first (9 measurements = 9 s): past the budget after it
    assert res.source == {"s1": "tuned", "s0": "default", "s2": "default"}
    assert res.notes["s0"] == "tuning budget spent"
    assert "2 sites not timed: tuning budget spent" in res.summary()


def test_an_unwritable_data_dir_still_loads(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "kernel_choice").write_text("a file where the folder should be")
    p = KC.artifact_path(ro, KEY.gpu)
    s, _ = site()
    res = KC.resolve([s], KEY, p, "auto")
    assert res.choice[s.key] == "b"
    assert isinstance(res.written, str) and "artifact not written" in res.summary()


def test_artifact_file_names_and_source_hash():
    assert KC.artifact_path("/d", "NVIDIA H200").name == "NVIDIA-H200.json"
    assert KC.artifact_path("/d", "a/b:c").parent.name == "kernel_choice"
    assert KC.source_hash("x", "y") != KC.source_hash("xy")
    assert len(KC.source_hash("x")) == 16


def test_a_default_outside_the_candidates_is_a_programming_error():
    with pytest.raises(ValueError, match="not a candidate"):
        KC.Site("s", ("a", "b"), "z")
    with pytest.raises(ValueError, match="policy"):
        KC.resolve([], KEY, None, "sometimes")


# ---- the CUDA backend's candidates (cuda_choice) ------------------------------------------------

@pytest.mark.parametrize("bucket", CC.TUNE_BUCKETS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("m_rows", [576, 4096, 49152])
def test_gemv_default_is_a_candidate_and_names_round_trip(bucket, norm, m_rows):
    cands = CC.gemv_candidates(bucket, norm)
    assert CC.gemv_default(bucket, norm, m_rows) in cands
    assert CC.gemv_default(bucket, norm, m_rows, 4096) in cands
    assert len(cands) == len(set(cands))
    for c in cands:
        v = CC.GemvVariant.parse(c)
        assert v.name == c and v.wpp in CC.GEMV_GRID[v.nb]
        assert v.nb <= max(1, min(bucket, CC.NB_MAX))
        assert norm or not v.pre                      # without a norm there is no scale to precompute


def test_pairs_per_warp_names_instances_and_blocks():
    """Two or four row pairs per warp are named by rows per warp (r4, r8) and launch the
    six-argument template; one pair per warp keeps the five-argument name it had."""
    v = CC.GemvVariant.parse("nb1w4r8p")
    assert (v.nb, v.wpp, v.pre, v.ppw) == (1, 4, True, 4) and v.name == "nb1w4r8p"
    assert CC.gemv_instance(12, 14, 2, v) == "gemv<12,14,1,2,4,4>"
    assert CC.gemv_instance(12, 14, 2, CC.GemvVariant.parse("nb1w4p")) == "gemv<12,14,1,2,4>"
    assert v.pairs_per_block == 4 and CC.GemvVariant.parse("nb2w1r4i").pairs_per_block == 8
    assert CC.GemvVariant.parse("nb16w1p").pairs_per_block == 4


def test_gemv_candidate_sets():
    assert CC.gemv_candidates(1, False) == ("nb1w1i", "nb1w2i", "nb1w2r4i", "nb1w4i", "nb1w4r4i")
    assert CC.gemv_candidates(1, True) == ("nb1w1p", "nb1w1i", "nb1w2p", "nb1w2i", "nb1w2r4p", "nb1w2r4i", "nb1w4p",
                                           "nb1w4i", "nb1w4r4p", "nb1w4r4i")
    assert CC.gemv_candidates(64, True) == ("nb16w1p", "nb16w2p", "nb16w4p", "nb8w1p", "nb8w2p", "nb8w4p")
    assert CC.gemv_default(64, True, 4096) == "nb16w1p"
    assert CC.gemv_default(16, False, 576) == "nb16w1i"
    assert CC.gemv_default(64, True, 4096, 576) == "nb16w1p" and CC.gemv_default(64, True, 4096, 4096) == "nb16w4p"
    assert CC.gemv_default(8, True, 576) == "nb8w2p"
    assert CC.gemv_default(1, True, 576) == "nb1w4i"
    assert CC.gemv_default(1, True, 4096) == "nb1w4p"
    assert CC.gemv_default(2, False, 49152) == "nb2w1i"
    for bad in ("nb3w1p", "nb32w1p", "nb16w3p", "nb4w4x", "gemv", "nb16w1r4p", "nb4w4r8p", "nb1w4r3p", "nb1w4r2p"):
        with pytest.raises(ValueError):
            CC.GemvVariant.parse(bad)


def test_buckets_and_prefill_modes():
    assert [CC.tune_bucket(n) for n in (0, 1, 3, 16, 17, 128, 129, 1000)] == [1, 1, 4, 16, 32, 128, 128, 128]
    assert CC.prefill_candidates(True) == ("f16", "tf32", "f32") and CC.prefill_default(True) == "f16"
    assert CC.prefill_candidates(False) == ("tf32", "f32") and CC.prefill_default(False) == "tf32"
    assert CC.prefill_site("Q4_K", 4096, 14336, False) == "gemm/Q4_K/m4096/k14336/open"


def test_aotx_tune_without_cupy_is_one_line_exit_2(tiny_gguf, tmp_path, capsys, monkeypatch):
    """``aotx tune`` where CuPy is missing (CI) names the problem in one line; nothing is
    written to the data dir."""
    import builtins

    from aotx.engine.cli.commands import main

    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    real_import = builtins.__import__

    def no_cupy(name, *a, **kw):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.delitem(__import__("sys").modules, "aotx.engine.backend.cuda.backend", raising=False)
    path = tiny_gguf.write_tiny_llama(tmp_path / "t.gguf")
    assert main(["tune", "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aotx: aotx tune needs the CUDA backend (CuPy)")
    assert not (tmp_path / "home" / "kernel_choice").exists()


def test_a_cpu_load_has_no_kernel_choice_note(tiny_gguf, tmp_path):
    from aotx.engine.model.loader import load_model

    lm = load_model(tiny_gguf.write_tiny_llama(tmp_path / "t.gguf"), device="cpu")
    assert lm.notes == {}


def test_compiling_the_candidates_is_not_charged_to_the_timing_budget(tmp_path):
    # on an H200, NVRTC compiled every candidate inside the first site's check
    # (17-44 s), the 30 s budget was spent after one site and the rest ran their defaults
    now = [0.0]
    calls = []

    def prepare():
        calls.append(now[0])
        now[0] += 100.0                             # a slow compile

    sites = [site(key=f"s{i}", weight=w)[0] for i, w in enumerate((1.0, 2.0))]
    res = KC.resolve(sites, KEY, path_in(tmp_path), "auto", budget_s=5.0, clock=lambda: now[0],
                     prepare=prepare)
    assert calls == [0.0]
    assert res.source == {"s0": "tuned", "s1": "tuned"} and res.seconds == 0.0
    assert res.prepare_s == 100.0
    assert "2 timed now in 0.0 s after 100.0 s compiling the candidates" in res.summary()

    # nothing to time (the artifact has both): prepare is not called
    res = KC.resolve(sites, KEY, path_in(tmp_path), "auto", prepare=prepare)
    assert calls == [0.0] and res.count("artifact") == 2

    # a failing compile is left to the checks (a candidate that fails is rejected, never fatal)
    def broken():
        raise RuntimeError("nvrtc: error")
    res = KC.resolve([site(key="s9")[0]], KEY, path_in(tmp_path), "force", prepare=broken)
    assert res.source["s9"] == "tuned"
