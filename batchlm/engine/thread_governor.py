"""ThreadGovernor: how many intra-op threads the engine steps with, given the cores other processes take.

The engine's forward pass runs as a team of OpenMP threads that meet at a barrier at the end of every
parallel region, many times per step. While every thread has a core of its own that costs microseconds.
When another process keeps one of the cores busy (a log shipper, the load generator, a neighbour's job),
the kernel scheduler shares that core between it and one member of the team, and every region then waits,
up to a time slice, for the member that is not running while the others spin. On 2 cores with one busy
process a 2-thread team loses most of its throughput, in process and more so served, while one thread,
which the other process cannot delay, keeps what one core gives. `batchlm-bench contention` measures
both (docs/benchmarking.md).

So the engine asks this governor before each step. Every PERIOD_S it reads how busy the CPUs this process
may run on were (/proc/stat, every process) and takes away this process's own CPU time: what is left is
the cores other processes used, and the rest are free. A thread goes when the free cores fall more than
BAND below the team's size and comes back when they rise more than BAND above it, so a count between the
two thresholds stays put and a busy neighbour at about half a core (where 2 threads and 1 measure the
same on 2 cores) does not make it flap. A window that spans an idle engine (no step for STALE_S) is not
judged. Where /proc/stat cannot be read (not Linux) it keeps the configured count.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

PERIOD_S = 0.25     # how often the CPUs are read: about 25 scheduler ticks per core
STALE_S = 1.0       # a window longer than this spanned an idle engine: start a new one, judge nothing
BAND = 0.6          # cores: a thread goes when other processes take more than this share of its core
                    # (one that takes less leaves it more time than it costs the team, as
                    # `batchlm-bench contention` shows), and comes back when they take less than 1 - BAND of it
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (idle and iowait are free)


def read_busy_seconds(cpus: frozenset[int], path: str = "/proc/stat") -> float:
    """CPU seconds spent busy so far, summed over `cpus`, by every process."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                continue  # the aggregate "cpu " line, or past the per-CPU lines
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total / tick


class ThreadGovernor:
    """Call `threads()` before each step; it returns the thread count to step with now."""

    def __init__(self, max_threads: int, *, cpus: frozenset[int] | None = None,
                 busy_seconds: Callable[[], float] | None = None,
                 own_seconds: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be >= 1")
        self.max_threads = max_threads
        self.cpus = frozenset(cpus if cpus is not None else _allowed_cpus())
        self._busy = busy_seconds or (lambda: read_busy_seconds(self.cpus))
        self._own = own_seconds
        self._clock = clock
        self.current = max_threads
        self.others = 0.0            # cores other processes used in the last judged window
        self.enabled = max_threads > 1
        self._mark: tuple[float, float, float] | None = None
        if self.enabled:
            try:
                self._mark = self._sample()
            except (OSError, ValueError):
                self.enabled = False  # no /proc/stat: keep the configured count

    def threads(self) -> int:
        if not self.enabled:
            return self.current
        now = self._clock()
        if now - self._mark[0] < PERIOD_S:
            return self.current
        try:
            sample = self._sample()
        except (OSError, ValueError):
            return self.current
        wall, busy, own = (b - a for a, b in zip(self._mark, sample))
        self._mark = sample
        if wall > STALE_S or wall <= 0:
            return self.current
        self.others = max(0.0, (busy - own) / wall)
        self.current = self.choose(self.current, len(self.cpus) - self.others)
        return self.current

    def choose(self, current: int, free_cores: float) -> int:
        """The thread count for `free_cores` cores left by other processes, starting from `current`."""
        if free_cores < current - BAND:
            return max(1, math.floor(free_cores + BAND))
        if free_cores > current + BAND:
            return min(self.max_threads, math.floor(free_cores + 1 - BAND))
        return current

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), self._busy(), self._own()


def _allowed_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))
