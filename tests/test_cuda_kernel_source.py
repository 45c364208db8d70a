"""The CUDA kernels' source files (engine/backend/cuda/kernels/) and their loader
(engine/backend/cuda/source.py), without a GPU.

Same bits as before the kernels left Python strings: the code each module hands NVRTC is
compared with what the old strings held. The pinned sha256 values were computed from
``git show fcf9a78:engine/backend/cuda_src.py`` (``SRC``; the kernels module is that text up
to its "fp16 decode GEMV (gemv_h)" section, which now lives in tests/tools/gemv_h.cu) and
``git show fcf9a78:engine/backend/cuda_sampling.py`` (``SRC``), normalized as ``_code`` does:
``#line`` markers dropped, ``//`` comments cut, trailing blanks and empty lines dropped. What
a compiler does cannot depend on what that drops, so equal hashes mean NVRTC gets the same
code, in the same order, as before. When the files were made (commit 4707fdd) the text also
matched line for line, comments included (sha256 of the text less its ``#line`` markers:
kernels 0fe95549..., kernels+gemv_h 4b6ca1b4..., sampling ca0f340f...); comments have
changed since.

The quantized KV caches (merge 8855eeb) changed the kernels module: kv_quant.cu joined it
before gemv.cu, attn_decode.cu, attn_prefill.cu and head_rope_kv gained ``if constexpr (KVT >=
2)`` branches and head_rope_kv four rotation arguments, so the hashes were pinned again on that
text (the old ones: kernels c3105770..., kernels+gemv_h d2958a1e...). The float16/float32
cache paths read the same in those branches, but equal bits are no longer proven by text: the
proof for this text is the GPU run of 2026-12-07 (H100: the reshape's same-bits check was on
the old text; on this one tests/test_cuda_invariance.py passed the 7 tests it reached before
its time was cut, and the quantized capsule tests passed). Pinned a third time (old: kernels
6b996c59..., kernels+gemv_h 581d3619...) when kv_quant.cu's block store wrote its float16
scale as one 16-bit store instead of two bytes (the byte split lost the low byte on an H200,
2026-12-07): a change inside the quantized caches only.

An NVRTC error names the kernel file and line: a deliberately broken copy of the files goes
through the backend's compile path (on the fake CuPy, whose stand-in compiler reports a
``#error`` directive where NVRTC would, following the ``#line`` markers).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aotx.engine.backend.cuda import sampling as CS
from aotx.engine.backend.cuda import source as S

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "engine" / "backend" / "cuda" / "kernels"

#: module -> sha256 of its code (``_code``): the old strings', pinned again with the quantized
#: KV caches' branches (module docstring)
_CODE = {"kernels": "03ef5cd6ed585337f47b892ff161cb08756c62d901a3666d0c029862dc574be0",
         "kernels+gemv_h": "ec2b551c27c77bd6c7440b5157be600f535f96b2ac66f636be35d94ea456eddd",
         "sampling": "207ded8ddc6d37737dc534f55047779d9f4db1cd29fe81c27bf93770aaa78e23"}


def _uncomment(line: str) -> str:
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return line[:i]
    return line


def _code(text: str) -> str:
    out = []
    for line in text.split("\n"):
        if line.startswith("#line "):
            continue
        line = _uncomment(line).rstrip()
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


#: kernel files added since those strings and outside the pinned hashes (kv_quant.cu is inside;
#: recurrent.cu, hybrid models' layers, came last: the pins did not move)
_NEW_FILES = ("mmq.cu", "recurrent.cu")


def _modules() -> dict[str, str]:
    """Each module's text as NVRTC gets it, less the files added since the old strings (they
    come last in ``KERNEL_FILES``, after every file the strings held)."""
    sys.path.insert(0, str(ROOT))
    from tests.tools import gemv_h

    old = tuple(f for f in S.KERNEL_FILES if f not in _NEW_FILES)
    assert S.KERNEL_FILES[:len(old)] == old, "a new kernel file must come after the old ones"
    extra = (("tests/tools/gemv_h.cu", gemv_h.FILE.read_text()),)
    return {"kernels": S.build(old, "kernels").text, "kernels+gemv_h": S.build(old, "kernels+gemv_h", extra=extra).text,
            "sampling": CS.SRC}


@pytest.mark.parametrize("name", sorted(_CODE))
def test_each_module_hands_nvrtc_the_old_strings_code(name):
    assert _sha(_code(_modules()[name])) == _CODE[name], \
        f"the {name} module's code changed: same bits are no longer proven by text (update _CODE only with a GPU run)"


def test_the_engine_uses_the_loaders_modules():
    from aotx.engine.backend.cuda import source

    assert source.SRC == source.KERNELS.text and CS.SRC == source.SAMPLING.text
    assert [p[0] for p in S.KERNELS.parts] == [S.FILE_PREFIX + f for f in S.KERNEL_FILES]
    assert "gemv_h" not in S.KERNELS.text          # the measurement candidate is not compiled by the engine


def test_every_kernel_file_is_in_a_module_and_installed_as_package_data():
    on_disk = {p.name for p in KERNELS.iterdir() if p.suffix in (".cu", ".cuh")}
    assert on_disk == set(S.KERNEL_FILES) | set(S.SAMPLING_FILES)
    toml = (ROOT / "pyproject.toml").read_text()
    assert '"aotx.engine.backend.cuda" = ["kernels/*.cu", "kernels/*.cuh"]' in toml


def test_each_file_sits_behind_its_line_marker():
    text = S.KERNELS.text.split("\n")
    for path, first, n in S.KERNELS.parts:
        assert text[first - 2] == f'#line 1 "{path}"'
        body = (ROOT / path).read_text().split("\n")
        assert text[first - 1:first - 1 + n] == body[:n]
        assert S.KERNELS.locate(first + 4) == (path, 5)


def test_a_log_in_the_modules_own_lines_is_told_as_file_and_line():
    path, first, _ = S.KERNELS.parts[3]                    # gemv.cu
    log = f"/tmp/tmpx/kern.cu({first + 9}): error: identifier \"q\" is undefined\n"
    assert S.KERNELS.explain(log).startswith(f"{path}:10: error: identifier")
    kept = f"{path}(12): warning: variable \"a\" was declared but never referenced\n"
    assert S.KERNELS.explain(kept).startswith(f"{path}:12: warning")


def test_the_kernel_source_hash_changes_with_any_kernel_file(tmp_path):
    from aotx.engine.backend import kernel_choice

    def key(root):
        k, s = S.build(S.KERNEL_FILES, "kernels", root), S.build(S.SAMPLING_FILES, "sampling", root)
        return kernel_choice.source_hash(k.text, s.text, "-std=c++17")

    shutil.copytree(KERNELS, tmp_path / "k")
    base = key(tmp_path / "k")
    assert base == key(KERNELS)
    for f in ("moe.cu", "sampling.cu", "common.cuh"):
        shutil.copytree(KERNELS, tmp_path / f, dirs_exist_ok=True)
        p = tmp_path / f / f
        p.write_text(p.read_text() + "// one more line\n")
        assert key(tmp_path / f) != base, f


_BROKEN = r"""
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.tools import gpu_fake_cupy as F
F.install()
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.backend import compile_module
m = S.build(S.KERNEL_FILES, "kernels", Path({kdir!r}))
try:
    compile_module(m, ["gemv<3,3,1,0,1>"])
except S.KernelCompileError as e:
    print("REFUSED", e)
else:
    print("COMPILED")
"""


def test_a_broken_kernel_file_is_named_with_its_line(tmp_path):
    kdir = tmp_path / "kernels"
    shutil.copytree(KERNELS, kdir)
    lines = (kdir / "gemv.cu").read_text().split("\n")
    lines.insert(6, "#error deliberately broken")             # line 7 of gemv.cu
    (kdir / "gemv.cu").write_text("\n".join(lines))
    p = subprocess.run([sys.executable, "-c", _BROKEN.format(root=str(ROOT), kdir=str(kdir))], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("REFUSED NVRTC could not compile the kernels module"), p.stdout
    assert "engine/backend/cuda/kernels/gemv.cu:7: error: #error directive: deliberately broken" in p.stdout, p.stdout
