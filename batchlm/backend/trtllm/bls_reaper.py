"""BlsReaper: keeps finished BLS response iterators alive until the stub has let go of them.

Why it exists (tritonserver 2.51, python_backend r24.10): the iterator of a decoupled BLS call is
shared by the Python object and the stub's routing map. The stub drops the map's share on its
message thread when it sends the call's cleanup id to the server, and that thread does not hold the
GIL. If Python dropped its share first, the iterator is freed there, with every response it kept
(each output tensor holds a numpy array), so Python objects are freed without the GIL while Python
threads run: the stub's heap is corrupted sooner or later (`double free or corruption (fasttop)`, then
the stub dies and its requests hang). The front of `continuous_batching_trtllm` hit it within 2 to
14 benchmark runs at 32 in flight. `tests/functional/test_bls_cleanup.py` checks the premise below on
the real server (`tests/functional/bls_threads_repro.py --noise --remedy`).

How it is avoided: the stub's message thread serves one queue, in order. The cleanup id is queued
when the iterator yields its final response, and `is_cancelled()` is a round trip through that same
queue. So once a cancellation check that was queued after an iterator finished has been answered, the
map holds the iterator no more, and dropping Python's share frees it here, under the GIL.

Contract (all methods thread-safe):
- `retire(obj)`: Python's last share of a finished iterator (and of anything else that must outlive
  the stub's cleanup) is handed over here.
- `mark()` before queueing a round trip, `release(mark)` after one has been answered: everything
  retired before the mark is dropped. The `CancellationWatcher` does both around each of its sweeps.
- A sweep that asks nobody (no request in flight at that moment) releases nothing, so what was retired
  waits for the next sweep that finds a request in flight, or for the process to exit. That is what
  finished between two such sweeps: little where requests are few, and soon released where they are not.
"""

from __future__ import annotations

import threading
from collections import deque


class BlsReaper:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retired: deque[tuple[int, object]] = deque()  # (sequence number, object); guarded by _lock
        self._next = 0  # guarded by _lock

    def retire(self, obj: object) -> None:
        with self._lock:
            self._retired.append((self._next, obj))
            self._next += 1

    def mark(self) -> int:
        with self._lock:
            return self._next

    def release(self, mark: int) -> int:
        """Drop everything retired before `mark`; returns how many."""
        dropped = []
        with self._lock:
            while self._retired and self._retired[0][0] < mark:
                dropped.append(self._retired.popleft())
        return len(dropped)  # NOTE: freed here, on return, by the calling Python thread

    def __len__(self) -> int:
        with self._lock:
            return len(self._retired)
