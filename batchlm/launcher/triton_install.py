"""Where a tritonserver binary and its backends live, and the environment a server of it runs in."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from batchlm.paths import PROJECT_ROOT

NGC_BACKENDS = Path("/opt/tritonserver/backends")  # where an NGC container's tritonserver has its backends


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its backends live."""

    binary: Path
    backend_dir: Path
    lib_dir: Path | None = None  # extra LD_LIBRARY_PATH entry (the extracted wheel's libraries)

    @classmethod
    def find(cls) -> "TritonInstall":
        """$TRITON_HOME, then a `tritonserver` on PATH (NGC), then the project's extracted `.triton/`: the
        order `scripts/setup.sh` looks in. (With `.triton/` before PATH, a checkout set up outside an NGC
        container would serve that extracted 2.51 inside it.)"""
        home = os.environ.get("TRITON_HOME")
        on_path = shutil.which("tritonserver")
        if not home and on_path and (NGC_BACKENDS / "python").is_dir():  # NOTE: as setup.sh checks
            return cls(Path(on_path), NGC_BACKENDS)
        base = Path(home) if home else PROJECT_ROOT / ".triton"
        if (base / "bin" / "tritonserver").exists():
            lib = base / "lib"
            return cls(base / "bin" / "tritonserver", base / "backends", lib if lib.is_dir() else None)
        if home:
            raise FileNotFoundError(f"TRITON_HOME={home} has no bin/tritonserver")
        raise FileNotFoundError(
            "no tritonserver found: run `make setup` (extracts one into .triton/) or set TRITON_HOME"
        )

    def environment(self) -> dict[str, str]:
        """A server's environment: this process's, with this interpreter's environment (venv) first on
        PATH, for the Python backend stubs to run in, and the install's libraries on LD_LIBRARY_PATH."""
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        if sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = sys.prefix
        if self.lib_dir is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(self.lib_dir), env.get("LD_LIBRARY_PATH", "")) if p
            )
        # NOTE: keep Python from writing __pycache__ next to shared code (Triton treats every
        # folder in the repository as a model).
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env
