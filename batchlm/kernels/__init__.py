"""Native CPU kernels, compiled once from C++ against torch's headers and loaded as torch ops.

    python -m batchlm.kernels        # build (scripts/setup.sh does this), then load and print the op names

`load()` registers `torch.ops.batchlm.paged_attention`, `.linear`, `.pack_linear`, `.linear_is_native`,
`.rms_norm`, `.add_rms_norm`, `.silu_mul` and `.rope_write_kv` (see paged_attention.cpp, linear.cpp and
pointwise.cpp for their contracts) if the library was built for this exact
source, torch version, compiler flags and CPU; it never compiles, so a server process never waits on a
compiler. Callers fall back to the torch path when it returns False.
The library goes to `batchlm/kernels/build/` (ignored by git), one file per key, so a stale build is never
loaded: a changed source or a different CPU gets a new file name.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "linear.cpp", HERE / "pointwise.cpp")
# included by the sources: part of the library's key, not compiled alone
HEADERS = (HERE / "scalar_math.h", HERE / "work_split.h")
BUILD_DIR = HERE / "build"
# NOTE: -march=native: the library is built on the machine that runs it (set-up), and its file name
# carries the CPU's model and flags. No -ffast-math: the kernels' sums must keep their written order.
# -fno-trapping-math changes no value (no reassociation, no finite-math or signed-zero assumptions): it
# says that no program reads the floating-point exception flags, so GCC may compute a multiply on both
# arms of exp_nonpositive's clamp. Without it, on a CPU without AVX-512 (whose masked instructions get
# around it), GCC hoists `x * log2(e)` into one arm, cannot if-convert the branch, and leaves the exp
# loops of silu_mul and of the attention softmax scalar (tests/unit/test_kernel_build.py checks they vectorize).
CXXFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++20", "-fno-trapping-math", "-fPIC",
            "-shared", "-fopenmp", "-Wall")

_loaded: bool | None = None


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def compiler_args() -> list[str]:
    """g++ and the flags, defines and include paths every source is compiled with (no sources, no link)."""
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["g++", *CXXFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()]]


def _compile_command(out: Path) -> list[str]:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    return [*compiler_args(), *map(str, SOURCES), "-o", str(out),
            f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]


def library_path() -> Path:
    """Where the library for this source, torch, flags and CPU lives (built or not)."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(CXXFLAGS).encode())
    h.update(_cpu_signature().encode())
    return BUILD_DIR / f"batchlm_kernels-{h.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Compile the library unless it is already built; returns its path. Raises CalledProcessError."""
    out = library_path()
    if out.exists() and not force:
        return out
    BUILD_DIR.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp.so")
    subprocess.run(_compile_command(tmp), check=True)
    tmp.replace(out)  # NOTE: atomic: a concurrent loader never sees half a file
    for stale in BUILD_DIR.glob("batchlm_kernels-*.so"):
        if stale != out:
            stale.unlink(missing_ok=True)
    return out


def load() -> bool:
    """Register the ops if the matching library is built; True if `torch.ops.batchlm` is usable."""
    global _loaded
    if _loaded is None:
        path = library_path()
        _loaded = False
        if path.exists():
            try:
                torch.ops.load_library(str(path))
                _loaded = True
            except (OSError, RuntimeError) as exc:
                log.warning("batchlm kernels at %s did not load (%s); using the torch path", path, exc)
        else:  # NOTE: said, not silent: the torch path is slower and its results depend on the batch
            log.warning("batchlm kernels are not built for this source, torch and CPU (no %s; "
                        "`python -m batchlm.kernels` builds it); using the torch path", path.name)
    return _loaded


def linear_is_native(dtype: torch.dtype) -> bool:
    """True if the library is built and `torch.ops.batchlm.linear` has vector code for `dtype` here."""
    return load() and torch.ops.batchlm.linear_is_native(dtype)
