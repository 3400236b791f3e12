"""The prefix-caching workloads (batchlm.bench.prefix_workload): seeded, chat turns that extend each other,
a shared system prompt of >= 500 tokens of the default model's tokenizer, and a control with no shared block."""

import pytest

from batchlm.bench import prefix_workload as pw
from batchlm.bench.prefix_texts import FOLLOW_UPS
from batchlm.bench.workload import chat_prompts
from batchlm.model.chat_template import load_chat_template
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import DEFAULT_MODEL, TINY_MODEL_DIR

SMALL = pw.PrefixWorkloadSpec(conversations=4, system_requests=40, control_requests=6,
                              control_prompt_tokens_min=32, control_prompt_tokens_max=64)


@pytest.fixture(scope="module", params=[DEFAULT_MODEL, TINY_MODEL_DIR], ids=["default", "tiny"])
def checkpoint(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint)


def test_the_same_seed_gives_the_same_workloads_and_another_seed_others(tokenizer, checkpoint):
    template = load_chat_template(checkpoint)
    other = pw.PrefixWorkloadSpec(**{**SMALL.as_dict(), "seed": 1})
    assert pw.conversations(SMALL) == pw.conversations(SMALL) != pw.conversations(other)
    assert pw.system_requests(SMALL, tokenizer, template) == pw.system_requests(SMALL, tokenizer, template)
    assert pw.system_requests(SMALL, tokenizer, template) != pw.system_requests(other, tokenizer, template)
    assert pw.control_requests(SMALL, checkpoint) == pw.control_requests(SMALL, checkpoint)
    assert pw.control_requests(SMALL, checkpoint) != pw.control_requests(other, checkpoint)


def test_conversations_open_with_a_short_prompt_and_go_on_with_distinct_follow_ups():
    spec = pw.PrefixWorkloadSpec(conversations=30, turns_min=5, turns_max=10)
    scripts = pw.conversations(spec)
    openers = {p["prompt"] for p in chat_prompts() if p["kind"] in pw.OPENER_KINDS}
    assert [s.index for s in scripts] == list(range(30))
    assert len({s.turns[0] for s in scripts}) == 30 and {s.turns[0] for s in scripts} <= openers
    for s in scripts:
        assert 5 <= len(s.turns) <= 10
        assert set(s.turns[1:]) <= set(FOLLOW_UPS) and len(set(s.turns[1:])) == len(s.turns) - 1
    assert {len(s.turns) for s in scripts} == set(range(5, 11))  # every length drawn


def test_conversations_start_staggered_and_think_a_seeded_time_between_turns():
    spec = pw.PrefixWorkloadSpec(conversations=30, stagger_ms=250, think_ms=800)
    scripts = pw.conversations(spec)
    assert [s.start_s for s in scripts] == [i * 0.25 for i in range(30)]
    assert all(len(s.think_s) == len(s.turns) - 1 for s in scripts)
    thinks = [t for s in scripts for t in s.think_s]
    assert all(0 <= t <= pw.THINK_CAP * 0.8 for t in thinks) and len(set(thinks)) > len(thinks) // 2
    assert 0.5 < sum(thinks) / len(thinks) < 1.1  # exponential, mean 0.8 s, capped
    assert pw.conversations(spec) == scripts
    assert pw.conversations(pw.PrefixWorkloadSpec(**{**spec.as_dict(), "seed": 1})) != scripts
    lockstep = pw.conversations(pw.PrefixWorkloadSpec(conversations=30, stagger_ms=0, think_ms=0))
    assert [s.turns for s in lockstep] == [s.turns for s in scripts]  # the timing leaves the texts alone
    assert all(s.start_s == 0 and set(s.think_s) <= {0.0} for s in lockstep)


def test_a_turn_holds_the_history_with_the_answers_and_its_prompt_extends_the_previous_one(checkpoint):
    template = load_chat_template(checkpoint)
    script = pw.Conversation(0, ("first?", "second?", "third?"))
    answers = ["one", "two"]
    assert script.messages(0, []) == [{"role": "user", "content": "first?"}]
    assert script.messages(2, answers) == [
        {"role": "user", "content": "first?"}, {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second?"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "third?"}]
    prompts = [template.render(script.messages(t, answers)) for t in range(3)]
    assert all(later.startswith(earlier) for earlier, later in zip(prompts, prompts[1:]))
    with pytest.raises(ValueError, match="needs 2 answers"):
        script.messages(2, ["one"])
    with pytest.raises(ValueError):
        script.messages(3, answers + ["three"])


def test_the_system_workload_shares_a_prompt_of_at_least_500_tokens(tokenizer, checkpoint):
    requests = pw.system_requests(SMALL, tokenizer, load_chat_template(checkpoint))
    assert len(requests) == 40 and [r.index for r in requests] == list(range(40))
    assert len(tokenizer.encode(pw.system_prompt(SMALL, tokenizer))) >= 500
    ids = [tokenizer.encode(r.prompt) for r in requests]
    common = min(next((i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b), len(x)) for x in ids[1:])
    assert common >= 500
    assert len({r.prompt for r in requests}) == 32  # every question, then the first ones again
    assert all(r.max_tokens == SMALL.max_tokens and r.ignore_eos for r in requests)
    assert all(r.prompt_tokens == len(i) for r, i in zip(requests, ids))


def test_a_system_prompt_longer_than_the_rules_is_refused(tokenizer):
    with pytest.raises(ValueError, match="system_prompt_tokens"):
        pw.system_prompt(pw.PrefixWorkloadSpec(system_prompt_tokens=50_000), tokenizer)


def test_control_prompts_share_no_kv_block_with_each_other_or_the_other_workloads(tokenizer, checkpoint):
    control = pw.control_requests(SMALL, checkpoint)
    assert len(control) == 6 and all(r.max_tokens == SMALL.max_tokens and r.ignore_eos for r in control)
    assert all(32 <= r.prompt_tokens <= 64 for r in control)
    template = load_chat_template(checkpoint)
    others = [r.prompt for r in pw.system_requests(SMALL, tokenizer, template)]
    others += [template.render(s.messages(0, [])) for s in pw.conversations(SMALL)]
    heads = [tuple(tokenizer.encode(r.prompt)[:16]) for r in control]
    assert len(set(heads)) == len(heads)
    assert not set(heads) & {tuple(tokenizer.encode(p)[:16]) for p in others}


@pytest.mark.parametrize("field, value, said", [
    ("turns_max", 4, "turns_max must be >= turns_min"),
    ("turns_max", len(FOLLOW_UPS) + 2, "turns_max must be <= "),
    ("conversations", 0, "conversations must be >= 1"),
    ("control_prompt_tokens_max", 1, "control_prompt_tokens_max must be >= control_prompt_tokens_min"),
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("think_ms", -1, "think_ms must be >= 0"),
    ("stagger_ms", -1, "stagger_ms must be >= 0"),
])
def test_a_spec_names_the_field_it_refuses(field, value, said):
    with pytest.raises(ValueError, match=said):
        pw.PrefixWorkloadSpec(**{field: value})
