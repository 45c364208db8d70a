"""The vision encoder + projector (media/vision.py) against llama.cpp's numbers.

The reference arrays in tests/data/vision_ref_*.npy were made by llama.cpp's
multimodal library (libmtmd, through llama-cpp-python 0.3.36) from the same tiny
mmproj files these tests rebuild from fixed seeds (tests/data/make_vision_refs.py);
CI needs no llama.cpp. The gap left (~2e-3 on values of a few units) is ggml's
GELU, which looks its result up in a float16 table on the CPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.errors import MediaError, ModelError

HERE = Path(__file__).resolve().parent
ATOL = 5e-3


def _load(name: str, path: Path):
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def refs():
    return _load("aotx_tests_make_vision_refs", HERE / "data" / "make_vision_refs.py")


@pytest.fixture(scope="module")
def tv():
    return _load("aotx_tests_tiny_vision", HERE / "tiny_vision.py")


def _case(refs, tmp_path, name):
    from PIL import Image

    from aotx.media.vision import VisionEncoder

    mm, _text, rgb = refs.write_case(tmp_path, name)
    return VisionEncoder.open(mm), Image.fromarray(rgb), np.load(HERE / "data" / f"vision_ref_{name}.npy")


def test_mlp_without_class_matches_llama_cpp(refs, tmp_path):
    enc, img, ref = _case(refs, tmp_path, "mlp_noclass_gelu")
    assert enc.cfg.ffn_op == "gelu" and enc.cfg.n_layer_run == enc.cfg.n_layer - 1
    out = enc.embed_image(img)
    assert out.shape == ref.shape == (16, 64) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 1.0  # the comparison is not between two near-zero arrays


@pytest.mark.parametrize("name, size", [("mlp_noclass_gelu_wide", (40, 24)), ("mlp_noclass_gelu_big", (97, 61))])
def test_mlp_letterbox_of_other_sizes_matches_llama_cpp(refs, tmp_path, name, size):
    """A picture not at image_size: fitted (aspect kept) and centred on the pad colour
    as llama.cpp's fixed-size preprocessor does; the same bytes go in."""
    enc, img, ref = _case(refs, tmp_path, name)
    assert img.size == size
    np.testing.assert_allclose(enc.embed_image(img), ref, atol=ATOL, rtol=0)


def test_idefics3_other_size_resize_differs_from_llama_cpp_by_a_bounded_amount(refs, tmp_path):
    """Known gap: AOTX resizes the global image with Lanczos (transformers' Idefics3
    processor), llama.cpp with its own filter; measured 0.30 on values up to ~3."""
    enc, img, ref = _case(refs, tmp_path, "idefics3_wide")
    out = enc.embed_image(img)
    gap = np.abs(out - ref[:4]).max()
    assert 0.05 < gap < 0.5, gap


def test_mlp_with_class_matches_llama_cpp_in_its_layout_and_differs_in_clips(refs, tmp_path):
    """llama.cpp's llava graph appends the class row after the patches (issue 25814);
    in that layout every other step agrees with it. AOTX's default is CLIP's order,
    so its rows differ from llama.cpp's on purpose."""
    enc, img, ref = _case(refs, tmp_path, "mlp")
    px = enc.preprocess(img)
    np.testing.assert_allclose(enc.encode(px, class_layout="llama.cpp-25814"), ref, atol=ATOL, rtol=0)
    clip_order = enc.encode(px)
    assert clip_order.shape == ref.shape
    assert np.abs(clip_order - ref).max() > 0.5


def test_idefics3_matches_llama_cpp(refs, tmp_path):
    enc, img, ref = _case(refs, tmp_path, "idefics3")
    assert enc.cfg.n_tokens == 4  # (32 / 8)^2 patches, pixel shuffle by 2
    out = enc.embed_image(img)
    # llama.cpp encodes a 1 x 1 grid of tiles plus the overview: two equal chunks of 4 rows
    assert ref.shape == (8, 64)
    np.testing.assert_allclose(out, ref[:4], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out, ref[4:], atol=ATOL, rtol=0)


def test_f16_and_q8_weights_load_close_to_f32(tv, tmp_path):
    from PIL import Image

    from aotx.media.vision import VisionEncoder
    from gguf import GGMLQuantizationType as T

    img = Image.fromarray(tv.sample_image(32, seed=3))
    base = VisionEncoder.open(tv.write_tiny_mmproj(tmp_path / "a.gguf", seed=4)).embed_image(img)
    for qt, tol in ((T.F16, 0.02), (T.Q8_0, 0.15)):
        enc = VisionEncoder.open(tv.write_tiny_mmproj(tmp_path / f"{qt.name}.gguf", seed=4, qtype=qt))
        out = enc.embed_image(img)
        err = np.abs(out - base).max() / np.abs(base).max()
        assert 0 < err < tol, (qt.name, err)


