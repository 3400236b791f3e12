"""Hold stop signals back while a process is started or stopped, then deliver them.

A SIGINT or SIGTERM that lands between `subprocess.Popen` starting tritonserver and the caller keeping
its handle, or in the middle of a stop, would leave stubs, shared-memory regions or instance claims
behind. Inside `DeferredSignals()` such a signal is only recorded; on leaving, the handlers in force
before are back and each recorded signal is sent again, so it takes effect right after the critical
section. Python runs signal handlers in the main thread only: elsewhere this does nothing.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class DeferredSignals:
    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self._signals = signals
        self._previous: dict[int, object] = {}
        self._caught: list[int] = []

    def __enter__(self) -> "DeferredSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if signum not in self._caught:
            self._caught.append(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        caught, self._caught = self._caught, []
        for signum in caught:
            os.kill(os.getpid(), signum)  # NOTE: its handler runs at the next bytecode of this thread
