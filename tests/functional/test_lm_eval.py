"""lm-evaluation-harness, unchanged, against the served default model: its `local-completions` (log-likelihoods
of token-id prompts, several prompts a request) and `local-chat-completions` (greedy answers through the chat
template) on the project's quiz (batchlm/eval/tasks/) score what its own Hugging Face backend scores on the
same GGUF file, item by item.

The server is the real default model (SmolLM2-135M-Instruct), continuous_batching alone, with the frontend
beside it, as `make eval` runs it (batchlm/eval/run.py). Four lm-eval runs of a few minutes on 2 cores, so
`make test-slow`; skipped where the `eval` extra is not installed.
"""

from __future__ import annotations


import pytest

from batchlm.eval.compare import LOGLIKELIHOOD_ATOL, Run, compare_runs, report
from batchlm.eval.run import ANSWER_TASK, CHOICE_TASK, reference_runs, run, served_runs
from batchlm.paths import DEFAULT_MODEL
from tests.functional.conftest import default_model_serving

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]' "
                                      "(make eval installs it)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SERVED = "continuous_batching"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("lm_eval")


@pytest.fixture(scope="module")
def reference(out):
    """lm-eval's Hugging Face backend, run before any server starts (the two would share the cores)."""
    for step in reference_runs(DEFAULT_MODEL, out / "reference"):
        run(step, out)
    return Run.read(out / "reference")


@pytest.fixture(scope="module")
def served(out, reference):
    """The served runs, against a tritonserver and frontend of their own on the default model."""
    with default_model_serving(out, extra_args=("--model-control-mode=explicit", f"--load-model={SERVED}")) as (_, url):
        for step in served_runs(url, SERVED, out / "served"):
            run(step, out)
    return Run.read(out / "served")


@pytest.fixture(scope="module")
def comparisons(out, reference, served):
    found = {c.task: c for c in compare_runs(out / "reference", out / "served")}
    print(report(list(found.values())))
    return found


def test_the_two_tokenizers_agree_on_every_text_of_the_quiz(reference):
    """The comparison's premise: transformers' tokenizer of the GGUF file (the reference's) and the engine's
    (the server's) give the same ids for every context and continuation the quiz asks about."""
    import transformers

    from batchlm.model.tokenizer import Tokenizer

    theirs = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL.parent, gguf_file=DEFAULT_MODEL.name,
                                                        local_files_only=True)
    ours = Tokenizer.from_dir(DEFAULT_MODEL)
    texts = {arg for sample in reference.samples[CHOICE_TASK] for args in sample["arguments"].values()
             for arg in (args["arg_0"], args["arg_0"] + args["arg_1"])}
    assert len(texts) > 100
    differ = [t for t in sorted(texts) if theirs(t, add_special_tokens=False).input_ids != ours.encode(t)]
    assert not differ, differ


def test_lm_eval_scores_every_item_of_both_tasks_on_both_sides(reference, served):
    for run_ in (reference, served):
        assert set(run_.results) >= {CHOICE_TASK, ANSWER_TASK}
        assert len(run_.samples[CHOICE_TASK]) >= 36 and len(run_.samples[ANSWER_TASK]) >= 10
        # a quiz the model partly answers, not one it always gets right or always wrong
        assert 0.2 < run_.results[CHOICE_TASK]["acc,none"] < 0.95
        assert 0.1 < run_.results[ANSWER_TASK]["exact_match,last_word"] < 0.9


def test_served_accuracy_equals_the_reference(comparisons):
    metrics = comparisons[CHOICE_TASK].metrics
    assert metrics["acc,none"][0] == metrics["acc,none"][1]
    assert metrics["acc_norm,none"][0] == metrics["acc_norm,none"][1]


def test_every_loglikelihood_agrees_within_the_tolerance(comparisons):
    choice = comparisons[CHOICE_TASK]
    assert choice.loglikelihoods == 4 * choice.items
    assert choice.max_loglikelihood_diff <= LOGLIKELIHOOD_ATOL, choice.differing_items
    assert choice.smallest_choice_gap > LOGLIKELIHOOD_ATOL  # no answer decided by rounding
    assert choice.ok, choice.differing_items


def test_greedy_answers_and_exact_match_equal_the_reference(comparisons):
    answer = comparisons[ANSWER_TASK]
    metric = answer.metrics["exact_match,last_word"]
    assert metric[0] == metric[1]
    assert answer.ok, answer.differing_items  # the same generated text, item by item

