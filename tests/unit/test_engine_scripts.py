"""The in-process engine scripts the README quotes: scripts/bench_engine.py (`make bench-engine`) and
scripts/batch_invariance.py, run small; scripts/kernel_outputs.py, which the README's same-bits claims use."""

import json
import subprocess
import sys

import torch

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


def test_kernel_outputs_are_the_same_bits_run_to_run_and_a_changed_bit_is_found(tmp_path):
    a, b, changed = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "changed.pt"
    run("scripts/kernel_outputs.py", "save", str(a))
    run("scripts/kernel_outputs.py", "save", str(b))
    stdout = run("scripts/kernel_outputs.py", "compare", str(a), str(b))
    assert "decode 40: 0 of 327680 elements differ" in stdout and "silu_mul float32: 0 of" in stdout, stdout
    saved = torch.load(a)
    assert saved["silu_mul float32"].isnan().any()  # NaN entries are compared too (as equal to NaN)
    logits = saved["decode 8"]
    logits.view(-1).view(torch.int32)[5] ^= 1  # one bit of one logit
    torch.save(saved, changed)
    proc = subprocess.run([sys.executable, "scripts/kernel_outputs.py", "compare", str(a), str(changed)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "decode 8: 1 of 65536 elements differ" in proc.stdout, proc.stdout


def test_stop_cost_prints_a_time_per_token_for_each_list_length():
    proc = subprocess.run([sys.executable, "scripts/stop_cost.py", "--counts", "0,16,2000", "--tokens", "20"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    times = {int(line.split()[0]): float(line.split(": ")[1].split()[0])
             for line in proc.stdout.splitlines() if "stop strings:" in line}
    assert set(times) == {0, 16, 2000} and all(t > 0 for t in times.values()), proc.stdout
    assert times[2000] > times[0]  # 2000 searches a token against none
