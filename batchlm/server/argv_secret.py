"""The key of tritonserver's restricted APIs, kept off its command line.

tritonserver takes that key only as an argument (`--http-restricted-api=<apis>:<header>=<key>`), and a
process's arguments are readable by every user of the machine in /proc/<pid>/cmdline. So the project's
servers get the placeholder PLACEHOLDER in that argument instead, the key in the environment variable
VARIABLE (/proc/<pid>/environ is readable by the process's own user only), and `argv_secret.c`,
preloaded, puts the key in place of the placeholder before tritonserver's main() reads its arguments.

The library is compiled from `argv_secret.c` with the machine's C compiler on first use (about 0.1 s),
into `build/` beside this file, named by the source's hash; several processes may build it at once.
Where no compiler is found, `library()` is None and the key goes on the command line (the serve
command says so).

    python -m batchlm.server.argv_secret     # build it now (the images do); prints its path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

SOURCE = Path(__file__).with_name("argv_secret.c")
BUILD_DIR = Path(__file__).with_name("build")
PLACEHOLDER = "@BATCHLM_ARGV_SECRET@"
VARIABLE = "BATCHLM_ARGV_SECRET"


def library_path() -> Path:
    """Where the library for this source lives (built or not)."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return BUILD_DIR / f"libbatchlm_argv_secret-{key}.so"


def build() -> Path:
    """Compile the library unless it is built; returns its path. Raises OSError or CalledProcessError.

    Each build writes a temporary file of its own and renames it into place, so a loader never sees
    half a file and concurrent builds of the same source end with the same library."""
    path = library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc, or $CC) to build the argv_secret library")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(temporary), str(SOURCE)],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def library() -> Path | None:
    """The built library, building it if needed; None where it cannot be built."""
    try:
        return build()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(env: dict[str, str], secret: str, preload: Path) -> dict[str, str]:
    """`env` with the secret in VARIABLE and `preload` first on LD_PRELOAD (the library takes itself
    off again, so the processes the server starts do not load it)."""
    out = dict(env)
    out[VARIABLE] = secret
    out["LD_PRELOAD"] = ":".join(p for p in (str(preload), env.get("LD_PRELOAD", "")) if p)
    return out


def main() -> int:
    try:
        print(build())
    except subprocess.CalledProcessError as exc:
        print(f"argv_secret: the build failed:\n{exc.stderr}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"argv_secret: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
