"""The chat workload: the project's prompt set through the model's chat template, lengths left to the
model; and the output-length statistics and step-count bound computed from what the model produced."""

import itertools
import json
import random

import pytest

from batchlm.bench.workload import (CHAT_PROMPTS, ChatWorkloadSpec, OutputLengths, WorkloadSpec, build_chat_requests,
                                    chat_prompts, make_spec)
from batchlm.model.chat_template import load_chat_template
from batchlm.paths import DEFAULT_MODEL


def test_the_prompt_set_is_the_projects_own_mix():
    prompts = chat_prompts()
    kinds = {k: sum(p["kind"] == k for p in prompts) for k in {p["kind"] for p in prompts}}
    assert len(prompts) >= 200 and len({p["prompt"] for p in prompts}) == len(prompts)
    assert kinds.keys() == {"question", "explanation", "list", "paragraph_task", "code", "long_answer"}, kinds
    assert all(json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines())


def test_chat_requests_go_through_the_chat_template_and_end_at_eos():
    spec = ChatWorkloadSpec(seed=1, num_requests=300, max_tokens=256)
    requests = build_chat_requests(spec, DEFAULT_MODEL)
    assert [r.index for r in requests] == list(range(300))
    template = load_chat_template(DEFAULT_MODEL)
    texts = {template.render([{"role": "user", "content": p["prompt"]}]) for p in chat_prompts()}
    assert all(r.prompt in texts and not r.ignore_eos and r.max_tokens == 256 for r in requests)
    assert len({r.prompt for r in requests[:len(texts)]}) == len(texts)  # every prompt once before any repeats
    assert requests == build_chat_requests(spec, DEFAULT_MODEL)  # seeded
    other_seed = build_chat_requests(ChatWorkloadSpec(seed=2), DEFAULT_MODEL)
    assert [r.prompt for r in requests] != [r.prompt for r in other_seed]
    assert make_spec("chat", 5) == ChatWorkloadSpec(num_requests=5)
    assert make_spec("synthetic", 5) == WorkloadSpec(num_requests=5)
    with pytest.raises(ValueError, match="chat or synthetic"):
        make_spec("other", 5)


def test_the_step_count_bound_of_observed_lengths_is_the_expected_longest_over_the_mean():
    lengths = OutputLengths((3, 10, 10, 50))
    # E[max of 2 draws with replacement], by enumerating the 16 equally likely pairs
    pairs = list(itertools.product(lengths.lengths, repeat=2))
    assert lengths.expected_max(2) == pytest.approx(sum(max(p) for p in pairs) / len(pairs))
    assert lengths.expected_max(1) == pytest.approx(lengths.mean)
    assert lengths.step_bound(8) == pytest.approx(lengths.expected_max(8) / lengths.mean)
    assert OutputLengths((7,) * 5).step_bound(8) == pytest.approx(1.0)  # equal lengths: nothing to gain
    rng = random.Random(0)
    many = OutputLengths(tuple(rng.randint(1, 400) for _ in range(1000)))
    summary = many.summary(8)
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"] == max(many.lengths)
    assert summary["requests"] == 1000 and 1.0 < summary["step_bound_8"] < 400 / many.mean
