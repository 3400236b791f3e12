"""What prefix caching's bookkeeping costs a step, measured in process with no model.

The scheduler (batchlm.engine.scheduler) is driven by a fake runner, closed loop at `concurrency`,
through prompts that fill the cache (the prefix bench's system workload) and then through the control,
prompts that share nothing, once with the cache on and once off, alternately `repeats` times. With the
cache off the scheduler does no prefix work, so the difference in its time per control step is what the
cache's bookkeeping costs: a waiting prompt's block keys and lookup, each filled block's registration,
and taking cached blocks back (eviction) for the control's own. `batchlm-bench prefix` sets it beside
the served control's time per output token, which is one decode step of the model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence as Prompts
from dataclasses import dataclass, replace

from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import Scheduler
from batchlm.engine.sequence import Sequence

FAKE_TOKEN = 7  # every sampled token: the scheduler never reads what the model would have said


@dataclass(frozen=True)
class BookkeepingCost:
    on_us: float   # the scheduler's time per control step with the cache on, microseconds (median of repeats)
    off_us: float  # the same with the cache off
    steps: int     # steps of one pass through the control
    repeats: int   # passes on each side
    evictions: int  # cached blocks (the fill's, and the control's own) one pass with the cache on took back

    @property
    def extra_us(self) -> float:
        return self.on_us - self.off_us

    def as_dict(self) -> dict:
        return {"on_us": self.on_us, "off_us": self.off_us, "extra_us": self.extra_us, "steps": self.steps,
                "repeats": self.repeats, "evictions": self.evictions}


def measure(config: EngineConfig, fill: Prompts[list[int]], control: Prompts[list[int]], max_tokens: int,
            concurrency: int, repeats: int = 21) -> BookkeepingCost:
    """The scheduler's time per control step, cache on and off, after `fill` has run on the same scheduler."""
    per_step: dict[bool, list[float]] = {True: [], False: []}
    steps = evictions = 0
    for _ in range(repeats):
        for caching in (True, False):
            scheduler = Scheduler(replace(config, enable_prefix_caching=caching), BlockAllocator(config.num_kv_blocks))
            drive(scheduler, fill, max_tokens, concurrency)
            before = scheduler.allocator.num_evictions
            seconds, steps = drive(scheduler, control, max_tokens, concurrency)
            per_step[caching].append(seconds / steps * 1e6)
            if caching:
                evictions = scheduler.allocator.num_evictions - before
    return BookkeepingCost(statistics.median(per_step[True]), statistics.median(per_step[False]), steps, repeats,
                           evictions)


def drive(scheduler: Scheduler, prompts: Prompts[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int]:
    """Run `prompts` to their ends, `concurrency` in flight; (seconds in schedule() and update(), steps)."""
    todo = list(reversed(prompts))
    spent, steps, n = 0.0, 0, 0
    while todo or scheduler.has_unfinished():
        while todo and len(scheduler.running) + len(scheduler.waiting) < concurrency:
            n += 1
            scheduler.add(Sequence(f"b{n}", todo.pop(), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        start = time.perf_counter()
        output = scheduler.schedule()
        scheduler.update(output, {s.seq.request_id: FAKE_TOKEN for s in output.scheduled if s.samples})
        spent += time.perf_counter() - start
        steps += 1
    return spent, steps
