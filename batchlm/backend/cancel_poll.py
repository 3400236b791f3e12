"""CancelPoll: which rows of a running request-level batch their clients cancelled, asked inline.

Static and dynamic batching run a batch to completion on one thread; without this, a batch whose
clients all went away would run to its longest row, and in dynamic batching the next batch would wait.
Each row's question (`sender.is_cancelled()` or `request.is_cancelled()`) is a round trip to the
server, so it is asked from the stepping thread at most once per `period`: at 8 rows every 100 ms,
about 1 ms of asks a second (continuous batching, with up to 64 requests, asks from a thread of its
own instead: `batchlm.backend.cancellation_watcher`).

A row also leaves once its Triton per-request timeout passes (`leave_check`); the caller answers it
"request timeout expired" rather than CANCELLED.

Contract: `poll()` is called after every step, from one thread; it returns the rows found cancelled
since its last call, each row once, and asks nothing until `period` seconds have passed since its
last asking. A question that raises counts as "not cancelled" (a server going away fails the batch's
requests by other means).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


class CancelPoll:
    def __init__(self, checks: Sequence[Callable[[], bool]], period: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if period <= 0:
            raise ValueError(f"period must be > 0, got {period}")
        self._checks = list(checks)
        self._period = period
        self._clock = clock
        self._next = clock() + period
        self._open = set(range(len(self._checks)))  # rows not yet found cancelled

    def poll(self) -> list[int]:
        now = self._clock()
        if now < self._next or not self._open:
            return []
        self._next = now + self._period
        found = [row for row in sorted(self._open) if _ask(self._checks[row])]
        self._open.difference_update(found)
        return found


def _ask(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - see the module's contract
        return False


def leave_check(is_cancelled: Callable[[], bool], deadline: float | None,
                clock: Callable[[], float] = time.monotonic) -> Callable[[], bool]:
    """A row's question for CancelPoll: its client cancelled, or its timeout (`deadline`, on `clock`)
    passed. The deadline is read first: it costs no round trip."""
    if deadline is None:
        return is_cancelled
    return lambda: clock() >= deadline or is_cancelled()
