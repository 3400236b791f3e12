"""EngineStats: a snapshot of the engine's load, for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int               # sequences holding KV and scheduled each step
    num_waiting: int               # queued (new, or preempted and waiting to be recomputed)
    kv_blocks_used: int
    kv_blocks_total: int
    last_num_seqs: int             # sequences in the last forward pass
    last_num_tokens: int           # tokens in the last forward pass
    total_generated_tokens: int    # sampled tokens since the engine started
    num_preemptions: int           # sequences sent back to waiting under KV pressure, in total
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests, in total
    prefix_cache_hits: int = 0     # of those, tokens whose K/V were found in the prefix cache
    kv_blocks_cached: int = 0      # blocks findable by their tokens, held or not
    prefix_cache_evictions: int = 0  # cached blocks taken back for new tokens, in total

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total
