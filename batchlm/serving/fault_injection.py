"""Fault injection for the serving threads: make one call at a named point raise, to prove that a fault
there fails only the requests it touches and leaves the model serving. Off unless a model's
`fault_injection` parameter asks for it; never set in the shipped configs.

    parameters { key: "fault_injection" value: { string_value: "step@2,metrics@1" } }

Each `POINT@N` makes the N-th pass through POINT raise once: `InjectedFault` (an Exception, as a bug in
that code would) at `admit` (adding one request to the engine), `step` (a forward pass), `abort` (a
cancelled request's abort) and `metrics` (a metrics push); `InjectedThreadDeath` (a BaseException, so
that nothing inside the loop catches it) at `loop`, the engine thread's loop itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from batchlm.errors import InvalidArgument

POINTS = ("admit", "step", "abort", "metrics", "loop")


class InjectedFault(Exception):
    """Raised at a fault point: what a bug in the code there would raise."""


class InjectedThreadDeath(BaseException):
    """Raised at `loop`: the engine thread cannot go on."""


@dataclass
class FaultInjector:
    plan: dict[str, int] = field(default_factory=dict)  # point -> the pass that raises (1-based)
    _passes: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def parse(cls, spec: str, key: str = "fault_injection") -> FaultInjector:
        """`POINT@N[,POINT@N...]`, or "" for none; InvalidArgument naming `key` otherwise."""
        plan: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            point, _, at = item.partition("@")
            if point not in POINTS or not at.isdigit() or int(at) < 1 or point in plan:
                raise InvalidArgument(key, f"{item!r} is not POINT@N with N >= 1 and POINT one of {list(POINTS)} "
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
