"""What one streamed answer measured, and one run's figures: output tok/s, TTFT and TPOT percentiles."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamRecord:
    """One request's answer as the client saw it; times in seconds from the run's start."""

    index: int                 # the request's place in the workload
    sent_s: float
    first_token_s: float       # when the first piece of output arrived
    done_s: float              # when the answer was complete
    output_tokens: int         # as the server counted them (or the ids received)
    token_ids: tuple[int, ...] = ()  # the output's ids, where the API returns them
    text: str = ""             # the output's text, where it returns no ids

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (done - first) / (tokens - 1); None for one token."""
        if self.output_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), numpy's linear interpolation as the other served reports use; None if
    empty."""
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True)
class RunStats:
    requests: int
    output_tokens: int
    wall_s: float              # first request sent to last answer complete
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "output_tokens": self.output_tokens, "wall_s": self.wall_s,
                "output_tok_per_s": self.output_tok_per_s, "ttft_p50_s": self.ttft_p50_s,
                "ttft_p99_s": self.ttft_p99_s, "tpot_p50_s": self.tpot_p50_s, "tpot_p99_s": self.tpot_p99_s}


def run_stats(records: list[StreamRecord]) -> RunStats:
    if not records:
        raise ValueError("no answers to summarize")
    ttfts = [r.ttft_s for r in records]
    tpots = [t for t in (r.tpot_s for r in records) if t is not None]
    wall = max(r.done_s for r in records) - min(r.sent_s for r in records)
    return RunStats(len(records), sum(r.output_tokens for r in records), wall,
                    percentile(ttfts, 50), percentile(ttfts, 99), percentile(tpots, 50), percentile(tpots, 99))
