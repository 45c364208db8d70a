"""Images through a vision encoder inside the engine: the embeddings land at the
image's positions, prefix reuse stops at a different image and continues over the
same one, an image that does not fit the context is refused with a notice while
the message is kept, and ``serve`` pairs a text model with its mmproj.

Tiny models throughout: a 64-wide text GGUF (tests/models/llama.py) and a 64-wide
mlp mmproj (tests/tiny_vision.py); the independent check is a direct forward
pass of the text model with the encoder's rows in place of the token embeddings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.media_prompt import PLACEHOLDER_BASE, ImageStore, marker
from tests.fakes.sink import EventSink

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    """A helper module of tests/ by path (pytest's importlib mode puts tests/ on no path)."""
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def _tv():
    return _load("aotx_tests_tiny_vision", HERE / "tiny_vision.py")


@pytest.fixture(scope="module")
def pair(tiny_gguf, tmp_path_factory):
    """(LoadedModel, VisionEncoder, dir) for a tiny text model and its mmproj."""
    from aotx.engine.model.loader import load_model
    from aotx.media.vision import VisionEncoder

    d = tmp_path_factory.mktemp("vision")
    text = tiny_gguf.write_tiny_llama(d / "text.gguf", d_model=64, ffn=128, seed=5, context_length=512)
    mm = _tv().write_tiny_mmproj(d / "mmproj-tiny.gguf", projector="mlp", seed=11)
    return load_model(text), VisionEncoder.open(mm), d


def _png(path: Path, seed: int) -> Path:
    from PIL import Image

    Image.fromarray(_tv().sample_image(32, seed=seed)).save(path)
    return path


def _engine(lm, enc, n_ctx=256):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=2, n_ctx=n_ctx, speculative="off")
    eng.vision, eng.images = enc, ImageStore()
    eng.start()
    return eng


def _conv(eng) -> str:
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title="t"), s)
    assert s.done.wait(30)
    return s.events[0].conversation.conv_id


def _ask(eng, cid, text, image: Path | None, n=4, rid=2) -> EventSink:
    s = EventSink()
    att = [P.Attachment(path=str(image), kind="image", name=image.name)] if image else []
    eng.post(P.SubmitMessage(id=rid, conv_id=cid, text=text, attachments=att,
                             sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0, max_tokens=n)), s)
    assert s.done.wait(120), s.events
    return s


def _span(ids: list[int]) -> tuple[int, int]:
    at = [i for i, t in enumerate(ids) if t >= PLACEHOLDER_BASE]
    return (at[0], at[-1] + 1) if at else (-1, -1)


def test_image_rows_reach_the_model_at_their_positions(pair, tmp_path):
    from PIL import Image

    lm, enc, _ = pair
    img = _png(tmp_path / "cat.png", seed=1)
    eng = _engine(lm, enc)
    try:
        s = _ask(eng, _conv(eng), "what is this?", img)
    finally:
        eng.stop()
    info = s.one(P.MediaInfo)
    assert (info.route, info.kind, info.error) == ("encoder", "image", "")
    ids = s.one(P.Accepted).prompt_ids
    a, b = _span(ids)
    assert b - a == enc.cfg.n_tokens == 16 and all(t >= PLACEHOLDER_BASE for t in ids[a:b])
    assert all(t < lm.config.vocab_size for t in ids[:a] + ids[b:])
    # independent: the text model's forward over the same ids with the encoder's rows there
    from aotx.engine.model.batch import Segment

    rows = enc.embed_image(Image.open(img).convert("RGB"))
    model = lm.model
    kv = model.new_kv_cache(1, 256)
    tok = np.asarray(ids, np.int32)
    logits = model.forward(tok, [Segment(0, 0, len(ids))], kv, embeds=(np.arange(a, b), rows))
    first = s.one(P.Committed)
    got = [e.token_id for e in s.events if isinstance(e, P.Token)]
    assert first.finish_reason in ("length", "stop") and got
    assert got[0] == int(np.argmax(logits[0]))
    # and the picture matters: another picture's rows change the logits
    other = enc.embed_image(Image.fromarray(_tv().sample_image(32, seed=9)))
    kv2 = model.new_kv_cache(1, 256)
    logits2 = model.forward(tok, [Segment(0, 0, len(ids))], kv2, embeds=(np.arange(a, b), other))
    assert np.abs(logits2 - logits).max() > 1e-3


