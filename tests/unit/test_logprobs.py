"""The engine's log-probabilities (random-weight default model): what a step's logits say, for generated
and prompt tokens, whatever the batch, the prefill chunking or a preemption; values checked against the
model run a token at a time. The real model against transformers: tests/unit/test_default_model_reference.py."""

import math

import pytest
import torch

from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.request_schema import MAX_LOGPROBS
from tests.unit.test_default_model_reference import engine_logprobs
from tests.unit.test_engine import PROMPTS, make_engine

ASK = dict(logprobs=3, prompt_logprobs=2)


def run(engine, prompts, **kw):
    return engine.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, **kw)] * len(prompts))


@pytest.fixture(scope="module")
def alone(parts):
    engine = make_engine(parts)
    return [run(engine, [p], **ASK)[0] for p in PROMPTS]


def test_values_are_the_models_distribution(parts, alone):
    engine = make_engine(parts)
    for prompt, out in zip(PROMPTS, alone):
        ids = engine.tokenizer.encode(prompt)
        assert out.prompt_ids == ids and [t.token_id for t in out.prompt_logprobs] == ids[1:]
        assert [t.token_id for t in out.logprobs] == out.token_ids
        ours = torch.tensor([t.logprob for t in out.prompt_logprobs + out.logprobs], dtype=torch.float64)
        diff = (ours - engine_logprobs(engine, ids + out.token_ids)).abs().max().item()
        assert diff < 1e-4, diff
        for t in out.logprobs:  # greedy: the chosen token is the most likely, its value the top's
            assert len(t.top) == 3 and t.top[0] == (t.token_id, t.logprob)
            assert [p for _, p in t.top] == sorted((p for _, p in t.top), reverse=True)
        assert all(len(t.top) == 2 and t.logprob <= t.top[0][1] for t in out.prompt_logprobs)


def test_a_request_gets_the_same_values_whatever_shares_its_steps(parts, alone):
    """Prefill chunks of 8 tokens next to other requests' decodes, and requests that ask for nothing."""
    engine = make_engine(parts, max_num_batched_tokens=8)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **(ASK if i % 2 == 0 else {}))
              for i in range(len(PROMPTS))]
    batched = engine.generate(PROMPTS, params)
    plain = make_engine(parts)
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert b.token_ids == a.token_ids
        if i % 2 == 0:
            assert (b.logprobs, b.prompt_logprobs) == (a.logprobs, a.prompt_logprobs)
        else:
            assert (b.logprobs, b.prompt_ids, b.prompt_logprobs) == (None, None, None)
            assert b.token_ids == run(plain, [PROMPTS[i]])[0].token_ids


def test_a_preempted_request_scores_its_prompt_once(parts, alone):
    engine = make_engine(parts, num_kv_blocks=6, max_model_len=96, admit_headroom_blocks=0)
    batched = engine.generate(PROMPTS, [SamplingParams(max_tokens=26, ignore_eos=True, **ASK)] * len(PROMPTS))
    assert engine.stats().num_preemptions > 0
    for a, b in zip(alone, batched):
        assert b.prompt_logprobs == a.prompt_logprobs
        assert b.logprobs[:len(a.logprobs)] == a.logprobs and len(b.logprobs) == len(b.token_ids) == 26


def test_sampled_tokens_are_scored_before_temperature(parts):
    engine = make_engine(parts)
    hot = run(engine, [PROMPTS[1]], temperature=5.0, seed=3, logprobs=0)[0]
    ids = engine.tokenizer.encode(PROMPTS[1])
    ours = torch.tensor([t.logprob for t in hot.logprobs], dtype=torch.float64)
    assert (ours - engine_logprobs(engine, ids + hot.token_ids)[len(ids) - 1:]).abs().max() < 1e-4
    assert all(t.top == () and math.isfinite(t.logprob) for t in hot.logprobs)


def test_a_one_token_prompt_has_no_prompt_logprobs(parts):
    engine = make_engine(parts)
    out = run(engine, [[5]], prompt_logprobs=4)[0]
    assert (out.prompt_ids, out.prompt_logprobs, out.logprobs) == ([5], [], None)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_out_of_range_counts_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
