"""Request-level engines' runs: groups in arrival order, each run to its longest request, outputs cut."""

from __future__ import annotations

import time
from collections.abc import Callable

from batchlm.bench.peers.workload import PeerRequest


def request_groups(num_requests: int, size: int) -> list[list[int]]:
    """Request-level batches: indices in arrival order, `size` at a time (the last may be smaller)."""
    if size < 1:
        raise ValueError("group size must be >= 1")
    return [list(range(i, min(i + size, num_requests))) for i in range(0, num_requests, size)]


def truncate(rows: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each row of a group run to the group's longest length, cut to its own request's length."""
    if len(rows) != len(lengths):
        raise ValueError(f"{len(rows)} rows for {len(lengths)} lengths")
    short = [i for i, (row, n) in enumerate(zip(rows, lengths)) if len(row) < n]
    if short:
        raise ValueError(f"rows {short} hold fewer tokens than their requests asked for")
    return [list(row[:n]) for row, n in zip(rows, lengths)]


def now_since(t0: float) -> float:
    """Seconds since `t0` (time.perf_counter)."""
    return time.perf_counter() - t0


def run_groups(requests: list[PeerRequest], group_size: int,
               generate_group: Callable[[list[PeerRequest]], tuple[list[list[int]], list[float]]]) -> dict:
    """A request-level engine's run: groups of `group_size` in arrival order, each run to completion by
    `generate_group(group)`, which returns the group's token rows and when (time.perf_counter) each row's
    first token came; every request of a group ends when the call returns. After one small warm-up call."""
    generate_group([PeerRequest(0, requests[0].prompt_ids, 8)])
    tokens: list[list[int]] = [[] for _ in requests]
    ttft = [0.0] * len(requests)
    e2e = [0.0] * len(requests)
    t0 = time.perf_counter()
    for group in request_groups(len(requests), group_size):
        rows, firsts = generate_group([requests[i] for i in group])
        done = now_since(t0)
        for i, row, first in zip(group, rows, firsts):
            tokens[i], ttft[i], e2e[i] = row, first - t0, done
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": now_since(t0)}
