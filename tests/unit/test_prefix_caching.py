"""Prefix caching on the random-weight default model: answers bit-identical to the cache off (tokens and
log-probabilities), cold or warm, for chat turns, a shared system prompt, prefixes that end mid-block,
eviction under pressure, preemption and a cancelled request whose blocks others hold; and the
bookkeeping: what is found, what is never found, and every block given back."""

import pytest

from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import Scheduler
from batchlm.engine.sequence import Sequence
from tests.unit.test_engine import make_engine
from tests.unit.test_scheduler import make_config, run_to_completion

BS = 16  # make_engine's block size (EngineConfig's default)
SYSTEM = ("You are a careful assistant for a public library. Answer in full sentences, name the shelf where a "
          "book is kept, and say when the reading room opens. ") * 3


def params(n=6, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2, **kw)


def outputs(engine, prompts, n=6, together=True):
    """(token ids, log-probabilities, cached prompt tokens) of each prompt, all in one batch or one by one."""
    runs = [engine.generate(prompts, params(n))] if together else [engine.generate([p], params(n)) for p in prompts]
    return [(o.token_ids, o.logprobs, o.num_cached_tokens) for run in runs for o in run]


def without_cache(parts, prompts, **kw):
    return [(ids, lp) for ids, lp, _ in outputs(make_engine(parts, enable_prefix_caching=False), prompts, **kw)]


def test_chat_turns_reuse_the_conversation_and_answer_as_without_cache(parts):
    engine = make_engine(parts)
    tokenizer = engine.tokenizer
    history = tokenizer.encode(SYSTEM + "Where are the atlases?")
    cold, warm, lengths = [], [], []
    for turn in range(4):
        out = engine.generate([history], params(8))[0]
        warm.append((out.token_ids, out.logprobs, out.num_cached_tokens))
        cold.append(without_cache(parts, [history], n=8)[0])
        lengths.append(len(history) + len(out.token_ids))
        history = history + out.token_ids + tokenizer.encode(f" And what about question {turn}?")
    assert [(ids, lp) for ids, lp, _ in warm] == cold
    # each later turn finds every full block of the previous turn's prompt and answer (all but the last
    # answer token's K/V were computed)
    assert [cached for _, _, cached in warm] == [0] + [(n - 1) // BS * BS for n in lengths[:-1]]
    stats = engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries


def test_a_shared_system_prompt_is_computed_once(parts):
    engine = make_engine(parts)
    tokenizer = engine.tokenizer
    questions = [SYSTEM + q for q in ("Is it open on Sunday?", "Can I print there?", "Where is poetry?",
                                      "Do you lend films?")]
    first = outputs(engine, questions[:1])
    rest = outputs(engine, questions[1:])  # the first one's blocks are cached by then
    shared = len(tokenizer.encode(SYSTEM)) // BS * BS
    assert first[0][2] == 0 and all(cached >= shared - BS for _, _, cached in rest)
    assert [(ids, lp) for ids, lp, _ in first + rest] == without_cache(parts, questions, together=False)


def test_prompts_sharing_a_prefix_that_ends_mid_block(parts):
    engine = make_engine(parts)
    base = list(range(100, 100 + 2 * BS + 5))  # two full blocks and 5 tokens
    prompts = [base + [7, 8, 9], base + [10, 11], base[:2 * BS + 2] + [12]]
    got = outputs(engine, prompts[:1]) + outputs(engine, prompts[1:], together=False)
    assert [cached for _, _, cached in got] == [0, 2 * BS, 2 * BS]
    assert [(ids, lp) for ids, lp, _ in got] == without_cache(parts, prompts, together=False)


def test_a_whole_cached_prompt_still_computes_its_last_token(parts):
    engine = make_engine(parts)
    prompt = list(range(200, 200 + 2 * BS))  # exactly two blocks
    again = outputs(engine, [prompt]) + outputs(engine, [prompt])
    assert [cached for _, _, cached in again] == [0, BS]
    assert again[0][:2] == again[1][:2]


def test_eviction_under_pressure_and_preemption_keep_answers_exact(parts):
    """A cache of 12 blocks: every request evicts others' blocks, and four at once preempt each other."""
    engine = make_engine(parts, num_kv_blocks=12, max_model_len=96, admit_headroom_blocks=0)
    prompts = [[300 + i] + list(range(400, 400 + BS + 3 * i)) for i in range(4)] * 2
    got = outputs(engine, prompts, n=20) + outputs(engine, prompts[:4], n=20, together=False)
    stats = engine.stats()
    assert stats.prefix_cache_evictions > 0 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert [(ids, lp) for ids, lp, _ in got] == without_cache(parts, prompts + prompts[:4], n=20, together=False)
    assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.allocator.num_total


def test_cancelling_a_request_whose_blocks_others_hold(parts):
    engine = make_engine(parts)
    prompt = engine.tokenizer.encode(SYSTEM)
    engine.generate([prompt], params(2))  # cache the prefix
    rows = [prompt + [50 + i] for i in range(3)]
    steps = iter(range(100))
    got = engine.generate(rows, params(10), cancelled_rows=lambda: [1] if next(steps) == 3 else [])
    assert got[1].finish_reason.value == "cancelled" and len(got[1].token_ids) < 10
    kept = [(o.token_ids, o.logprobs) for o in (got[0], got[2])]
    assert kept == without_cache(parts, [rows[0], rows[2]], n=10, together=False)
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("prompt_logprobs", [None, 0])
def test_what_the_scheduler_finds(prompt_logprobs):
    config = make_config(enable_prefix_caching=True)
    sched = Scheduler(config, BlockAllocator(config.num_kv_blocks))
    prompt = list(range(10, 10 + 3 * config.block_size))

    def seq(request_id, ids):
        return Sequence(request_id, ids, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=prompt_logprobs))

    sched.add(seq("a", prompt))
    run_to_completion(sched)
    b, c = seq("b", prompt), seq("c", prompt[:5] + [1] + prompt[6:])
    sched.add(b)
    sched.add(c)
    run_to_completion(sched)
    if prompt_logprobs is None:  # all of b's blocks but the one with its last token; c differs in block 1
        assert (b.num_cached_tokens, c.num_cached_tokens) == (2 * config.block_size, config.block_size)
    else:  # a request that scores its prompt computes all of it
        assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 0)
    assert sched.allocator.num_used == 0 and sched.allocator.num_cached > 0
