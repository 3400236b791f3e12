"""LLMEngine and BatchGenerator on the real default model (random weights, written once per module)."""

import pytest

from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.sequence import FinishReason
from batchlm.errors import InvalidArgument

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog and then",
           "Hello", "In a village by the river there lived an old miller who"]
MAX_TOKENS = [12, 5, 20, 9]


def make_engine(parts, **overrides) -> LLMEngine:
    values = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    values.update(overrides)
    return LLMEngine.from_parts(*parts, EngineConfig(**values))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def alone(parts):
    """Each prompt run by itself, greedy."""
    engine = make_engine(parts)
    return [engine.generate([p], greedy(n))[0] for p, n in zip(PROMPTS, MAX_TOKENS)]


def test_greedy_alone_equals_inside_a_mixed_batch(parts, alone):
    # A small token budget forces prompt chunks to share steps with other sequences' decodes.
    engine = make_engine(parts, max_num_batched_tokens=8)
    batched = engine.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    for a, b, n in zip(alone, batched, MAX_TOKENS):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason is FinishReason.LENGTH and len(b.token_ids) == b.num_output_tokens == n


@pytest.mark.parametrize("pad", [True, False])
def test_batch_generator_equals_engine(parts, alone, pad):
    generator = BatchGenerator(*parts, EngineConfig(num_kv_blocks=64, max_model_len=256,
                                                    pad_finished_rows=pad))
    steps, widths = [], []
    run = generator.engine.runner.run
    generator.engine.runner.run = lambda out: (widths.append(len(out.scheduled) + len(out.padding)),
                                               run(out))[1]
    outputs = generator.generate([(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)],
                                 on_step=lambda seqs, tokens: steps.append((seqs, tokens)))
    assert [o.token_ids for o in outputs] == [a.token_ids for a in alone]
    assert [o.text for o in outputs] == [a.text for a in alone]
    assert sum(tokens for _, tokens in steps) == sum(MAX_TOKENS)
    assert steps[0] == (4, 4) and steps[-1] == (1, 1)  # on_step counts only unfinished rows
    assert widths[-1] == (4 if pad else 1)  # padded: finished rows stay in the forward pass
    assert generator.kv_usage() == (0, 64)


@pytest.mark.parametrize("pad", [True, False])
def test_batch_generator_drops_cancelled_rows_and_runs_the_rest(parts, alone, pad):
    generator = BatchGenerator(*parts, EngineConfig(num_kv_blocks=64, max_model_len=256,
                                                    pad_finished_rows=pad))
    steps = []
    # Row 2 (20 tokens) is cancelled after the 3rd step: it leaves with its 3 tokens, the others go on.
    outputs = generator.generate([(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)],
                                 on_step=lambda seqs, tokens: steps.append(seqs),
                                 cancelled_rows=lambda: [2] if len(steps) == 3 else [])
    assert outputs[2].finish_reason is FinishReason.CANCELLED
    assert outputs[2].token_ids == alone[2].token_ids[:3]
    for i in (0, 1, 3):
        assert outputs[i].token_ids == alone[i].token_ids and outputs[i].finish_reason is FinishReason.LENGTH
    assert len(steps) == max(MAX_TOKENS[i] for i in (0, 1, 3))  # the batch ends with its longest remaining row
    assert generator.kv_usage() == (0, 64)


def test_batch_generator_ends_a_batch_whose_rows_are_all_cancelled(parts):
    generator = BatchGenerator(*parts, EngineConfig(num_kv_blocks=64, max_model_len=256))
    steps = []
    outputs = generator.generate([(p, greedy(200)) for p in PROMPTS],
                                 on_step=lambda seqs, tokens: steps.append(seqs),
                                 cancelled_rows=lambda: range(len(PROMPTS)) if len(steps) == 2 else [])
    assert [o.finish_reason for o in outputs] == [FinishReason.CANCELLED] * len(PROMPTS)
    assert [o.num_output_tokens for o in outputs] == [2] * len(PROMPTS)
    assert len(steps) <= 3  # not 200
    assert generator.kv_usage() == (0, 64)
    assert [o.num_output_tokens for o in generator.generate([("Hello", greedy(4))])] == [4]  # still usable