def test_prefix_reuse_follows_the_picture(pair, tmp_path):
    lm, enc, _ = pair
    one, two = _png(tmp_path / "one.png", seed=1), _png(tmp_path / "two.png", seed=2)
    eng = _engine(lm, enc)
    try:
        c1, c2 = _conv(eng), _conv(eng)
        s1 = _ask(eng, c1, "describe", one)
        s3 = _ask(eng, c1, "and now?", None, rid=4)  # the same conversation, a later turn
        s2 = _ask(eng, c2, "describe", two, rid=3)  # another picture, same words
    finally:
        eng.stop()
    p1, p2, p3 = (s.one(P.Accepted).prompt_ids for s in (s1, s2, s3))
    a, b = _span(p1)
    # two pictures, same text: the ids part at the first image position
    from aotx.engine.state.prefix import common_prefix

    assert common_prefix(p1, p2) == a
    # the later turn re-renders the first picture in the same place with the same ids
    assert p3[:len(p1)] == p1 and _span(p3) == (a, b)
    reused = s3.one(P.Committed).timings["prompt_tokens_reused"]
    assert reused > b  # the KV of the picture's positions was reused, not re-run
    assert s2.one(P.Committed).timings["prompt_tokens_reused"] <= a


def test_image_that_does_not_fit_is_refused_and_the_message_kept(pair, tmp_path):
    from aotx.engine.runtime.media_prompt import encode_chat_with_images, image_key, left_out_note

    from aotx.media.vision import VisionEncoder

    lm, _, _ = pair
    # 64 x 64 pixels in 8 x 8 patches: 64 positions, more than the note that replaces them
    enc = VisionEncoder.open(_tv().write_tiny_mmproj(tmp_path / "mm64.gguf", image_size=64, seed=11))
    from PIL import Image

    img = tmp_path / "big.png"
    Image.fromarray(_tv().sample_image(64, seed=1)).save(img)
    # a context that holds the message with the note but not with the picture
    st = ImageStore()
    key = image_key(img.read_bytes(), enc.name)
    st.put(key, "big.png", np.zeros((64, 64), np.float32))
    n_with = len(encode_chat_with_images(lm.tokenizer, lm.template,
                                         [{"role": "user", "content": f"{marker(key)}\n\nhi"}], st))
    n_note = len(encode_chat_with_images(lm.tokenizer, lm.template,
                                         [{"role": "user", "content": f"{left_out_note('big.png')}\n\nhi"}], st))
    n_ctx = n_note + 3
    assert n_with + 1 > n_ctx
    eng = _engine(lm, enc, n_ctx=n_ctx)
    try:
        s = _ask(eng, _conv(eng), "hi", img, n=2)
    finally:
        eng.stop()
    notes = [e for e in s.events if isinstance(e, P.Notice) and e.kind == "refused"]
    assert len(notes) == 1, s.events
    n = notes[0]
    assert (n.resource, n.asked, n.free) == ("context", 64, n_ctx - 1 - (n_with - 64))
    assert n.message == (f"image big.png needs 64 tokens of context, {n.free} free in this conversation: "
                         "start a new conversation or serve with --context 512")
    ids = s.one(P.Accepted).prompt_ids
    assert _span(ids) == (-1, -1) and len(ids) == n_note
    assert s.one(P.Committed).finish_reason in ("length", "stop")


def test_image_store_ids_and_eviction():
    st = ImageStore(max_bytes=2 * 16 * 8 * 4)
    a = st.put("00000000000000aa", "a.png", np.ones((16, 8), np.float32))
    assert st.put("00000000000000aa", "a.png", np.zeros((16, 8), np.float32)) is a  # same key: kept
    b = st.put("00000000000000ab", "b.png", np.full((16, 8), 2, np.float32))  # a clash: moved apart
    assert not set(a.ids) & set(b.ids) and a.ids[0] == PLACEHOLDER_BASE + 0xaa
    assert min(a.ids + b.ids) >= PLACEHOLDER_BASE and max(a.ids + b.ids) < 2 ** 31
    toks = np.asarray([5, a.ids[3], 7, b.ids[0]], np.int32)
    pos, rows = st.rows_for(toks, 8)
    assert pos.tolist() == [1, 3] and rows[:, 0].tolist() == [1.0, 2.0]
    assert st.rows_for(np.asarray([1, 2, 3], np.int32), 8) is None
    st.put("00000000000000ac", "c.png", np.full((16, 8), 3, np.float32))  # evicts a (least recent)
    assert st.get("00000000000000aa") is None
    pos, rows = st.rows_for(np.asarray([a.ids[0]], np.int32), 8)
    assert rows.tolist() == [[0.0] * 8]  # gone: a zero row, never a crash
    assert marker("00000000000000ab") == "<__image_00000000000000ab__>"


