"""Scheduler policy, with sequence factories and a fake runner: no model, no torch tensors."""

import itertools

import pytest

from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import KVPolicy, Scheduler, SchedulerOutput, check_fits
from batchlm.engine.sequence import FinishReason, Sequence, SequenceStatus
from batchlm.errors import InvalidArgument

_ids = itertools.count()


def make_config(**overrides) -> EngineConfig:
    # NOTE: these prompts are all alike, so the policy tests run without prefix caching (its own tests
    # turn it on): with it, every prompt after the first would start from the first one's blocks
    values = dict(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=64, enable_prefix_caching=False)
    values.update(overrides)
    return EngineConfig(**values)


def make_scheduler(policy=KVPolicy.ON_DEMAND, **overrides) -> Scheduler:
    config = make_config(**overrides)
    return Scheduler(config, BlockAllocator(config.num_kv_blocks), policy)


def make_seq(prompt_len=8, max_tokens=4, request_id=None) -> Sequence:
    request_id = request_id or f"r{next(_ids)}"
    return Sequence(request_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def fake_run(output: SchedulerOutput) -> dict[str, int]:
    """What ModelRunner.run returns: a token for each entry that reaches its sequence's end."""
    return {item.seq.request_id: 7 for item in output.scheduled if item.samples}


def check_invariants(sched: Scheduler, output: SchedulerOutput) -> None:
    config = sched.config
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert len(sched.running) <= config.max_num_seqs
    tables = [b for seq in sched.running + sched.padding for b in seq.block_table]
    assert len(set(tables)) == sched.allocator.num_used
    if len(tables) > len(set(tables)):  # a block held twice is a cached, full one of each holder's prefix
        assert config.enable_prefix_caching
        for seq in sched.running + sched.padding:
            shared = [i for i, b in enumerate(seq.block_table) if tables.count(b) > 1]
            assert all(i < seq.num_registered_blocks for i in shared), (seq, shared)
    for item in output.scheduled:
        seq = item.seq
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= item.num_tokens <= seq.num_uncomputed_tokens
        assert len(seq.block_table) * config.block_size >= seq.num_computed_tokens + item.num_tokens


def step(sched: Scheduler) -> SchedulerOutput:
    output = sched.schedule()
    check_invariants(sched, output)
    sched.update(output, fake_run(output))
    return output


def run_to_completion(sched: Scheduler, max_steps=1000) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished():
        outputs.append(step(sched))
        assert len(outputs) < max_steps, "no progress"
    return outputs


def test_admission_limited_by_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3)
    for _ in range(5):
        sched.add(make_seq())
    output = step(sched)
    assert len(output.scheduled) == 3 and len(sched.waiting) == 2


def test_admission_limited_by_free_blocks():
    sched = make_scheduler(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=96)
    seqs = [make_seq(prompt_len=24, max_tokens=4) for _ in range(3)]  # 6 blocks each to prefill
    for seq in seqs:
        sched.add(seq)
    output = sched.schedule()
    assert [s.seq for s in output.scheduled] == seqs[:2]
    assert sched.allocator.num_free == 4 and list(sched.waiting) == [seqs[2]]


def test_blocks_are_allocated_on_demand_not_up_front():
    sched = make_scheduler()
    seq = make_seq(prompt_len=4, max_tokens=20)
    sched.add(seq)
    step(sched)
    assert len(seq.block_table) == 1  # 4 prompt tokens: one block, not (4 + 20) / 4
    step(sched)
    assert len(seq.block_table) == 2  # the 5th token opened a second block


def test_reserve_full_policy_allocates_prompt_plus_max_tokens():
    sched = make_scheduler(KVPolicy.RESERVE_FULL)
    seq = make_seq(prompt_len=4, max_tokens=20)
    sched.add(seq)
    step(sched)
    assert len(seq.block_table) == 6
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and sched.allocator.num_used == 0