def test_check_fits_names_the_field(parts):
    # the engine of a batch generator: what request-level models check a request with, while a batch runs
    engine = BatchGenerator(*parts, EngineConfig(num_kv_blocks=64, max_model_len=256)).engine
    engine.check_fits("Hello", greedy(200))
    with pytest.raises(InvalidArgument) as err:
        engine.check_fits("Hello", greedy(255))
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidArgument) as err:
        engine.check_fits([1] * 300, greedy(1))
    assert err.value.field == "prompt"
    per_token = parts[1].max_bytes_per_token
    with pytest.raises(InvalidArgument) as err:  # more bytes than 256 tokens hold: before tokenizing
        engine.check_fits("a" * (256 * per_token + 1), greedy(1))
    assert err.value.field == "prompt" and "before tokenizing" in err.value.message
    with pytest.raises(InvalidArgument) as err:  # as many bytes as 256 tokens hold: tokenized, then refused
        engine.check_fits("ab " * (256 * per_token // 3), greedy(1))
    assert err.value.field == "prompt" and "tokens exceed the limit of 256" in err.value.message


def test_batch_generator_rejects_a_batch_that_does_not_fit(parts):
    generator = BatchGenerator(*parts, EngineConfig(num_kv_blocks=4, max_model_len=64, max_num_seqs=4))
    with pytest.raises(InvalidArgument) as err:
        generator.generate([("Hello", greedy(40)), ("Hello", greedy(40))])  # 3 blocks each
    assert err.value.field == "batch"
    with pytest.raises(InvalidArgument) as err:
        generator.generate([("Hello", greedy(4)), ([10**6], greedy(4))])
    assert err.value.field == "prompt"
    outputs = generator.generate([("Hello", greedy(4)), ("Hi", greedy(4))])  # still usable
    assert [o.num_output_tokens for o in outputs] == [4, 4]


def test_preemption_keeps_greedy_output(parts, alone):
    # 6 blocks of 16 tokens cannot hold all four sequences at their full length at once.
    engine = make_engine(parts, num_kv_blocks=6, max_model_len=96, admit_headroom_blocks=0)
    batched = engine.generate(PROMPTS, [greedy(n + 20) for n in MAX_TOKENS])
    assert engine.stats().num_preemptions > 0
    for a, b in zip(alone, batched):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids


def test_streamed_deltas_add_up_to_the_whole_text(parts, alone):
    engine = make_engine(parts)
    engine.add_request("s", PROMPTS[0], greedy(MAX_TOKENS[0]))
    parts_out = []
    while engine.has_unfinished():
        parts_out += engine.step()
    assert "".join(o.text for o in parts_out) == alone[0].text
    assert [t for o in parts_out for t in o.token_ids] == alone[0].token_ids
    assert parts_out[-1].finished and not any(o.finished for o in parts_out[:-1])


def test_stop_string_truncates_and_finishes_with_stop(parts, alone):
    text = alone[2].text
    stop = text[6:9]
    expected = text[:text.find(stop)]
    out = make_engine(parts).generate([PROMPTS[2]], greedy(MAX_TOKENS[2], stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == expected
    assert out.num_output_tokens < MAX_TOKENS[2]


def test_max_tokens_with_ignore_eos_gives_exactly_max_tokens(parts):
    out = make_engine(parts).generate(["Hi"], greedy(17))[0]
    assert out.finish_reason is FinishReason.LENGTH
    assert len(out.token_ids) == out.num_output_tokens == 17


def test_abort_frees_all_kv_blocks(parts):
    engine = make_engine(parts, max_num_seqs=2)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, greedy(50))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_used > 0 and engine.stats().num_waiting == 1
    assert engine.running_request_ids() == ["r0", "r1"]   # r2 waits: no slot, no KV
    for i in range(3):
        engine.abort_request(f"r{i}")
    engine.abort_request("r0")          # twice: ignored
    engine.abort_request("unknown")     # never seen: ignored
    assert engine.stats().kv_blocks_used == 0
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(o.finished and o.finish_reason is FinishReason.CANCELLED for o in outputs)
    assert not engine.has_unfinished() and engine.running_request_ids() == []


def test_seeded_sampling_is_reproducible(parts):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=42, ignore_eos=True)
    first = make_engine(parts).generate([PROMPTS[0]], params)[0]
    crowd = make_engine(parts).generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[3]],
        [SamplingParams(max_tokens=8, temperature=1.0), params, SamplingParams(max_tokens=4)])[1]
    assert crowd.token_ids == first.token_ids and crowd.text == first.text
    other = make_engine(parts).generate([PROMPTS[0]], SamplingParams(
        max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=43, ignore_eos=True))[0]
    assert other.token_ids != first.token_ids