def test_profile_and_prompt_with_an_encoder(pair, tmp_path):
    from aotx.media.profile import prepare, profile_for, render_for_prompt

    lm, enc, _ = pair
    prof = profile_for(lm, vision=enc)
    r = prof.route("image")
    assert (r.route, r.model, r.weights_bytes) == ("encoder", enc.name, enc.weight_bytes)
    assert "16 embeddings" in r.receives and r.available
    store = ImageStore()
    res = prepare(_png(tmp_path / "x.png", seed=4), vision=enc, images=store)
    assert (res.route, res.positions, res.text) == ("encoder", 16, "")
    assert store.get(res.key).rows.shape == (16, 64)
    assert render_for_prompt([res], "what?") == f"{marker(res.key)}\n\nwhat?"
    assert res.to_event()["route"] == "encoder"


def test_serve_pairs_the_mmproj_with_the_model(pair, tmp_path, tiny_gguf):
    from aotx.engine.errors import ModelError
    from aotx.engine.cli.serve import load_vision

    lm, enc, d = pair
    found = load_vision(None, lm, "cpu")  # mmproj-tiny.gguf sits beside text.gguf
    assert found is not None and found.path.name == "mmproj-tiny.gguf"
    assert load_vision("none", lm, "cpu") is None
    from aotx.engine.errors import UsageError

    with pytest.raises(UsageError, match="--mmproj nope.gguf: no such file"):
        load_vision("nope.gguf", lm, "cpu")
    wide = _tv().write_tiny_mmproj(tmp_path / "wide.gguf", n_embd_out=96)
    with pytest.raises(ModelError, match="outputs 96-wide embeddings, the text model text.gguf is 64 wide"):
        load_vision(str(wide), lm, "cpu")


def test_prompt_with_a_picture_matches_llama_cpp(tmp_path):
    """The whole path against llama.cpp's (tests/data/make_vision_refs.py): its
    mtmd_tokenize + mtmd_helper_eval_chunks on "look: <picture> ok" into a float32 text
    model; here AOTX's tokenizer, encoder and forward with the rows at those positions.
    The last position's logits agree to the encoder's GELU-table gap."""
    from PIL import Image

    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model
    from aotx.media.vision import VisionEncoder

    refs = _load("aotx_tests_make_vision_refs", HERE / "data" / "make_vision_refs.py")
    mm, _, rgb = refs.write_case(tmp_path, refs.PROMPT_CASE)
    lm = load_model(refs.write_prompt_text(tmp_path))
    enc = VisionEncoder.open(mm)
    want_ids = np.load(HERE / "data" / "vision_prompt_ids.npy")
    want = np.load(HERE / "data" / "vision_prompt_logits.npy")
    img = np.nonzero(want_ids < 0)[0]
    a, b = int(img[0]), int(img[-1]) + 1
    tok = lm.tokenizer
    assert want_ids[:a].tolist() == tok.encode("look: ", parse_special=True)
    assert want_ids[b:].tolist() == tok.encode(" ok", parse_special=True)
    ids = want_ids.copy()
    ids[a:b] = PLACEHOLDER_BASE + np.arange(b - a)
    rows = enc.embed_image(Image.fromarray(rgb))
    kv = lm.model.new_kv_cache(1, 64)
    got = lm.model.forward(ids, [Segment(0, 0, len(ids))], kv, embeds=(np.arange(a, b), rows))[0]
    assert got.shape == want.shape == (300,)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=0)  # measured: 2.9e-3 (2.4e-3 with its own rows)
    assert int(np.argmax(got)) == int(np.argmax(want))
    assert np.abs(want).max() > 0.5


