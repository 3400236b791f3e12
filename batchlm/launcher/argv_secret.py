"""The key of tritonserver's restricted APIs, kept off its command line where a server asks for it
(`TritonServer(hide_admin_key=True)`, `batchlm-serve --hide-admin-key`; by default the key is the argument).

tritonserver takes that key only as an argument (`--http-restricted-api=<apis>:<header>=<key>`), and a
process's arguments are readable by every user of the machine in /proc/<pid>/cmdline. So such
servers get a placeholder in that argument instead (random for each server: `new_placeholder()`), the
key and the placeholder in the environment variables SECRET and PLACEHOLDER (/proc/<pid>/environ is
readable by the process's own user only), and `argv_secret.c`, preloaded, puts the key in place of the
placeholder before tritonserver's main() reads its arguments, then blanks the key in the environment:
`taken()` tells from outside that it ran.

The library is compiled from `argv_secret.c` with the machine's C compiler ($CC, cc or gcc) on first
use (about 0.1 s), into a folder of this user's alone (BUILD_DIR: $XDG_CACHE_HOME/batchlm, else
~/.cache/batchlm, mode 0700), named by the source's hash; several processes may build it at once. A
library in a folder or file that others can write is not used: whoever could replace it would run code
in tritonserver with the key. Where it cannot be built or used, `library()` is None and the key goes
on the command line (TritonServer warns).

    python -m batchlm.launcher.argv_secret     # build it now (the images do); prints its path
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

SOURCE = Path(__file__).with_name("argv_secret.c")
BUILD_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchlm"
SECRET = "BATCHLM_ARGV_SECRET"
PLACEHOLDER = "BATCHLM_ARGV_PLACEHOLDER"


def new_placeholder() -> str:
    """A placeholder for one server's key: random, so that a client cannot guess it were it ever the key."""
    return f"@batchlm-{secrets.token_hex(8)}@"


def library_path() -> Path:
    """Where the library for this source lives (built or not)."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return BUILD_DIR / f"libbatchlm_argv_secret-{key}.so"


def _check_private(path: Path) -> None:
    """Raise PermissionError unless `path` is this user's and no one else can write it."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is not this user's alone (owner {info.st_uid}, mode "
                              f"{stat.filemode(info.st_mode)}): its library is not used")


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not command:
        raise FileNotFoundError("no C compiler (cc or gcc, or $CC) to build the argv_secret library")
    return command


def build() -> Path:
    """Compile the library unless it is built; returns its path. Raises OSError or CalledProcessError.

    Each build writes a temporary file of its own and renames it into place, so a loader never sees
    half a file and concurrent builds of the same source end with the same library."""
    path = library_path()
    if any(c in str(path) for c in ": "):  # NOTE: the loader splits LD_PRELOAD at colons and spaces
        raise OSError(f"{path}: a colon or space in the path; LD_PRELOAD cannot name it")
    BUILD_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(BUILD_DIR)
    if not path.exists():
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            subprocess.run([*_compiler(), "-O2", "-shared", "-fPIC", "-Wall", "-o", str(temporary), str(SOURCE)],
                           check=True, capture_output=True, text=True, timeout=120)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    _check_private(path)
    return path


def library() -> Path | None:
    """The built library, building it if needed; None where it cannot be built or used."""
    try:
        return build()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(env: dict[str, str], secret: str, placeholder: str, preload: Path) -> dict[str, str]:
    """`env` with the secret and its placeholder, and `preload` first on LD_PRELOAD (the library takes
    itself off again, so the processes the server starts do not load it)."""
    out = dict(env)
    out[SECRET] = secret
    out[PLACEHOLDER] = placeholder
    out["LD_PRELOAD"] = ":".join(p for p in (str(preload), env.get("LD_PRELOAD", "")) if p)
    return out


def missing(pid: int, preload: Path) -> bool:
    """Whether process `pid` has been loaded without `preload`: the loader maps preloaded libraries
    before the program's own, so libc mapped without it means it will not be."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "/libc.so" in maps and str(preload) not in maps


def taken(pid: int, secret: str) -> bool:
    """Whether the library ran in process `pid`: the secret is gone from its environment's memory."""
    try:
        return secret.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # NOTE: the process is gone: nothing of it can serve
        return False


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
