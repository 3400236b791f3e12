"""logit_bias, min_tokens and the penalties: each row's arithmetic against its definition (transformers'
repetition penalty, OpenAI's frequency and presence penalties), and what they do to greedy decoding on
the random-weight default model, alone and next to requests that use none."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from batchlm.engine.logits_shaping import shape_logits
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.sequence import FinishReason, Sequence
from batchlm.errors import InvalidArgument
from tests.unit.test_engine import PROMPTS, make_engine

V = 32


def seq_with(prompt, output, **params):
    seq = Sequence("r", prompt, SamplingParams(max_tokens=16, **params), frozenset({0}))
    seq.output_ids = list(output)
    return seq


def test_each_row_follows_its_definition():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 3
    prompt, output = [4, 5, 5, 9], [9, 9, 12, 4]
    seqs = [seq_with(prompt, output, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25,
                     logit_bias={7: 2.0, 9: -1.0}),
            seq_with(prompt, output),                         # nothing: its row is left alone
            seq_with(prompt, output[:1], min_tokens=3)]       # EOS (0) is out of reach before 3 tokens
    shaped = shape_logits(logits, seqs)
    want = logits[0].clone()
    want[7] += 2.0
    want[9] -= 1.0
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), want[None])[0]
    for token, count in {9: 2, 12: 1, 4: 1}.items():
        want[token] -= 0.5 * count + 0.25
    assert torch.allclose(shaped[0], want) and torch.equal(shaped[1], logits[1])
    assert shaped[2][0] == float("-inf") and torch.equal(shaped[2][1:], logits[2][1:])
    assert shape_logits(logits, [seqs[1]] * 3) is logits  # no request shapes: no copy


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_greedy_decoding_follows_the_shaped_logits(parts):
    engine = make_engine(parts)
    plain = engine.generate([PROMPTS[0]], greedy(8, ignore_eos=True))[0]
    first = plain.token_ids[0]
    banned = engine.generate([PROMPTS[0]], greedy(8, ignore_eos=True, logit_bias={first: -100}))[0]
    assert banned.token_ids[0] != first
    forced = engine.generate([PROMPTS[0]], greedy(8, ignore_eos=True, logit_bias={17: 100}))[0]
    assert forced.token_ids == [17] * 8
    unrepeated = engine.generate([PROMPTS[0]], greedy(8, ignore_eos=True, logit_bias={17: 100},
                                                      presence_penalty=2.0, frequency_penalty=2.0))[0]
    assert unrepeated.token_ids == [17] * 8  # a bias of 100 outweighs penalties of at most 16
    eos = min(engine.tokenizer.eos_token_ids)
    ends = engine.generate([PROMPTS[0]], greedy(8, logit_bias={eos: 100}, min_tokens=3))[0]
    assert ends.finish_reason is FinishReason.STOP and ends.token_ids[-1] == eos and len(ends.token_ids) == 4


def test_a_request_shapes_only_its_own_row(parts):
    engine = make_engine(parts, max_num_batched_tokens=8)
    plain = [engine.generate([p], greedy(10, ignore_eos=True))[0].token_ids for p in PROMPTS]
    # every other request penalizes, and bans the token it would start with
    params = [greedy(10, ignore_eos=True, **(dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5,
                                                  logit_bias={plain[i][0]: -100.0}) if i % 2 else {}))
              for i in range(len(PROMPTS))]
    batched = engine.generate(PROMPTS, params)
    alone = [make_engine(parts).generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [b.token_ids for b in batched] == [a.token_ids for a in alone]
    assert [b.token_ids == t for b, t in zip(batched, plain)] == [i % 2 == 0 for i in range(len(PROMPTS))]


@pytest.mark.parametrize("field, value", [
    ("min_tokens", 17), ("min_tokens", -1), ("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", "x"),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(max_tokens=16, **{field: value})
    assert err.value.field == field


def test_a_bias_for_a_token_beyond_the_vocabulary_is_refused(parts):
    engine = make_engine(parts)
    with pytest.raises(InvalidArgument) as err:
        engine.check_fits("hi", greedy(4, logit_bias={engine.vocab_size: 1.0}))
    assert err.value.field == "logit_bias"
