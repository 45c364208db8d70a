"""Make the vision reference embeddings with llama.cpp (run by hand, not by pytest).

    python tests/data/make_vision_refs.py [--peer-python /tmp/peer/bin/python]

Two interpreters: this one (with numpy and gguf) writes the model files; the
peer one, with llama-cpp-python (0.3.36 was used) for its binding of llama.cpp's
multimodal library ``libmtmd`` (``llama_cpp.mtmd_cpp``), runs this script again in
``--embed`` mode on them (it needs only numpy and llama_cpp there). For
each case it writes a tiny mmproj GGUF and a tiny text GGUF of the same width
from fixed seeds (``tests/tiny_vision.py``, ``tests/models/llama.py``), hands
llama.cpp a deterministic picture through ``mtmd_bitmap_init``, lets
``mtmd_tokenize`` preprocess it and ``mtmd_encode_chunk`` run the encoder and
projector, reads ``mtmd_get_output_embd`` and saves the rows as
``tests/data/vision_ref_<case>.npy`` (float32, (n_tokens, n_embd)). For one case it
also runs llama.cpp's whole pipeline on a prompt around the picture
(``mtmd_helper_eval_chunks`` into a float32 text model) and saves the prompt's ids
(-1 at image positions) and the last position's logits
(``vision_prompt_ids.npy``, ``vision_prompt_logits.npy``). The tests
rebuild the same files from the same seeds and compare AOTX's encoder with these
arrays, so CI needs no llama.cpp. Run on the CPU backend (use_gpu False).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


def _load(name: str, path: Path | None = None):
    spec = importlib.util.spec_from_file_location(name, path or TESTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod



# name -> (mmproj kwargs, picture size: side, or (width, height))
CASES = {
    "mlp": (dict(projector="mlp", seed=11), 32),
    "mlp_noclass_gelu": (dict(projector="mlp", seed=12, class_embd=False, use_gelu=True), 32),
    "idefics3": (dict(projector="idefics3", seed=13), 32),
    # pictures of other sizes: llama.cpp's own resize (letterbox for mlp, stretch for idefics3)
    "mlp_noclass_gelu_wide": (dict(projector="mlp", seed=12, class_embd=False, use_gelu=True), (40, 24)),
    "mlp_noclass_gelu_big": (dict(projector="mlp", seed=12, class_embd=False, use_gelu=True), (97, 61)),
    "idefics3_wide": (dict(projector="idefics3", seed=13), (40, 24)),
}


def llama_cpp_embeddings(mmproj: Path, text: Path, rgb: np.ndarray) -> np.ndarray:
    import llama_cpp
    from llama_cpp import mtmd_cpp as M

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(text).encode(), mp)
    assert model, "text model did not load"
    cp = M.mtmd_context_params_default()
    cp.use_gpu = False
    cp.n_threads = 1
    cp.warmup = False
    cp.flash_attn_type = 0  # disabled: flash attention casts K and V to float16
    ctx = M.mtmd_init_from_file(str(mmproj).encode(), model, cp)
    assert ctx, "mtmd_init_from_file failed"
    h, w, _ = rgb.shape
    buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes())
    bmp = M.mtmd_bitmap_init(w, h, buf)
    chunks = M.mtmd_input_chunks_init()
    marker = M.mtmd_default_marker() if hasattr(M, "mtmd_default_marker") else b"<__media__>"
    if not isinstance(marker, bytes):
        marker = b"<__media__>"
    prompt = b"look: " + marker + b" ok"
    txt = M.mtmd_input_text(prompt, len(prompt), False, True)
    arr = (M.mtmd_bitmap_p_ctypes * 1)(bmp)
    rc = M.mtmd_tokenize(ctx, chunks, ctypes.byref(txt), arr, 1)
    assert rc == 0, f"mtmd_tokenize returned {rc}"
    n_embd = llama_cpp.llama_model_n_embd(model)
    rows = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(ch) != M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            continue
        n = M.mtmd_input_chunk_get_n_tokens(ch)
        assert M.mtmd_encode_chunk(ctx, ch) == 0, "mtmd_encode_chunk failed"
        ptr = M.mtmd_get_output_embd(ctx)
        rows.append(np.ctypeslib.as_array(ptr, shape=(n * n_embd,)).reshape(n, n_embd).copy())
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bmp)
    M.mtmd_free(ctx)
    llama_cpp.llama_model_free(model)
    print(f"  {len(rows)} image chunk(s): {[r.shape for r in rows]}")
    return rows


PROMPT_CASE = "mlp_noclass_gelu"  # the whole prompt through llama.cpp: text, picture, text
PROMPT = b"look: <__media__> ok"


def llama_cpp_prompt_logits(mmproj: Path, text: Path, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's own pipeline on PROMPT (``mtmd_tokenize`` then ``mtmd_helper_eval_chunks``):
    the prompt's ids, -1 at image positions ((n,) int32), and the last position's
    logits ((vocab,) float32)."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as M

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(text).encode(), llama_cpp.llama_model_default_params())
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 256, 256, 256
    cparams.n_threads = cparams.n_threads_batch = 1
    lctx = llama_cpp.llama_init_from_model(model, cparams)
    cp = M.mtmd_context_params_default()
    cp.use_gpu, cp.n_threads, cp.warmup, cp.flash_attn_type = False, 1, False, 0
    ctx = M.mtmd_init_from_file(str(mmproj).encode(), model, cp)
    h, w, _ = rgb.shape
    bmp = M.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes()))
    chunks = M.mtmd_input_chunks_init()
    txt = M.mtmd_input_text(PROMPT, len(PROMPT), False, True)
    assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(txt), (M.mtmd_bitmap_p_ctypes * 1)(bmp), 1) == 0
    ids: list[int] = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            ids.extend(int(ptr[j]) for j in range(n.value))
        else:
            ids.extend([-1] * M.mtmd_input_chunk_get_n_tokens(ch))
    new_n_past = llama_cpp.llama_pos(0)
    assert M.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 256, True, ctypes.byref(new_n_past)) == 0
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    lp = llama_cpp.llama_get_logits_ith(lctx, -1)
    logits = np.ctypeslib.as_array(lp, shape=(n_vocab,)).astype(np.float32).copy()
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bmp)
    M.mtmd_free(ctx)
    llama_cpp.llama_free(lctx)
    llama_cpp.llama_model_free(model)
    assert new_n_past.value == len(ids)
    return np.asarray(ids, np.int32), logits


def write_prompt_text(td: Path) -> Path:
    """The text model of the prompt case: float32 weights (llama.cpp's float32 matmul
    then leaves only summation-order differences)."""
    from gguf import GGMLQuantizationType as T

    return _load("tiny_gguf", TESTS / "models" / "llama.py").write_tiny_llama(td / "text-prompt.gguf", d_model=64, ffn=128, seed=5, qtype=T.F32)


def write_case(td: Path, name: str) -> tuple[Path, Path, np.ndarray]:
    """Write case ``name``'s mmproj and text GGUF under ``td``; return them and the picture."""
    tiny_vision = _load("tiny_vision")
    tiny_gguf = _load("tiny_gguf", TESTS / "models" / "llama.py")
    kw, size = CASES[name]
    mm = tiny_vision.write_tiny_mmproj(td / f"mmproj-{name}.gguf", **kw)
    text = tiny_gguf.write_tiny_llama(td / f"text-{name}.gguf", d_model=64, ffn=128, seed=5)
    rgb = tiny_vision.sample_image(size, seed=1)
    np.save(td / f"image-{name}.npy", rgb)
    return mm, text, rgb


