"""Make the vision reference embeddings with llama.cpp (run by hand, not by pytest).

    python tests/data/make_vision_refs.py [--peer-python /tmp/peer/bin/python]

Two interpreters: this one (with numpy and gguf) writes the model files; the
peer one, with llama-cpp-python (0.3.36 was used) for its binding of llama.cpp's
multimodal library ``libmtmd`` (``llama_cpp.mtmd_cpp``), runs this script again in
``--embed`` mode on them (it needs only numpy and llama_cpp there). For
each case it writes a tiny mmproj GGUF and a tiny text GGUF of the same width
from fixed seeds (``tests/tiny_vision.py``, ``tests/tiny_gguf.py``), hands
llama.cpp a deterministic picture through ``mtmd_bitmap_init``, lets
``mtmd_tokenize`` preprocess it and ``mtmd_encode_chunk`` run the encoder and
projector, reads ``mtmd_get_output_embd`` and saves the rows as
``tests/data/vision_ref_<case>.npy`` (float32, (n_tokens, n_embd)). The tests
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


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod



# name -> (mmproj kwargs, picture size)
CASES = {
    "mlp": (dict(projector="mlp", seed=11), 32),
    "mlp_noclass_gelu": (dict(projector="mlp", seed=12, class_embd=False, use_gelu=True), 32),
    "idefics3": (dict(projector="idefics3", seed=13), 32),
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


def write_case(td: Path, name: str) -> tuple[Path, Path, np.ndarray]:
    """Write case ``name``'s mmproj and text GGUF under ``td``; return them and the picture."""
    tiny_vision = _load("tiny_vision")
    tiny_gguf = _load("tiny_gguf")
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
        subprocess.run([a.peer_python, __file__, "--embed", td], check=True)


if __name__ == "__main__":
    main()
