"""CancellationWatcher: asks Triton which requests were cancelled, on its own thread.

`sender.is_cancelled()` is a round trip to the server (the stub enqueues the question, a stub thread
forwards it, a server thread answers). Asked on the engine thread, every running request once per
period, the engine would wait for 64 round trips every 100 ms at 64 sequences, time in which no step runs.
The watcher asks the same questions from its own thread (the call releases the GIL while it waits), so
the engine thread only picks up the answers.

Contract:
- `watch(request_id, sender)` / `unwatch(request_id)` may be called from any thread. After `unwatch`
  returns, the watcher never asks that sender again: call it before a request's final response is sent,
  because Triton frees the response factory behind a sender once its final response is sent.
- Every watched request is asked at most once per `period` seconds; ids found cancelled are handed to
  `on_cancelled` (from the watcher's thread), each once.
- `close()` stops the thread and returns when it has stopped (or after `timeout`).
- With a `reaper` (`batchlm.backend.trtllm.bls_reaper.BlsReaper`), a sweep in which at least one ask was
  answered "not cancelled" (always a round trip; a "cancelled" answer may be the stub's cached one)
  releases what was retired before the sweep began.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from batchlm.backend.trtllm.bls_reaper import BlsReaper


class CancellationWatcher:
    def __init__(self, period: float, on_cancelled: Callable[[list[str]], None],
                 name: str = "batchlm-cancel-watch", reaper: BlsReaper | None = None) -> None:
        if period <= 0:
            raise ValueError(f"period must be > 0, got {period}")
        self._period = period
        self._on_cancelled = on_cancelled
        self._reaper = reaper
        # NOTE: held while a sender is asked, so unwatch() waits out an ask in flight (a ~0.1 ms round trip).
        self._lock = threading.Lock()
        self._watched: dict[str, object] = {}  # guarded by _lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, request_id: str, sender) -> None:
        with self._lock:
            self._watched[request_id] = sender

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._watched.pop(request_id, None)

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            mark = self._reaper.mark() if self._reaper is not None else 0
            with self._lock:
                request_ids = list(self._watched)
            cancelled = []
            round_trip = False
            for request_id in request_ids:
                if self._stop.is_set():
                    return
                with self._lock:
                    sender = self._watched.get(request_id)
                    if sender is None:
                        continue
                    answer = _ask_cancelled(sender)
                    round_trip = round_trip or answer is False
                    if not answer:
                        continue
                    del self._watched[request_id]  # reported once
                cancelled.append(request_id)
            if round_trip and self._reaper is not None:
                self._reaper.release(mark)
            if cancelled:
                self._on_cancelled(cancelled)


def _ask_cancelled(sender) -> bool | None:
    """The sender's answer; None if asking failed."""
    try:
        return bool(sender.is_cancelled())
    except Exception:  # noqa: BLE001 - a server going away: the request is failed by the service's close()
        return None
