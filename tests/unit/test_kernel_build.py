"""The kernel library's flags: the loops that call the exp of scalar_math.h vectorize.

exp_nonpositive is written so that a loop over it compiles to vector code, and silu_mul and the attention
softmax spend most of their time in such loops. On a CPU without AVX-512, GCC leaves them scalar when it
may not speculate a multiply past the clamp at the top of the exp (-ftrapping-math, its default; AVX-512
masks the multiply instead), so a change of flags or of the exp can silently make those ops several times
slower while every value stays the same. This compiles the two sources with the library's own flags for
this CPU and reads GCC's vectorization report for the lines of those loops.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batchlm import kernels

# Loops that must vectorize: a `for` on the same line as a call of the exp (directly or through silu_times).
EXP_CALLS = ("exp_nonpositive(", "silu_times(")


def exp_loop_lines(source: Path) -> list[int]:
    return [n for n, line in enumerate(source.read_text().splitlines(), start=1)
            if "for (" in line and any(call in line for call in EXP_CALLS)]


def vectorized_lines(source: Path) -> set[int]:
    """Lines of `source` holding a loop that GCC vectorized, with the flags the library is built with."""
    cmd = [*kernels.compiler_args(), "-c", str(source), "-o", os.devnull, "-fopt-info-vec-optimized"]
    report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    pattern = rf"{re.escape(source.name)}:(\d+):\d+: optimized: loop vectorized"
    return {int(m.group(1)) for m in re.finditer(pattern, report)}


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the compiler the library is built with")
def test_the_loops_over_the_exp_vectorize():
    sources = [kernels.HERE / "pointwise.cpp", kernels.HERE / "paged_attention.cpp"]
    expected = {s.name: exp_loop_lines(s) for s in sources}
    assert all(expected.values()), f"no exp loop found in a source: {expected}"  # the test still reads them
    with ThreadPoolExecutor(len(sources)) as pool:
        vectorized = dict(zip([s.name for s in sources], pool.map(vectorized_lines, sources)))
    scalar = {name: [n for n in lines if n not in vectorized[name]] for name, lines in expected.items()}
    assert not any(scalar.values()), f"loops over exp_nonpositive left scalar (file: lines): {scalar}"


def test_a_missing_library_is_said_not_silent(tmp_path):
    """Without a library built for this source, torch and CPU (another machine's build, say, in an
    image), the engine takes the torch path: slower, and its results depend on the batch. It says so,
    rather than doing so without a word."""
    import sys

    code = ("import logging, pathlib, sys; from batchlm import kernels; "
            f"kernels.BUILD_DIR = pathlib.Path({str(tmp_path)!r}); print(kernels.load())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    assert "batchlm kernels are not built for this source, torch and CPU" in proc.stderr
    assert "using the torch path" in proc.stderr


BUILDER = """
import json, subprocess, sys
from pathlib import Path
from batchlm import kernels
kernels.BUILD_DIR = Path(sys.argv[1])
log = sys.argv[2]
# a stand-in compiler: says when it starts and ends, and writes the output file late
kernels._compile = lambda out: subprocess.run(["sh", "-c", f"echo start $(date +%s.%N) >> {log}; sleep 0.4; "
                                              f"echo lib > {out}; echo end $(date +%s.%N) >> {log}"], check=True)
print(kernels.build(force=True))
"""


def test_two_builds_at_once_take_turns_and_keep_other_targets_libraries(tmp_path):
    """Two set-ups of one checkout build at once: one compiles while the other waits on the lock, each
    into a temporary file of its own; the library ends whole; the library of another torch or CPU stays,
    and only this target's library of older sources goes."""
    import json
    import sys

    build_dir, log = tmp_path / "build", tmp_path / "compiles.log"
    build_dir.mkdir()
    target = kernels._key_parts()["target"]
    for name, parts in (("other", {"sources": "s", "target": "f" * 16}), ("stale", {"sources": "s", "target": target})):
        (build_dir / f"batchlm_kernels-{name}.so").write_text(name)
        (build_dir / f"batchlm_kernels-{name}.json").write_text(json.dumps(parts))
    runs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(build_dir), str(log)], stdout=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    built = build_dir / kernels.library_path().name
    assert outs == [str(built)] * 2 and built.read_text() == "lib\n"
    events = [line.split() for line in log.read_text().splitlines()]
    assert [kind for kind, _ in events] == ["start", "end", "start", "end"], events  # never two at once
    assert (build_dir / "batchlm_kernels-other.so").exists(), "another target's library was deleted"
    assert not (build_dir / "batchlm_kernels-stale.so").exists(), "this target's stale library was kept"
    assert not list(build_dir.glob(".building-*")), "a temporary file was left behind"
