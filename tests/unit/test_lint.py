"""The project's Python passes ruff's pycodestyle and pyflakes rules (pyproject.toml, `[tool.ruff]`):
unused imports and names, undefined names, lines over 120 columns."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from batchlm.paths import PROJECT_ROOT

PACKAGES = ("batchlm", "client", "tests", "scripts", "locustfiles", "model_repository")


def test_the_code_passes_ruff():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: `make setup` installs the test extras"
    proc = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", *PACKAGES],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
