"""The in-process engine scripts the README quotes: scripts/bench_engine.py (`make bench-engine`) and
scripts/batch_invariance.py, run small."""

import json
import subprocess
import sys

from batchlm.engine_config import ATTENTION_BACKENDS, LINEAR_BACKENDS, POINTWISE_BACKENDS
from batchlm.triton_server import PROJECT_ROOT


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_bench_engine_writes_its_table_and_json_naming_the_paths_it_used(tmp_path):
    out = tmp_path / "engine.json"
    stdout = run("scripts/bench_engine.py", "--batches", "1", "2", "--steps", "2", "--repeats", "1", "--context", "16",
                 "--prefill-prompts", "2", "--prefill-len", "16", "--json", str(out))
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["decode"]] == [1, 2]
    assert all(row["tokens_per_s"] > 0 and row["ms_per_step"] > 0 for row in result["decode"])
    assert result["prefill"]["tokens_per_s"] > 0
    assert result["attention"] in ATTENTION_BACKENDS and result["linear"] in LINEAR_BACKENDS
    assert result["pointwise"] in POINTWISE_BACKENDS
    header = stdout.splitlines()[0]
    assert f"{result['linear']} linears, {result['pointwise']} element-wise ops" in header, stdout
    assert "| 1 |" in stdout and "| 2 |" in stdout, stdout


def test_batch_invariance_finds_no_request_whose_tokens_change_batched():
    stdout = run("scripts/batch_invariance.py", "--num-requests", "8", "--max-tokens", "12")
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "batched run" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "continuous, 8 in flight", "continuous, 64 in flight", "request-level, batches of 8"], stdout
    assert all(row.split("|")[2].strip() == "0 of 8" for row in rows), stdout