def embed(td: Path) -> None:
    for name in CASES:
        print(name)
        rgb = np.load(td / f"image-{name}.npy")
        rows = llama_cpp_embeddings(td / f"mmproj-{name}.gguf", td / f"text-{name}.gguf", rgb)
        out = np.concatenate(rows, axis=0).astype(np.float32) if len(rows) > 1 else rows[0].astype(np.float32)
        np.save(HERE / f"vision_ref_{name}.npy", out)
        if len(rows) > 1:
            np.save(HERE / f"vision_ref_{name}_chunks.npy", np.array([len(r) for r in rows], np.int32))
        print(f"  saved {out.shape}")
    ids, logits = llama_cpp_prompt_logits(td / f"mmproj-{PROMPT_CASE}.gguf", td / "text-prompt.gguf",
                                          np.load(td / f"image-{PROMPT_CASE}.npy"))
    np.save(HERE / "vision_prompt_ids.npy", ids)
    np.save(HERE / "vision_prompt_logits.npy", logits)
    print(f"prompt: {len(ids)} positions ({int((ids < 0).sum())} image), logits {logits.shape}")


def main() -> None:
    import argparse
    import subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--embed", metavar="DIR", help="(internal) run llama.cpp on the files in DIR")
    a = ap.parse_args()
    if a.embed:
        embed(Path(a.embed))
        return
    with tempfile.TemporaryDirectory() as td:
        for name in CASES:
            write_case(Path(td), name)
        write_prompt_text(Path(td))
        subprocess.run([a.peer_python, __file__, "--embed", td], check=True)


if __name__ == "__main__":
    main()
