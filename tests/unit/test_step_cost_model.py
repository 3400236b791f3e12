"""batchlm.bench.step_cost_model: the strategies' ratios from step costs, and batchlm/bench/predict.py on the model."""

import re
import subprocess
import sys

import pytest

from batchlm.bench import step_cost_model as scm
from batchlm.bench.workload import WorkloadRequest, WorkloadSpec, build_requests
from batchlm.paths import PROJECT_ROOT


def test_the_spec_expectations_match_its_seeded_requests():
    spec = WorkloadSpec(num_requests=4000)
    expected, sampled = scm.Lengths.of_spec(spec, bos=True), scm.Lengths.of_requests(build_requests(spec), bos=True)
    for field in ("prompt", "output", "longest_of_batch", "request_level_context", "continuous_context"):
        assert getattr(sampled, field) == pytest.approx(getattr(expected, field), rel=0.05), field
    fixed = scm.Lengths.of_spec(WorkloadSpec(output_min=100, output_cap=100), bos=False)
    assert (fixed.output, fixed.longest_of_batch, fixed.step_count_bound) == pytest.approx((100, 100, 1))
    assert fixed.continuous_context == pytest.approx(72 + 50)
    assert fixed.request_level_context == pytest.approx(72 + 50)


def test_padding_rows_attend_over_their_own_length_until_their_batch_ends():
    """Seven one-token rows and one of 100 in a batch: the short ones feed no decode token, and as
    padding they attend over their prompt alone for all 99 of the batch's decode steps."""
    requests = [WorkloadRequest(i, "p", 10, n) for i, n in enumerate([1] * 7 + [100])]
    lengths = scm.Lengths.of_requests(requests, bos=False)
    assert lengths.request_level_context == pytest.approx(10 + (99 * 100 / 2) / (8 * 99))
    assert lengths.continuous_context == pytest.approx(10 + 50)  # the long one alone decodes: 10 + j, j < 100
    assert (lengths.output, lengths.longest_of_batch) == pytest.approx((100 / 8 + 7 / 8, 100))
    # a row that finished at 3 tokens stays at 2 output tokens of context: 1 + 2 + 2 * 96 over 98 steps
    mixed = scm.Lengths.of_requests([WorkloadRequest(0, "p", 0, 3), WorkloadRequest(1, "p", 0, 99)], bos=True)
    assert mixed.request_level_context == pytest.approx(1 + ((1 + 2 + 2 * 96) + 98 * 99 / 2) / (2 * 98))


def test_a_sample_is_read_in_batches_of_8_in_arrival_order():
    requests = [WorkloadRequest(i, "p", 10 + i % 2, n) for i, n in enumerate([1, 2, 3, 4, 5, 6, 7, 20, 4, 4])]
    lengths = scm.Lengths.of_requests(requests, bos=True)
    assert lengths.prompt == pytest.approx(11.5)
    assert lengths.output == pytest.approx(5.6)
    assert lengths.longest_of_batch == pytest.approx((20 + 4) / 2)  # the second batch has 2 requests


def _costs(prompt_ms: float, step_8: float, steps: dict[int, float]) -> scm.StepCosts:
    return scm.StepCosts(prompt_token_ms=prompt_ms, request_level_step_ms=step_8, decode_step_ms=steps)


LENGTHS = scm.Lengths.of_spec(WorkloadSpec(), bos=True)


def test_free_prompts_and_flat_steps_give_the_step_count_ratio():
    costs = _costs(0.0, 6.0, {8: 6.0, 40: 30.0})
    steps_ratio = (LENGTHS.longest_of_batch - 1) / (LENGTHS.output - 1)
    assert scm.ratio(LENGTHS, costs, seqs=8) == pytest.approx(steps_ratio)
    # a step five times as wide that costs five times as much gains nothing per token
    assert scm.ratio(LENGTHS, costs, seqs=40) == pytest.approx(steps_ratio)
    assert steps_ratio == pytest.approx(LENGTHS.step_count_bound, rel=0.01)


def test_prompts_pull_every_ratio_toward_one():
    costs = _costs(0.25, 6.0, {8: 6.0, 40: 15.0})
    for n in (8, 40):
        free = scm.ratio(LENGTHS, costs, seqs=n, prompts=False)
        assert 1.0 < scm.ratio(LENGTHS, costs, seqs=n) < free
    assert scm.ratio(LENGTHS, costs, seqs=40, prompts=False) == pytest.approx(
        scm.ratio(LENGTHS, costs, seqs=8, prompts=False) * (6.0 / 8) / (15.0 / 40))
    assert scm.request_ms(LENGTHS, costs) == pytest.approx(73 * 0.25 + (LENGTHS.longest_of_batch - 1) * 6.0 / 8)


def test_the_decode_cost_needed_for_a_target_reaches_it_exactly():
    costs = _costs(0.25, 6.0, {8: 6.0})
    needed = scm.decode_token_ms_needed(LENGTHS, costs, target=5.0)
    assert scm.ratio(LENGTHS, _costs(0.25, 6.0, {40: 40 * needed}), seqs=40) == pytest.approx(5.0)
    # prompts that alone cost more than a fifth of a request-level request leave no budget at all
    assert scm.decode_token_ms_needed(LENGTHS, _costs(5.0, 6.0, {8: 6.0}), target=5.0) < 0
    one_token = scm.Lengths.of_spec(WorkloadSpec(output_min=1, output_cap=1), bos=True)
    assert scm.decode_token_ms_needed(one_token, costs, target=5.0) == float("inf")


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
def test_predict_ratios_times_each_size_and_predicts_the_targets():
    """`batchlm-bench predict`: a row per size with positive costs, and the two target lines."""
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "predict", "--seqs", "2,8", "--same-kv-seqs", "4",
                           "--rounds", "1", "--iters", "3"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row.split("|")[1]) for row in rows] == [2, 4, 8]  # --same-kv-seqs joins --seqs
    for row in rows:
        cells = [float(cell) for cell in row.split("|")[2:-1] if not cell.strip().endswith("%")]
        assert all(value > 0 for value in cells), row
    assert re.search(r"continuous at 8 / static, predicted in process: \d+\.\d\d \(target 2\.3\)", proc.stdout)
    assert "the default spec's expectations" in proc.stdout
    assert re.search(r"same KV memory, 4 sequences a step: predicted in process \d+\.\d\d", proc.stdout)
    assert re.search(r"the cheapest of these sizes, (2|4|8) sequences, costs \d+\.\d+ ms", proc.stdout)
    sample = subprocess.run([sys.executable, "-m", "batchlm.bench", "predict", "--seqs", "8", "--same-kv-seqs", "8",
                             "--rounds", "1", "--iters", "3", "--num-requests", "16"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert sample.returncode == 0 and "the first 16 requests" in sample.stdout, sample.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "batchlm.bench", "predict", "--seqs", "0"], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--seqs" in bad.stderr
    words = subprocess.run([sys.executable, "-m", "batchlm.bench", "predict", "--seqs", "8,x"], cwd=PROJECT_ROOT,
                           capture_output=True, text=True, timeout=60)
    assert words.returncode == 2 and "comma-separated integers" in words.stderr
