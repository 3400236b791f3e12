"""Native CPU kernels, compiled once from C++ against torch's headers and loaded as torch ops.

    python -m batchlm.kernels        # build (scripts/setup.sh does this), then load and print the op names

`load()` registers `torch.ops.batchlm.paged_attention`, `.linear`, `.pack_linear`, `.linear_bf16`,
`.linear_is_native`, `.linear_q`, `.pack_linear_q`, `.embedding_q`, `.linear_q_is_native`, `.linear_q8`,
`.pack_linear_q8`, `.embedding_q8`, `.linear_q8_is_native`, `.rms_norm`, `.add_rms_norm`,
`.silu_mul` and `.rope_write_kv` (see paged_attention.cpp, linear.cpp, linear_quant.cpp, linear_int8.cpp and
pointwise.cpp for their contracts) if the library was built for this exact
source, torch version, compiler flags and CPU; it never compiles, so a server process never waits on a
compiler. Callers fall back to the torch path when it returns False.
The library goes to `batchlm/kernels/build/` (ignored by git), one file per key, so a stale build is never
loaded: a changed source or a different CPU gets a new file name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "linear.cpp", HERE / "linear_quant.cpp", HERE / "linear_int8.cpp",
           HERE / "pointwise.cpp")
# included by the sources: part of the library's key, not compiled alone
HEADERS = (HERE / "scalar_math.h", HERE / "work_split.h", HERE / "linear_blocks.h", HERE / "gguf_tiles.h")
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


def _compile(out: Path) -> None:
    """Compile every source to an object file, all at once (one g++ each: a source's code does not
    depend on the others', so this is what one g++ call with all of them makes, in about half the time on
    two cores), then link them into `out`. Raises CalledProcessError."""
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    with tempfile.TemporaryDirectory(dir=BUILD_DIR, prefix=".objects-") as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        with ThreadPoolExecutor(len(SOURCES)) as pool:
            runs = [pool.submit(subprocess.run, [*compiler_args(), "-c", str(source), "-o", str(obj)], check=True)
                    for source, obj in zip(SOURCES, objects)]
            for run in runs:
                run.result()
        subprocess.run([*compiler_args(), *map(str, objects), "-o", str(out), f"-L{torch_lib}", "-lc10",
                        "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"], check=True)


def _key_parts() -> dict[str, str]:
    """What a library is built from, each part hashed: its sources, and the torch, flags and CPU it is for."""
    sources = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)).hexdigest()
    target = hashlib.sha256("\n".join((torch.__version__, " ".join(CXXFLAGS), _cpu_signature())).encode())
    return {"sources": sources[:16], "target": target.hexdigest()[:16]}


def library_path() -> Path:
    """Where the library for this source, torch, flags and CPU lives (built or not)."""
    parts = _key_parts()
    key = hashlib.sha256((parts["sources"] + parts["target"]).encode()).hexdigest()[:16]
    return BUILD_DIR / f"batchlm_kernels-{key}.so"


def build(force: bool = False) -> Path:
    """Compile the library unless it is already built; returns its path. Raises CalledProcessError.

    Safe to run from several processes at once (two set-ups of one checkout, say): one builds while the
    others wait on a lock and then find it built. Each build compiles to a temporary file of its own and
    renames it into place, so a loader never sees half a file. Libraries of other torch versions, flags or
    CPUs (a checkout shared by machines or images) are kept; only this target's libraries of older
    sources are removed."""
    BUILD_DIR.mkdir(exist_ok=True)
    out = library_path()
    with open(BUILD_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: released when the file closes, however this ends
        if out.exists() and not force:
            return out
        fd, tmp_name = tempfile.mkstemp(dir=BUILD_DIR, prefix=".building-", suffix=".so")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _compile(tmp)
            tmp.replace(out)  # NOTE: atomic: a concurrent loader never sees half a file
        finally:
            tmp.unlink(missing_ok=True)
        parts = _key_parts()
        out.with_suffix(".json").write_text(json.dumps(parts))
        for other in BUILD_DIR.glob("batchlm_kernels-*.json"):
            if other == out.with_suffix(".json"):
                continue
            try:
                stale = json.loads(other.read_text())["target"] == parts["target"]
            except (OSError, ValueError, KeyError):
                continue
            if stale:  # NOTE: the same torch, flags and CPU: built from sources that are gone
                other.with_suffix(".so").unlink(missing_ok=True)
                other.unlink(missing_ok=True)
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


def linear_q_is_native() -> bool:
    """True if the library is built and `torch.ops.batchlm.linear_q` has vector code here (AVX-512, or AVX2
    with FMA and F16C); without it the op runs (a scalar loop, the same bits) but slower than dense float32."""
    return load() and torch.ops.batchlm.linear_q_is_native()


def linear_q8_is_native() -> bool:
    """True if the library is built and `torch.ops.batchlm.linear_q8` (int8 activations) has vector code
    here (AVX2); without it the op runs a scalar loop (the same bits), far slower than linear_q."""
    return load() and torch.ops.batchlm.linear_q8_is_native()
