"""The in-process subcommands of `batchlm-bench` (the one bench entry point), each run small through
`python -m batchlm.bench`, as a user runs them: engine (`make bench-engine`), forward, ratios, invariance,
agreement, kernel-outputs, stop-cost."""

import json
import re
import subprocess
import sys

import pytest
import torch

from batchlm.model.backends import ATTENTION_BACKENDS, LINEAR_BACKENDS, POINTWISE_BACKENDS
from batchlm.paths import PROJECT_ROOT
from tests.unit.test_model import auto_linear_backend


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_bench_engine_writes_its_table_and_json_naming_the_paths_it_used(tmp_path):
    out = tmp_path / "engine.json"
    stdout = run("engine", "--batches", "1", "2", "--steps", "2", "--repeats", "1", "--context", "16",
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
    stdout = run("invariance", "--num-requests", "8", "--max-tokens", "12")
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "batched run" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "continuous, 8 in flight", "continuous, 64 in flight", "request-level, batches of 8"], stdout
    assert all(row.split("|")[2].strip() == "0 of 8" for row in rows), stdout


@pytest.mark.slow  # NOTE: tooling beside serving (compares kernel builds); make test-slow runs it
def test_agreement_finds_the_exact_tier_equal_to_transformers():
    """On the tiny model (no blocks to keep, so no int8 row): every position's top-1 is transformers' token,
    the log-probabilities within float32 rounding, every greedy continuation the same."""
    stdout = run("agreement", "--model", "models/tiny-random", "--prompts", "3", "--tokens", "8",
                 "--activations", "float32")
    row = next(line for line in stdout.splitlines() if line.startswith("| float32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "100.0% of 24" and float(cells[3]) < 1e-4 and cells[4] == "3/3", stdout


def test_kernel_outputs_are_the_same_bits_run_to_run_and_a_changed_bit_is_found(tmp_path):
    a, b, changed = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "changed.pt"
    run("kernel-outputs", "save", str(a))
    run("kernel-outputs", "save", str(b))
    stdout = run("kernel-outputs", "compare", str(a), str(b))
    assert "decode 40: 0 of 327680 elements differ" in stdout and "silu_mul float32: 0 of" in stdout, stdout
    saved = torch.load(a)
    assert saved["silu_mul float32"].isnan().any()  # NaN entries are compared too (as equal to NaN)
    logits = saved["decode 8"]
    logits.view(-1).view(torch.int32)[5] ^= 1  # one bit of one logit
    torch.save(saved, changed)
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "kernel-outputs", "compare", str(a), str(changed)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "decode 8: 1 of 65536 elements differ" in proc.stdout, proc.stdout


def test_stop_cost_prints_a_time_per_token_for_each_list_length():
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "stop-cost", "--counts", "0,16,2000",
                           "--tokens", "20"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    times = {int(line.split()[0]): float(line.split(": ")[1].split()[0])
             for line in proc.stdout.splitlines() if "stop strings:" in line}
    assert set(times) == {0, 16, 2000} and all(t > 0 for t in times.values()), proc.stdout
    assert times[2000] > times[0]  # 2000 searches a token against none


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
def test_bench_forward_times_decode_and_prefill_per_batch_size():
    """`batchlm-bench forward`: a line per batch size, with the prefill figures when asked."""
    import sys

    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "forward", "--batch-sizes", "1,2", "--iters", "3",
                           "--context", "20", "--prompt-len", "20", "--dtype", "float32", "--profile"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("batch")]
    assert len(lines) == 2 and all("ms/step" in line and "per prompt token" in line for line in lines), proc.stdout
    assert "GFLOP/s" in proc.stdout.splitlines()[0], proc.stdout  # the matmul's rate first
    # NOTE: float32: on a CPU without AVX-512 BF16 oneDNN emulates bfloat16, many times slower
    assert f"linears: {auto_linear_backend(torch.float32)}" in proc.stdout.splitlines(), proc.stdout
    split = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [line.split(":")[0] for line in split] == ["decode", "prefill"] * 2, proc.stdout
    for line in split:  # linears (with their rate), attention and the rest, each a positive time
        times = [float(part.split(" ms")[0].rsplit(" ", 1)[1]) for part in line.split(", ")]
        assert all(t > 0 for t in times) and "GFLOP/s" in line, line


def test_bench_forward_interfere_times_steps_alone_and_beside_spinners_and_stops_them():
    """`batchlm-bench forward` --interfere: two mean step times per batch size, and no spinner left after."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "forward", "--batch-sizes", "2", "--iters", "3",
                           "--context", "20", "--interfere", "0.3"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if "decode mean" in line)
    alone, beside = (float(t) for t in re.findall(r"([0-9.]+) ms (?:alone|beside)", line))
    assert alone > 0 and beside > 0, line
    left = subprocess.run(["pgrep", "-f", "while os.getppid"], capture_output=True, text=True)
    assert left.stdout == "", f"spinner processes left running: {left.stdout}"


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
def test_engine_ratios_keeps_the_continuous_engines_full_between_request_level_batches():
    """`batchlm-bench ratios`: every strategy timed, the continuous engines saturated in every step."""
    import sys

    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "ratios", "--num-requests", "16",
                           "--same-kv-seqs", "12"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]]
            for row in proc.stdout.splitlines() if row.startswith("| ") and "strategy" not in row}
    assert list(rows) == ["request-level (8 per batch)", "continuous (8 in flight)", "same KV (12 at most)"]
    assert float(rows["request-level (8 per batch)"][0]) > 0
    for name, seqs in (("continuous (8 in flight)", "8.00"), ("same KV (12 at most)", "12.00")):
        tok_s, seconds, per_step, ratio = rows[name]
        assert float(tok_s) > 0 and float(seconds) > 0, rows[name]
        assert per_step == seqs, rows[name]  # topped up before every step, so never a slot empty
        assert float(ratio) > 1, rows[name]
    bad = subprocess.run([sys.executable, "-m", "batchlm.bench", "ratios", "--num-requests", "4"], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--num-requests" in bad.stderr
