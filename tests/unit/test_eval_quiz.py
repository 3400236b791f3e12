"""The quiz lm-evaluation-harness runs (batchlm/eval/tasks/) and the comparison of two runs
(batchlm/eval/compare.py), with no model and no server: the data holds what the tasks promise, lm-eval
builds both tasks from it offline, and the comparison finds a moved log-likelihood or a changed answer.
The runs themselves, served against the reference: tests/functional/test_lm_eval.py (`make test-slow`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchlm.eval.compare import LOGLIKELIHOOD_ATOL, compare_runs, report
from batchlm.eval.run import ANSWER_TASK, CHOICE_TASK, TASKS_DIR, reference_runs, served_runs


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines()]


def test_the_quiz_has_dozens_of_choice_questions_and_some_answer_questions_without_digits():
    choice, answer = _rows("quiz_mc.jsonl"), _rows("quiz_gen.jsonl")
    assert len(choice) >= 36 and len(answer) >= 10
    assert len({r["question"] for r in choice}) == len(choice)
    for r in choice:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and r["answer"] in range(4), r
    assert {r["answer"] for r in choice} == {0, 1, 2, 3}  # the right answer is not always in one place
    texts = [r["question"] for r in choice + answer] + [c for r in choice for c in r["choices"]]
    texts += [r["answer"] for r in answer]
    texts += [line for f in TASKS_DIR.glob("*.yaml") for line in f.read_text().splitlines()
              if line.startswith(("doc_to_text:", "doc_to_choice:", "doc_to_target:"))]  # the prompt's own words
    assert not [t for t in texts if re.search(r"\d", t)]
    assert all(re.fullmatch(r"\w+", r["answer"]) for r in answer)  # what the last-word filter can match


def test_lm_eval_builds_both_tasks_from_the_local_files():
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    code = ("from lm_eval.tasks import TaskManager, get_task_dict; "
            f"d = get_task_dict([{CHOICE_TASK!r}, {ANSWER_TASK!r}], TaskManager(include_path={str(TASKS_DIR)!r})); "
            "print({name: (t.OUTPUT_TYPE, len(list(t.eval_docs))) for name, t in d.items()})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - a dict this test printed
    assert built == {CHOICE_TASK: ("multiple_choice", len(_rows("quiz_mc.jsonl"))),
                     ANSWER_TASK: ("generate_until", len(_rows("quiz_gen.jsonl")))}


def test_the_runs_name_the_same_tasks_and_the_served_model(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    ref = reference_runs(gguf, tmp_path / "ref")
    served = served_runs("http://127.0.0.1:9", "continuous_batching", tmp_path / "srv")
    assert [r.argv[r.argv.index("--tasks") + 1] for r in ref] == [CHOICE_TASK, ANSWER_TASK]
    assert [r.argv[r.argv.index("--tasks") + 1] for r in served] == [CHOICE_TASK, ANSWER_TASK]
    assert f"pretrained={tmp_path},gguf_file=m.gguf,dtype=float32" in ref[0].argv
    assert [r.argv[r.argv.index("--model") + 1] for r in served] == ["local-completions", "local-chat-completions"]
    assert "base_url=http://127.0.0.1:9/v1/completions" in served[0].argv[served[0].argv.index("--model_args") + 1]
    assert served[0].argv[served[0].argv.index("--batch_size") + 1] == "4"  # token-id prompts, four a request
    # the generate-until task is a chat on both sides, the multiple-choice one plain text on both
    assert ["--apply_chat_template" in r.argv for r in ref] == ["--apply_chat_template" in r.argv for r in served]


def _write_run(folder: Path, lls: list[list[float]], texts: list[str]) -> None:
    """A minimal lm-eval output folder: results and samples of both tasks."""
    sub = folder / "model"
    sub.mkdir(parents=True)
    choice = []
    for doc_id, values in enumerate(lls):
        acc = float(max(range(len(values)), key=values.__getitem__) == 0)
        choice.append({"doc_id": doc_id, "metrics": ["acc"], "acc": acc,
                       "resps": [[[str(v), "False"]] for v in values],
                       "filtered_resps": [[str(v), "False"] for v in values]})
    answer = [{"doc_id": i, "metrics": ["exact_match"], "exact_match": float(t == "Paris"), "resps": [[t]],
               "filtered_resps": [t]} for i, t in enumerate(texts)]
    results = {CHOICE_TASK: {"alias": CHOICE_TASK, "acc,none": sum(r["acc"] for r in choice) / len(choice),
                             "acc_stderr,none": 0.1},
               ANSWER_TASK: {"exact_match,last_word": sum(r["exact_match"] for r in answer) / len(answer)}}
    (sub / "results_2026-01-01T00-00-00.json").write_text(json.dumps({"results": results}))
    for task, rows in ((CHOICE_TASK, choice), (ANSWER_TASK, answer)):
        (sub / f"samples_{task}_2026-01-01T00-00-00.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


LLS = [[-1.0, -2.0, -3.0], [-2.5, -1.5, -4.0]]


def test_runs_within_the_tolerance_compare_equal(tmp_path):
    _write_run(tmp_path / "ref", LLS, ["Paris", "blue"])
    _write_run(tmp_path / "srv", [[v + LOGLIKELIHOOD_ATOL / 2 for v in row] for row in LLS], ["Paris", "blue"])
    found = {c.task: c for c in compare_runs(tmp_path / "ref", tmp_path / "srv")}
    assert all(c.ok for c in found.values()), report(list(found.values()))
    assert found[CHOICE_TASK].loglikelihoods == 6 and found[CHOICE_TASK].smallest_choice_gap == 1.0
    assert found[CHOICE_TASK].max_loglikelihood_diff == pytest.approx(LOGLIKELIHOOD_ATOL / 2)
    assert found[CHOICE_TASK].metrics == {"acc,none": (0.5, 0.5)}  # stderr and alias left out


def test_a_moved_loglikelihood_or_a_changed_answer_is_reported_by_item(tmp_path):
    _write_run(tmp_path / "ref", LLS, ["Paris", "blue"])
    moved = [row[:] for row in LLS]
    moved[1][2] += 2 * LOGLIKELIHOOD_ATOL
    _write_run(tmp_path / "srv", moved, ["Paris", "green"])
    found = {c.task: c for c in compare_runs(tmp_path / "ref", tmp_path / "srv")}
    assert found[CHOICE_TASK].differing_items == ["doc 1: log-likelihood by 2.00e-03"]
    assert found[ANSWER_TASK].differing_items == ["doc 1: text [['blue']] vs [['green']]"]
    assert not any(c.ok for c in found.values())
    proc = subprocess.run([sys.executable, "-m", "batchlm.eval.compare", str(tmp_path / "ref"), str(tmp_path / "srv"),
                           "--out", str(tmp_path / "report.md")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.count("DIFFERS") == 2, proc.stdout
    assert (tmp_path / "report.md").read_text() == proc.stdout


def test_a_score_that_differs_fails_the_comparison(tmp_path):
    _write_run(tmp_path / "ref", LLS, ["Paris", "blue"])
    _write_run(tmp_path / "srv", [[-1.0, -2.0, -3.0], [-1.0, -1.5, -4.0]], ["Paris", "blue"])
    choice = {c.task: c for c in compare_runs(tmp_path / "ref", tmp_path / "srv")}[CHOICE_TASK]
    assert choice.metrics["acc,none"] == (0.5, 1.0) and not choice.ok
    assert choice.differing_items == ["doc 1: acc, log-likelihood by 1.50e+00"]