def test_aotx_run_attach_with_mmproj_beside_the_model(pair, tmp_path):
    """`aotx run --attach` end to end: the engine it starts finds mmproj*.gguf beside the
    model, the JSON media event says the encoder took the picture, and the prompt holds
    the picture's positions."""
    import json
    import os
    import re
    import signal
    import subprocess
    import tempfile

    _, enc, d = pair
    img = _png(tmp_path / "cat.png", seed=3)
    sock = Path(tempfile.mkdtemp(prefix="aotx-v", dir="/tmp")) / "s.sock"
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--model", str(d / "text.gguf"), "--socket",
                        str(sock), "--json", "--temperature", "0", "--max-tokens", "2", "--device", "cpu", "--attach", str(img),
                        "what is it"], env=env, capture_output=True, text=True, timeout=120)
    pid = re.search(r"pid (\d+)", r.stderr)
    try:
        assert r.returncode == 0, r.stderr
        events = [json.loads(line) for line in r.stdout.splitlines()]
        media = [e for e in events if e["event"] == "media"]
        assert [(m["route"], m["kind"], m["name"], m["via"]) for m in media] == [
            ("encoder", "image", "cat.png", enc.name)]
        done = next(e for e in events if e["event"] == "done")
        assert sum(1 for t in done["prompt_ids"] if t >= PLACEHOLDER_BASE) == 16
        log = (tmp_path / "home" / "engine.log").read_text()
        assert "vision: mmproj-tiny.gguf (mlp, 32 x 32 px -> 16 positions per image), found beside the model" in log
    finally:
        if pid:
            os.kill(int(pid.group(1)), signal.SIGTERM)


def test_models_listing_shows_the_encoder_route(pair, tmp_path, monkeypatch):
    import shutil

    from aotx.engine import paths
    from aotx.engine.cli.local import _media_profile
    from aotx.engine.model.loader import list_models

    _, enc, d = pair
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    paths.models_dir().mkdir(parents=True, exist_ok=True)
    for f in ("text.gguf", "mmproj-tiny.gguf"):
        shutil.copy(d / f, paths.models_dir() / f)
    # the projector goes with its model, it is not a model of its own
    assert [m["name"] for m in list_models() if not m["default"]] == ["text"]
    prof = _media_profile(str(d / "text.gguf"))
    assert prof["mmproj"].endswith("mmproj-tiny.gguf")
    image = next(r for r in prof["routes"] if r["kind"] == "image")
    assert (image["route"], image["model"], image["weights_bytes"]) == ("encoder", enc.name, enc.weight_bytes)
    assert "image: encoder tiny-mlp-mmproj" in prof["summary"]


def test_idefics3_images_are_wrapped_in_the_global_image_tokens(tiny_gguf, tmp_path):
    """SmolVLM's vocabulary has <fake_token_around_image> and <global-img>: an image is
    placed as <fake_token_around_image><global-img> rows <fake_token_around_image>, as
    transformers' Idefics3 processor (without splitting) and llama.cpp's mtmd write it."""
    import gguf
    from gguf import GGUFValueType as V

    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime.media_prompt import encode_chat_with_images, special_wrap

    tokens, types, _ = tiny_gguf.vocabulary(300)
    tokens[-2:] = ["<fake_token_around_image>", "<global-img>"]
    types[-2:] = [int(gguf.TokenType.USER_DEFINED)] * 2
    lm = load_model(tiny_gguf.write_tiny_llama(tmp_path / "smol.gguf", d_model=64, ffn=128, metadata={
        "tokenizer.ggml.tokens": (tokens, V.ARRAY), "tokenizer.ggml.token_type": (types, V.ARRAY)}))
    pre, post = special_wrap(lm.tokenizer, "idefics3")
    assert (pre, post) == ((298, 299), (298,))
    assert special_wrap(lm.tokenizer, "mlp") == ((), ())
    st = ImageStore(wrap=(pre, post))
    item = st.put("0123456789abcdef", "x.png", np.zeros((4, 64), np.float32))
    ids = encode_chat_with_images(lm.tokenizer, lm.template,
                                  [{"role": "user", "content": f"{marker(item.key)}\n\nhi"}], st)
    a = ids.index(item.ids[0])
    assert ids[a - 2:a] == [298, 299] and ids[a:a + 4] == list(item.ids) and ids[a + 4] == 298
    # a marker whose picture is gone reads as text, never as placeholders
    gone = encode_chat_with_images(lm.tokenizer, lm.template,
                                   [{"role": "user", "content": f"{marker('fedcba9876543210')} hi"}], st)
    assert all(t < PLACEHOLDER_BASE for t in gone)
    assert "no longer available" in lm.tokenizer.decode(gone)