def test_invalid_requests_name_the_field(parts):
    engine = make_engine(parts)
    cases = [("prompt", [10**6]), ("prompt", ""), ("prompt", 12), ("max_tokens", "Hello")]
    for field, prompt in cases:
        params = greedy(300) if field == "max_tokens" else greedy(4)
        with pytest.raises(InvalidArgument) as err:
            engine.add_request("bad", prompt, params)
        assert err.value.field == field
    engine.add_request("dup", "Hello", greedy(2))
    with pytest.raises(InvalidArgument) as err:
        engine.add_request("dup", "Hello", greedy(2))
    assert err.value.field == "request_id"


def test_stats_report_the_last_forward(parts):
    engine = make_engine(parts)
    engine.add_request("a", "Hello", greedy(3))
    engine.add_request("b", "Once upon a time", greedy(3))
    engine.step()
    stats = engine.stats()
    assert stats.last_num_seqs == 2 and stats.num_running == 2 and stats.total_generated_tokens == 2
    prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in ("Hello", "Once upon a time"))
    assert stats.last_num_tokens == prompt_tokens
    engine.step()
    assert engine.stats().last_num_tokens == 2


def test_in_process_baseline_reads_saturation_up_to_the_last_admission(parts):
    from batchlm.bench.engine_baseline import run_to_completion
    from batchlm.bench.workload import WorkloadRequest

    # 2 slots, 4 requests: the last is admitted when the first finishes, then 2 run and drain
    requests = [WorkloadRequest(i, p, 0, n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    result = run_to_completion(make_engine(parts, max_num_seqs=2), requests)
    saturated = result["saturated"]
    assert result["output_tokens"] == sum(MAX_TOKENS)  # the warm-up is not counted
    assert 0 < saturated["output_tokens"] < result["output_tokens"]
    assert 0 < saturated["duration_s"] < result["duration_s"]
    assert saturated["output_token_throughput"] == saturated["output_tokens"] / saturated["duration_s"]


def test_a_max_model_len_beyond_the_rope_table_is_refused_when_the_engine_is_built(parts):
    # Were it accepted, a sequence that reached position max_position_embeddings (2048 here) would fail
    # its step with IndexError, and with it every sequence in flight.
    with pytest.raises(InvalidArgument, match="^max_model_len: 4096 is beyond the model's max_position_embeddings"):
        make_engine(parts, max_model_len=4096, num_kv_blocks=512)
    with pytest.raises(InvalidArgument, match="^max_model_len"):
        BatchGenerator(*parts, EngineConfig(max_model_len=4096, num_kv_blocks=512))
    assert make_engine(parts, max_model_len=2048, num_kv_blocks=128).config.max_model_len == 2048
