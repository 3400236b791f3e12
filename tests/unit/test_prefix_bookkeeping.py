"""The prefix bench's in-process bookkeeping measurement (batchlm.bench.prefix_bookkeeping): the scheduler
with no model, the cache on and off over the same prompts, and a fill that makes the control evict."""

from batchlm.bench import prefix_bookkeeping as pb
from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.scheduler import Scheduler

CONFIG = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
FILL = [[100 + i] * 40 for i in range(6)]  # distinct, 10 blocks each: more than the cache holds with the control's
CONTROL = [[200 + i] * 24 for i in range(6)]


def test_drive_runs_every_prompt_to_its_end_with_at_most_concurrency_in_flight():
    scheduler = Scheduler(CONFIG, BlockAllocator(CONFIG.num_kv_blocks))
    seconds, steps = pb.drive(scheduler, CONTROL, max_tokens=5, concurrency=2)
    assert seconds > 0 and not scheduler.has_unfinished()
    assert steps == 3 * 5  # 3 pairs, each a prefill step that samples and 4 decode steps
    assert scheduler.prefix_cache_queries == 6 * 24


def test_measure_times_both_sides_and_counts_the_controls_evictions():
    cost = pb.measure(CONFIG, FILL, CONTROL, max_tokens=5, concurrency=2, repeats=3)
    assert cost.on_us > 0 and cost.off_us > 0 and cost.extra_us == cost.on_us - cost.off_us
    assert cost.steps == 15 and cost.repeats == 3 and cost.evictions > 0
    assert set(cost.as_dict()) == {"on_us", "off_us", "extra_us", "steps", "repeats", "evictions"}
