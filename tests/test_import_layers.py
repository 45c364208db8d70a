"""The layering rule holds: imports run downward only and there are no import circles.

The rule is written as import-linter contracts in pyproject.toml ([tool.importlinter];
engine/README.md, "Layers", says it in words). This test runs `lint-imports` on the
package, so CI, which runs the suite, checks it on every change.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    assert {"layers", "acyclic", "clients"} <= {c["id"] for c in contracts}