def test_finished_sequence_frees_space_for_the_next_step():
    sched = make_scheduler(max_num_seqs=1)
    first, second = make_seq(max_tokens=2), make_seq(max_tokens=2)
    sched.add(first)
    sched.add(second)
    step(sched)                          # first: prefill + token 1
    output = step(sched)                 # first: token 2, finished
    assert first.is_finished and first.finish_reason is FinishReason.LENGTH
    assert [s.seq for s in output.scheduled] == [first]
    assert first.block_table == []
    output = step(sched)
    assert [s.seq for s in output.scheduled] == [second]


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(prompt_len=50, max_tokens=2)
    sched.add(seq)
    chunks = [step(sched).scheduled[0] for _ in range(4)]
    assert [c.num_tokens for c in chunks] == [16, 16, 16, 2]
    assert [c.samples for c in chunks] == [False, False, False, True]
    assert all(c.is_prefill for c in chunks)
    assert seq.num_output_tokens == 1
    decode = step(sched).scheduled[0]
    assert decode.num_tokens == 1 and not decode.is_prefill and seq.is_finished


def test_token_budget_respected_with_mixed_traffic():
    sched = make_scheduler(max_num_batched_tokens=20, max_num_seqs=4, num_kv_blocks=64, max_model_len=128)
    for i in range(12):
        sched.add(make_seq(prompt_len=3 + (i * 7) % 40, max_tokens=1 + i % 5))
    outputs = run_to_completion(sched)
    assert max(o.num_batched_tokens for o in outputs) == 20
    assert any(o.prefills and o.decodes for o in outputs)  # chunks and decodes share steps


def test_fifo_admission_and_no_starvation():
    # A big head-of-line request must not be overtaken by small ones queued behind it.
    sched = make_scheduler(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=64)
    blocker = make_seq(prompt_len=40, max_tokens=8)   # 10 of 16 blocks
    sched.add(blocker)
    step(sched)
    big = make_seq(prompt_len=32, max_tokens=4)       # needs 8 blocks: waits for the blocker
    smalls = [make_seq(prompt_len=4, max_tokens=2) for _ in range(3)]
    for seq in [big, *smalls]:
        sched.add(seq)
    admitted = []
    while sched.has_unfinished():
        for item in step(sched).scheduled:
            if item.seq not in admitted:
                admitted.append(item.seq)
    assert admitted == [blocker, big, *smalls]
    assert all(s.num_output_tokens == s.params.max_tokens for s in admitted)


def test_preemption_under_block_pressure_completes_everything():
    sched = make_scheduler(num_kv_blocks=12, max_num_seqs=4, max_model_len=48, max_num_batched_tokens=48,
                           admit_headroom_blocks=0)
    seqs = [make_seq(prompt_len=8, max_tokens=24) for _ in range(4)]  # 8 blocks each at the end
    for seq in seqs:
        sched.add(seq)
    outputs = run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert any(o.preempted for o in outputs)
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 24 for s in seqs)
    assert sched.allocator.num_used == 0


def test_admission_headroom_keeps_free_blocks_for_the_running_ones():
    # 4 blocks of 4 tokens. Greedy admission takes the last free block for the third sequence; with a
    # headroom of 1 block per running sequence it waits until the first two leave.
    def admitted_in_first_step(headroom):
        sched = make_scheduler(num_kv_blocks=4, block_size=4, max_num_seqs=4, max_model_len=16,
                               max_num_batched_tokens=16, admit_headroom_blocks=headroom)
        seqs = [make_seq(prompt_len=4, max_tokens=4) for _ in range(3)]
        for seq in seqs:
            sched.add(seq)
        first = step(sched)
        run_to_completion(sched)
        assert all(s.num_output_tokens == 4 for s in seqs) and sched.allocator.num_used == 0
        return len(first.scheduled), sched.num_preemptions

    assert admitted_in_first_step(0) == (3, 1)  # the third is preempted when the others grow
    assert admitted_in_first_step(1) == (2, 0)  # 1 block + 1 free per running one: 2 fit in 4


def test_admission_headroom_never_blocks_an_idle_engine():
    sched = make_scheduler(num_kv_blocks=4, block_size=4, max_num_seqs=4, max_model_len=16,
                           max_num_batched_tokens=16, admit_headroom_blocks=8)
    seq = make_seq(prompt_len=12, max_tokens=4)  # all 4 blocks at the end
    sched.add(seq)
    run_to_completion(sched)
    assert seq.num_output_tokens == 4 and sched.num_preemptions == 0


