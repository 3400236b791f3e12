"""Fault injection for the serving threads: make one call at a named point raise, to prove that a fault
there fails only the requests it touches and leaves the model serving. Off unless a model's
`fault_injection` parameter asks for it; never set in the shipped configs.

    parameters { key: "fault_injection" value: { string_value: "step@2,metrics@1" } }

Each `POINT@N` makes the N-th pass through POINT raise once, passes counted per model instance from its
load: `InjectedFault` (an Exception, as a bug in that code would) at `admit`, `step`, `abort` and
`metrics`; `InjectedThreadDeath` (a BaseException, so that nothing inside the loop catches it) at `loop`.
The points, in continuous_batching (its engine thread), static_batching (its worker thread; `admit` on
Triton's thread) and dynamic_batching (Triton's execute call, which runs the batch):

- `admit`: one request being accepted (continuous: added to the engine; static: parked by `submit`;
  dynamic: a request of the batch). It alone fails.
- `step`: a forward step. Continuous: every running request fails; static and dynamic: its batch fails.
- `abort` (continuous only): a cancelled or expired request's abort. Logged; no other request fails.
- `metrics`: a metrics push. Logged; no request fails.
- `loop`: continuous and static: the thread's loop dies (between turns; static: holding the batch it
  took). Every request it held or that waited, and every later one at once, fails until the model is
  reloaded. dynamic_batching has no thread of its own: the N-th batch's run raises, only that batch
  fails, and the model serves on.

A failed request is answered INTERNAL "InjectedFault: fault injected at POINT, pass N" (dynamic `loop`:
"InjectedThreadDeath: ..."); after a thread's death, INTERNAL "EngineStopped: MODEL: the engine thread
stopped (InjectedThreadDeath: fault injected at loop, pass N); reload the model". A point the model does
not have (`abort` in static or dynamic batching) fails the load, naming `fault_injection`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchlm.errors import InvalidArgument

POINTS = ("admit", "step", "abort", "metrics", "loop")
# static and dynamic batching: a cancelled row leaves inside the batch's generate, with no abort of its own
REQUEST_LEVEL_POINTS = ("admit", "step", "metrics", "loop")


class InjectedFault(Exception):
    """Raised at a fault point: what a bug in the code there would raise."""


class InjectedThreadDeath(BaseException):
    """Raised at `loop`: the serving thread cannot go on."""


@dataclass
class FaultInjector:
    plan: dict[str, int] = field(default_factory=dict)  # point -> the pass that raises (1-based)
    _passes: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def parse(cls, spec: str, key: str = "fault_injection", points: Sequence[str] = POINTS) -> FaultInjector:
        """`POINT@N[,POINT@N...]` with each POINT one of `points` (the model's), or "" for none;
        InvalidArgument naming `key` otherwise."""
        plan: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            point, _, at = item.partition("@")
            if point not in points or not at.isdigit() or int(at) < 1 or point in plan:
                raise InvalidArgument(key, f"{item!r} is not POINT@N with N >= 1 and POINT one of {list(points)} "
                                           "(each point once)")
            plan[point] = int(at)
        return cls(plan)

    def hit(self, point: str) -> None:
        """Count a pass through `point`; raise if this is the pass the plan names."""
        if point not in self.plan:
            return
        with self._lock:
            self._passes[point] = self._passes.get(point, 0) + 1
            now = self._passes[point] == self.plan[point]
        if now:
            message = f"fault injected at {point}, pass {self.plan[point]}"
            raise InjectedThreadDeath(message) if point == "loop" else InjectedFault(message)