def test_preprocess_letterbox_and_normalization(tv, tmp_path):
    from PIL import Image

    from aotx.media.vision import LLAVA_PAD_COLOR, VisionEncoder

    enc = VisionEncoder.open(tv.write_tiny_mmproj(tmp_path / "m.gguf"))
    wide = Image.fromarray(np.full((8, 32, 3), 255, np.uint8))  # 32 x 8, white
    px = enc.preprocess(wide)
    assert px.shape == (32, 32, 3) and px.dtype == np.float32
    mean, std = np.asarray(tv.MEAN, np.float32), np.asarray(tv.STD, np.float32)
    pad = (np.asarray(LLAVA_PAD_COLOR, np.float32) / 255 - mean) / std
    white = (1.0 - mean) / std
    np.testing.assert_allclose(px[0, 0], pad, rtol=1e-6)      # top band: padding
    np.testing.assert_allclose(px[31, 16], pad, rtol=1e-6)    # bottom band
    np.testing.assert_allclose(px[16, 16], white, rtol=1e-6)  # the picture, centred (rows 12..19)
    assert np.allclose(px[12, 5], white) and np.allclose(px[11, 5], pad)


def test_encoder_costs(tv, tmp_path):
    from aotx.media.vision import VisionEncoder

    enc = VisionEncoder.open(tv.write_tiny_mmproj(tmp_path / "m.gguf"))
    assert enc.embeddings_bytes() == 16 * 64 * 4
    n_params = 32 * 3 * 64 + 32 + 17 * 32 + 32 + 2 * 32 + 3 * (4 * (32 * 32 + 32) + 4 * 32 + 2 * 32 * 64 + 64 + 32) \
        + 64 * 32 + 64 + 64 * 64 + 64
    assert enc.weight_bytes == 4 * n_params
    assert enc.working_bytes > 17 * 17 * 4 * 4


@pytest.mark.parametrize("defect, needle", [
    (dict(metadata={"clip.projector_type": "resampler"}), "projector type 'resampler' is not supported"),
    (dict(drop=("clip.vision.patch_size",)), "'clip.vision.patch_size' is missing"),
    (dict(metadata={"clip.vision.image_size": 30}), "not a multiple of patch_size 8"),
    (dict(drop=("v.blk.1.attn_q.weight",)), "tensor 'v.blk.1.attn_q.weight' is missing"),
    (dict(drop=("clip.vision.image_mean",)), "'clip.vision.image_mean' is None, expected 3 numbers"),
    (dict(projector="idefics3", drop=("clip.vision.projector.scale_factor",)),
     "'clip.vision.projector.scale_factor' is missing"),
    (dict(projector="idefics3", scale_factor=3), "scale_factor 3 must be at least 2 and divide the 4 patches"),
])
def test_broken_mmproj_is_named(tv, tmp_path, defect, needle):
    from aotx.media.vision import VisionEncoder

    path = tv.write_tiny_mmproj(tmp_path / "broken.gguf", **defect)
    with pytest.raises(ModelError) as e:
        VisionEncoder.open(path)
    assert needle in str(e.value) and "broken.gguf" in str(e.value)
    assert e.value.exit_code == 2


def test_wrong_files_are_refused(tv, tmp_path, tiny_gguf):
    from aotx.media.vision import VisionEncoder

    text = tiny_gguf.write_tiny_llama(tmp_path / "text.gguf")
    with pytest.raises(ModelError, match="not an mmproj file .* pass the vision projector GGUF"):
        VisionEncoder.open(text)
    mm = tv.write_tiny_mmproj(tmp_path / "m.gguf")
    data = mm.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cut.gguf: .*(truncated|past the end)"):
        VisionEncoder.open(tmp_path / "cut.gguf")
    with pytest.raises(ModelError, match="no such model file"):
        VisionEncoder.open(tmp_path / "missing.gguf")


def test_find_mmproj_beside_the_model(tmp_path):
    from aotx.media.mmproj import find_mmproj

    (tmp_path / "model.gguf").write_bytes(b"x")
    assert find_mmproj(tmp_path / "model.gguf") is None
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-a.gguf").write_bytes(b"x")
    assert find_mmproj(tmp_path / "model.gguf").name == "mmproj-a.gguf"


def test_cuda_device_without_cupy_is_a_clear_error():
    from aotx.media.vision import array_module

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here; the CuPy run is test_cupy_matches_numpy")
    with pytest.raises(MediaError, match="needs CuPy"):
        array_module("cuda")


def test_cupy_matches_numpy(tv, tmp_path):
    """The same code on CUDA through CuPy (run on a GPU machine)."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed: the CUDA run of the vision encoder needs a GPU machine with cupy")
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CuPy cannot reach a GPU: {e}")
    from PIL import Image

    from aotx.media.vision import VisionEncoder

    mm = tv.write_tiny_mmproj(tmp_path / "m.gguf", projector="idefics3")
    img = Image.fromarray(tv.sample_image(32))
    cpu = VisionEncoder.open(mm).embed_image(img)
    gpu = VisionEncoder.open(mm, device="cuda").embed_image(img)
    assert isinstance(gpu, np.ndarray)
    np.testing.assert_allclose(gpu, cpu, atol=1e-4, rtol=1e-4)