def test_preempted_sequence_is_recomputed_with_its_output():
    sched = make_scheduler(num_kv_blocks=6, max_num_seqs=2, max_model_len=24, max_num_batched_tokens=24)
    a, b = make_seq(prompt_len=8, max_tokens=12), make_seq(prompt_len=8, max_tokens=12)
    sched.add(a)
    sched.add(b)
    while b.status is not SequenceStatus.WAITING or b.num_output_tokens == 0:
        step(sched)
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    outputs = run_to_completion(sched)
    recompute = next(o for o in outputs for item in o.scheduled if item.seq is b)
    assert recompute.scheduled[-1].num_tokens > 8  # prompt + the tokens it already generated
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_abort_frees_blocks_and_is_safe_for_unknown_ids():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(), make_seq()
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.allocator.num_used > 0
    assert sched.abort(running.request_id) is running
    assert sched.allocator.num_used == 0 and running.finish_reason is FinishReason.CANCELLED
    assert sched.abort(waiting.request_id) is waiting and not sched.waiting
    assert sched.abort(running.request_id) is None and sched.abort("nope") is None
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    seq = make_seq()
    sched.add(seq)
    output = sched.schedule()
    sched.abort(seq.request_id)
    assert sched.update(output, fake_run(output)) == []
    assert sched.allocator.num_used == 0


@pytest.mark.parametrize("prompt_len, max_tokens, field", [
    (65, 1, "prompt"), (60, 8, "max_tokens"), (0, 4, "prompt")])
def test_add_rejects_what_can_never_fit(prompt_len, max_tokens, field):
    sched = make_scheduler()
    with pytest.raises(InvalidArgument) as err:
        sched.add(make_seq(prompt_len=prompt_len, max_tokens=max_tokens))
    assert err.value.field == field


def test_the_request_size_rule_is_a_prompt_and_its_max_tokens_within_the_limit():
    check_fits(60, 4, 64)  # exactly the limit
    for prompt_len, max_tokens, field in ((0, 4, "prompt"), (65, 1, "prompt"), (60, 5, "max_tokens")):
        with pytest.raises(InvalidArgument) as err:
            check_fits(prompt_len, max_tokens, 64)
        assert err.value.field == field
    assert make_config().max_request_tokens == 64


def test_add_rejects_duplicate_request_id():
    sched = make_scheduler()
    sched.add(make_seq(request_id="same"))
    with pytest.raises(InvalidArgument) as err:
        sched.add(make_seq(request_id="same"))
    assert err.value.field == "request_id"


def test_non_chunked_prefill_waits_for_a_whole_prompt():
    sched = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64)
    a, b = make_seq(prompt_len=40, max_tokens=2), make_seq(prompt_len=30, max_tokens=2)
    sched.add(a)
    sched.add(b)
    output = step(sched)
    assert [(s.seq, s.num_tokens) for s in output.scheduled] == [(a, 40)]
    output = step(sched)
    assert [(s.seq, s.num_tokens) for s in output.scheduled] == [(a, 1), (b, 30)]


def test_request_level_batch_keeps_finished_rows_as_padding_until_it_ends():
    sched = make_scheduler(KVPolicy.RESERVE_FULL)
    short, long = make_seq(prompt_len=4, max_tokens=1), make_seq(prompt_len=4, max_tokens=4)
    sched.add(short)
    sched.add(long)
    outputs = run_to_completion(sched)
    assert [len(o.scheduled) + len(o.padding) for o in outputs] == [2, 2, 2, 2]
    assert outputs[1].padding == (short,) and outputs[0].padding == ()
    assert short.is_finished and long.is_finished
    assert sched.padding == [] and sched.allocator.num_used == 0


def test_padding_is_off_for_on_demand_and_when_disabled():
    for sched in (make_scheduler(KVPolicy.ON_DEMAND),
                  make_scheduler(KVPolicy.RESERVE_FULL, pad_finished_rows=False)):
        sched.add(make_seq(prompt_len=4, max_tokens=1))
        sched.add(make_seq(prompt_len=4, max_tokens=4))
        assert all(not o.padding for o in run_to_completion(sched))
        assert sched.allocator.num_used == 0


def test_abort_of_the_last_running_row_frees_the_padding():
    sched = make_scheduler(KVPolicy.RESERVE_FULL)
    short, long = make_seq(prompt_len=4, max_tokens=1), make_seq(prompt_len=4, max_tokens=8)
    sched.add(short)
    sched.add(long)
    step(sched)
    assert sched.padding == [short]
    sched.abort(long.request_id)
    assert sched.padding == [] and sched.allocator.num_used == 0
