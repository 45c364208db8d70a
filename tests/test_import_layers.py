"""The layering rule holds, and the house's structural rules with it.

The layering rule is written as import-linter contracts in pyproject.toml
([tool.importlinter]; engine/README.md, "Layers", says it in words). This test runs
`lint-imports` on the package, so CI, which runs the suite, checks it on every change.

The structural rules are checked here by reading the sources (no import needed): no Python
module of the package over 600 lines; no CUDA source (``__global__``) in a ``.py`` file under
engine/; the runtime imports no ``aotx.engine.backend.cuda`` module (it asks the model which
device path it runs); nothing under ``aotx.engine`` imports ``aotx.app``. The first two name
the files that break them today in explicit allow-lists (rooms still being split): a file
leaves its list when its room lands, and a file on a list that no longer breaks the rule
fails the test, so the lists only shrink.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600

# modules over MAX_LINES today, each waiting for its room's split (remove a file when it lands)
LONG_MODULES: set[str] = set()
# .py files that still hold CUDA C++ in strings (kernels live in engine/backend/cuda/kernels/*.cu)
CUDA_IN_PYTHON: set[str] = set()


def package_modules() -> list[Path]:
    """Every .py file of the installed package: the repository minus tests/ (developer
    tooling, not installed) and hidden folders (the virtual environment, git)."""
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(part.startswith(".") or part in ("tests", "__pycache__")
                             for part in p.relative_to(ROOT).parts))


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (``import a.b``, ``from a.b import c`` as ``a.b`` and
    ``a.b.c``), at any depth: function-level imports count as much as top-level ones."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_imports_follow_the_layers():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    script = Path(sys.executable).with_name("lint-imports")
    cmd = [str(script)] if script.exists() else [
        sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
    p = subprocess.run([*cmd, "--no-cache", "--no-logo", "--config", str(ROOT / "pyproject.toml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:]
    m = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    assert m, out[-4000:]
    assert (int(m.group(1)), int(m.group(2))) == (len(contracts), 0), out[-4000:]
    assert {"layers", "acyclic", "clients", "engine-below-tui", "runtime-not-cuda"} <= {c["id"] for c in contracts}


def test_no_module_is_over_600_lines():
    sizes = {rel(p): sum(1 for _ in p.open(encoding="utf-8")) for p in package_modules()}
    long = {f for f, n in sizes.items() if n > MAX_LINES}
    assert long - LONG_MODULES == set(), {f: sizes[f] for f in sorted(long - LONG_MODULES)}
    assert LONG_MODULES - long == set(), f"now at most {MAX_LINES} lines: take them off LONG_MODULES"


def test_no_cuda_source_in_python_files():
    found = {rel(p) for p in (ROOT / "engine").rglob("*.py") if "__global__" in p.read_text(encoding="utf-8")}
    assert found - CUDA_IN_PYTHON == set(), sorted(found - CUDA_IN_PYTHON)
    assert CUDA_IN_PYTHON - found == set(), "their CUDA left the .py file: take them off CUDA_IN_PYTHON"


def test_the_runtime_imports_no_cuda_module():
    bad = {rel(p): sorted(m for m in imported_modules(p) if m.startswith("aotx.engine.backend.cuda"))
           for p in (ROOT / "engine" / "runtime").rglob("*.py")}
    assert {f: ms for f, ms in bad.items() if ms} == {}


def test_nothing_under_the_engine_imports_the_tui():
    bad = {rel(p): sorted(m for m in imported_modules(p) if m == "aotx.app" or m.startswith("aotx.app."))
           for p in (ROOT / "engine").rglob("*.py")}
    assert {f: ms for f, ms in bad.items() if ms} == {}
