"""The backend contract (engine/backend/__init__.py's Protocols) describes both backends truthfully.

Every member a Protocol names must exist on the class that claims it: the CPU backend's
objects are built and checked with ``isinstance`` against the runtime-checkable Protocols
(a tiny GGUF model, compiled); the CUDA backend's classes are read from their source
(Python's ``ast``: no CuPy needed) for the methods, properties and attributes they define.
A Protocol member that one backend lacks (a renamed method, a property dropped) fails here,
not at the first forward on that device.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from aotx.engine import backend as B

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "engine" / "backend" / "cuda"


def members(proto: type) -> set[str]:
    """The names a Protocol (and the Protocols it extends) requires: annotated attributes,
    methods and properties, not the dunder ones."""
    out: set[str] = set()
    for k in proto.__mro__:
        if k is object or k.__name__ in ("Protocol", "Generic"):
            continue
        out |= {n for n in getattr(k, "__annotations__", {}) if not n.startswith("_")}
        out |= {n for n, v in vars(k).items()
                if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    return out


def defined(path: Path, cls: str) -> set[str]:
    """The names class ``cls`` of the module at ``path`` defines: methods, properties,
    class attributes and the ``self.x = ...`` assignments of its methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(item.name)
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                            out.add(el.attr)
        elif isinstance(item, ast.Assign):
            out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
    return out


@pytest.mark.parametrize("proto, path, cls", [
    (B.Backend, CUDA / "backend.py", "CudaBackend"),
    (B.DeviceSampler, CUDA / "program.py", "CudaProgram"),
    (B.ExpertTiers, CUDA / "program.py", "CudaProgram"),
    (B.KVCache, CUDA / "kv.py", "CudaKVCache"),
], ids=["Backend", "DeviceSampler", "ExpertTiers", "KVCache"])
def test_the_cuda_backend_defines_every_member_of_its_protocols(proto, path, cls):
    missing = members(proto) - defined(path, cls)
    assert not missing, f"{cls} lacks {sorted(missing)} of {proto.__name__}"


def test_the_cuda_program_says_it_samples_on_the_device():
    """The model layer takes the device-sampling path from ``device_sampling``: the CUDA
    program's class attribute must be True."""
    tree = ast.parse((CUDA / "program.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaProgram")
    values = [a.value.value for a in node.body if isinstance(a, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "device_sampling" for t in a.targets)]
    assert values == [True]


def test_the_cpu_backend_meets_its_protocols(tiny_gguf, tmp_path):
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.interface import HOST

    path = tiny_gguf.write_tiny_llama(tmp_path / "t.gguf", seed=1)
    gf = GGUFFile.open(path)
    backend = CpuBackend()
    model = build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, backend)
    assert isinstance(backend, B.Backend)
    prog = model.compiled
    assert isinstance(prog, B.CompiledProgram) and not isinstance(prog, B.DeviceSampler)
    assert prog.device_sampling is False and model.device_path == HOST
    assert isinstance(prog, B.ExpertTiers)
    kv = prog.new_kv_cache(2, 32)
    assert isinstance(kv, B.KVCache)
    assert kv.slot_shape[2] == 32 and prog.kv_cache_bytes(2, 32) > 0
    assert model.numerics == backend.numerics == "cpu-f32"
