"""SamplingParams validation and the Sampler's behaviour per row."""

import pytest
import torch

from batchlm.engine.sampling import Sampler, SamplingParams, make_generator
from batchlm.errors import InvalidArgument


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("seed", 2**64),
    ("stop", "###"), ("stop", ("",)), ("stop", (1,)), ("ignore_eos", "no"),
    ("stop", ("x",) * 17), ("stop", ("a", "y" * 257)),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert str(err.value).startswith(field)


def test_stop_list_becomes_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert len(SamplingParams(stop=["z" * 256] * 16).stop) == 16  # the most a request may carry


def _logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits()
    tokens = Sampler().sample(logits, [SamplingParams()] * 4, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_ties_take_the_first_index():
    logits = torch.zeros(3, 50)
    logits[0, [7, 30]] = 2.0  # a tie: the lower index wins, as argmax
    logits[1, [0, 49]] = 1.0
    logits[2, 11] = float("inf")
    params = [SamplingParams()] * 3
    assert Sampler().sample(logits, params, [None] * 3) == [7, 0, 11]
    mixed = params[:2] + [SamplingParams(temperature=1.0, seed=1)]
    assert Sampler().sample(logits, mixed, [make_generator(p.seed) for p in mixed])[:2] == [7, 0]


def test_mixed_rows_greedy_rows_stay_argmax():
    logits = _logits()
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2
    gens = [make_generator(p.seed) for p in params]
    tokens = Sampler().sample(logits, params, gens)
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()


def test_top_k_restricts_support():
    logits = _logits(rows=1)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    gen = make_generator(0)
    seen = {Sampler().sample(logits, [params], [gen])[0] for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_restricts_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -5.0, -5.0]])
    probs = torch.softmax(logits[0], -1)
    assert probs[:2].sum() < 0.95 < probs[:3].sum()
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=0)
    gen = make_generator(0)
    seen = {Sampler().sample(logits, [params], [gen])[0] for _ in range(500)}
    assert seen == {0, 1, 2}


def test_tiny_top_p_is_greedy():
    logits = _logits(rows=1)
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)
    tokens = {Sampler().sample(logits, [params], [make_generator(3)])[0] for _ in range(20)}
    assert tokens == {logits[0].argmax().item()}


def test_same_seed_same_samples_whatever_shares_the_batch():
    row = _logits(rows=1, seed=9)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234)

    def run(batch_logits, batch_params, index, steps=30):
        gens = [make_generator(p.seed) for p in batch_params]
        return [Sampler().sample(batch_logits, batch_params, gens)[index] for _ in range(steps)]

    alone = run(row, [params], 0)
    others = [SamplingParams(), SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=2.0)]
    crowd = torch.cat([_logits(rows=3, seed=1), row])
    shared = run(crowd, others + [params], 3)
    assert alone == shared
    assert len(set(alone)) > 1  # it really samples
    other_seed = run(row, [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=4321)], 0)
    assert other_seed != alone


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-300])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    # This guards against logits / temperature overflowing to inf (or dividing by a temperature that is 0
    # in float32): softmax would give NaN, and every row would sample the last id of the vocabulary.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    picked = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
    assert picked == logits.argmax(dim=-1).tolist()
