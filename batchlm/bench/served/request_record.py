"""Per-request measurements of a benchmark run and their summary (mean, p50, p90, p99, rates, goodput).

Definitions (client side, seconds): TTFT = send to first response carrying text (the whole answer for
models that do not stream); E2E = send to last response; TPOT = (E2E - TTFT) / (output tokens - 1);
inter-token gaps = differences between successive streamed responses, pooled over all requests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Goodput counts requests that meet every bound (seconds)."""

    ttft: float = 5.0
    tpot: float = 0.25
    e2e: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft > self.ttft:
            return False
        if record.tpot is not None and record.tpot > self.tpot:
            return False
        return self.e2e is None or record.latency <= self.e2e

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    sent_at: float = 0.0           # seconds from the run's start
    ttft: float = 0.0
    latency: float = 0.0
    num_output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # seconds from sent_at
    error: str | None = None       # status code ("503", "UNAVAILABLE", ...) when the request failed
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.num_output_tokens < 2 or len(self.chunk_times) < 2:
            return None  # NOTE: an answer that came in one piece has no per-token timing
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def as_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def distribution(values: list[float]) -> dict:
    """mean, p50, p90, p99 (None when there are no values), and the count."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in QUANTILES}}
    array = np.asarray(values, dtype=float)
    stats = {"count": int(array.size), "mean": float(array.mean())}
    stats.update({f"p{q}": float(np.percentile(array, q)) for q in QUANTILES})
    return stats


def summarize(records: list[RequestRecord], duration: float, slo: SLO) -> dict:
    """The run's summary: latency distributions, rates over `duration` seconds, goodput, failures."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": tokens / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "goodput": sum(slo.met_by(r) for r in ok) / duration if duration > 0 else 0.0,
        "slo": slo.as_dict(),
        "ttft": distribution([r.ttft for r in ok]),
        "e2e": distribution([r.latency for r in ok]),
        "tpot": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl": distribution([g for r in ok for g in r.gaps]),
        "failures": dict(Counter(r.error for r in records if not r.ok)),
    }
