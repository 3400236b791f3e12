"""Arrival processes for the serving benchmark: open loop (Poisson or gamma) and closed loop.

Open loop: requests arrive at a fixed mean rate whatever the server does; gaps are Gamma(shape, mean
1/rate): shape 1 is Poisson, shape < 1 burstier, shape > 1 smoother. Closed loop: `concurrency`
clients each send their next request as soon as the previous one is answered.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

OPEN = "open"
CLOSED = "closed"


@dataclass(frozen=True)
class ArrivalSpec:
    mode: str = CLOSED         # "open" (rate-driven) or "closed" (concurrency-driven)
    rate: float = 0.0          # open loop: mean requests per second
    burstiness: float = 1.0    # open loop: gamma shape of the gaps (1 = Poisson)
    concurrency: int = 8       # closed loop: requests in flight; open loop: unused
    seed: int = 0              # the arrival times' seed (independent of the workload's)

    def __post_init__(self) -> None:
        if self.mode not in (OPEN, CLOSED):
            raise ValueError(f"ArrivalSpec.mode must be {OPEN!r} or {CLOSED!r}, got {self.mode!r}")
        if self.mode == OPEN and not self.rate > 0:
            raise ValueError("ArrivalSpec.rate must be > 0 for open-loop arrivals")
        if not self.burstiness > 0:
            raise ValueError("ArrivalSpec.burstiness must be > 0")
        if self.concurrency < 1:
            raise ValueError("ArrivalSpec.concurrency must be >= 1")

    @classmethod
    def open_loop(cls, rate: float, burstiness: float = 1.0, seed: int = 0) -> ArrivalSpec:
        return cls(mode=OPEN, rate=rate, burstiness=burstiness, seed=seed)

    @classmethod
    def closed_loop(cls, concurrency: int) -> ArrivalSpec:
        return cls(mode=CLOSED, concurrency=concurrency)

    @property
    def label(self) -> str:
        """How a run is labelled everywhere: 'open-loop poisson 1.50 req/s' or 'closed-loop c=32'."""
        if self.mode == CLOSED:
            return f"closed-loop c={self.concurrency}"
        kind = "poisson" if self.burstiness == 1.0 else f"gamma(shape={self.burstiness:g})"
        return f"open-loop {kind} {self.rate:.2f} req/s"

    def as_dict(self) -> dict:
        return {**asdict(self), "label": self.label}

    def send_times(self, num_requests: int) -> list[float]:
        """Open loop: seconds from the run's start at which each request is sent (first at 0)."""
        if self.mode != OPEN:
            raise ValueError("send_times() is for open-loop arrivals")
        rng = random.Random(self.seed)
        mean_gap = 1.0 / self.rate
        times, now = [], 0.0
        for _ in range(num_requests):
            times.append(now)
            now += rng.gammavariate(self.burstiness, mean_gap / self.burstiness)
        return times