def test_raw_prompt_with_a_picture(pair, tmp_path):
    """A raw (no template) prompt places the picture too: its words, then its rows."""
    lm, enc, _ = pair
    eng = _engine(lm, enc)
    try:
        s = EventSink()
        img = _png(tmp_path / "r.png", seed=5)
        eng.post(P.SubmitMessage(id=2, conv_id=_conv(eng), text="caption:", raw=True,
                                 attachments=[P.Attachment(path=str(img), kind="image", name="r.png")],
                                 sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0, max_tokens=2)), s)
        assert s.done.wait(120), s.events
    finally:
        eng.stop()
    ids = s.one(P.Accepted).prompt_ids
    a, b = _span(ids)
    assert (a, b - a) == (0, 16)  # render_for_prompt puts the picture first
    assert ids[b:] == lm.tokenizer.encode("\n\ncaption:", parse_special=False)


def test_restart_encodes_earlier_pictures_again_from_the_journal(pair, tmp_path):
    """The journal keeps the message's text (with the picture's marker) and its attachment;
    a restarted engine has no rows in memory and encodes the file again, so the next turn
    puts the same picture, with the same placeholder ids, in the same place."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    lm, enc, _ = pair
    img = _png(tmp_path / "kept.png", seed=6)
    gone = _png(tmp_path / "gone.png", seed=7)

    def engine(store):
        eng = Engine(lm, store, n_slots=2, n_ctx=256, speculative="off")
        eng.vision, eng.images = enc, ImageStore()
        eng.start()
        return eng

    store = open_store(tmp_path / "journal")
    eng = engine(store)
    try:
        cid = _conv(eng)
        first = _ask(eng, cid, "look", img).one(P.Accepted).prompt_ids
        cid2 = _conv(eng)
        _ask(eng, cid2, "look", gone, rid=3)
    finally:
        eng.stop()
        store.close()
    gone.unlink()
    store = open_store(tmp_path / "journal")
    eng = engine(store)
    try:
        again = _ask(eng, cid, "and now?", None, rid=4).one(P.Accepted).prompt_ids
        lost = _ask(eng, cid2, "and now?", None, rid=5).one(P.Accepted).prompt_ids
    finally:
        eng.stop()
        store.close()
    assert again[:len(first)] == first and _span(again) == _span(first)
    assert _span(lost) == (-1, -1)  # its file is gone: the marker reads as text
    assert "no longer available" in lm.tokenizer.decode(lost)


def _cuda_why() -> str:
    try:
        import cupy

        return "" if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device: CuPy sees 0 devices"
    except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
        return f"no CUDA device: {type(e).__name__}: {e}"


@pytest.mark.skipif(bool(_cuda_why()), reason=_cuda_why() or "-")
def test_cuda_engine_places_image_rows_like_the_cpu(tiny_gguf, tmp_path):
    """The encoder on CuPy and the CUDA forward with image rows (eager path) against
    the CPU backend's float path on the same picture and prompt."""
    from PIL import Image

    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model
    from aotx.media.vision import VisionEncoder

    text = tiny_gguf.write_tiny_llama(tmp_path / "t64.gguf", seed=4, d_model=256, n_heads=4, n_kv_heads=2, ffn=512,
                                      context_length=512)
    mm = _tv().write_tiny_mmproj(tmp_path / "mmproj-t.gguf", projector="mlp", seed=11, n_embd_out=256)
    cpu, gpu = load_model(text, device="cpu", int8_activations=False), load_model(text, device="cuda")
    enc_c, enc_g = VisionEncoder.open(mm), VisionEncoder.open(mm, device="cuda")
    img = Image.fromarray(_tv().sample_image(32, seed=1))
    rc, rg = enc_c.embed_image(img), np.asarray(enc_g.embed_image(img))
    assert rc.shape == rg.shape and float(np.abs(rg - rc).max()) < 1e-3 * max(1.0, float(np.abs(rc).max()))
    ids = np.concatenate([np.arange(5, 12), PLACEHOLDER_BASE + np.arange(rc.shape[0]), np.arange(20, 30)])
    spans = (np.arange(7, 7 + rc.shape[0]), rc)
    outs = []
    for lm in (cpu, gpu):
        kv = lm.model.new_kv_cache(1, 128)
        outs.append(lm.model.forward(ids.astype(np.int32), [Segment(0, 0, len(ids))], kv, embeds=spans))
    rel = float(np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0]))
    assert rel < 2e-3, rel
