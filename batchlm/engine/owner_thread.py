"""OwnerThread: one thread that builds an object and then runs a loop with it, both on itself.

Why it matters: torch runs its intra-op work on an OpenMP team that belongs to the thread that first
runs a parallel op. A model built (weights loaded and packed) on one thread and stepped on another gets
a second team; with more OpenMP threads than cores, libgomp stops spinning at its barriers and every
parallel region pays a sleep and a wake-up (`batchlm-bench threads` times a step built on either thread
and counts the context switches). A service whose forward passes run on a worker thread must therefore
build the model on that same worker thread, which this class guarantees.

The constructor returns once the object is built, or raises what building raised; the loop starts
right after the build, on the same thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OwnerThread(Generic[T]):
    def __init__(self, name: str, build: Callable[[], T], loop: Callable[[T], None]) -> None:
        self._build = build
        self._loop = loop
        self._built = threading.Event()
        self._error: BaseException | None = None
        self._value: T | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error

    @property
    def value(self) -> T:
        """What `build` returned."""
        return self._value  # type: ignore[return-value]

    def is_current(self) -> bool:
        """True when called from this thread."""
        return threading.current_thread() is self._thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to return; True if it did within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        try:
            self._value = self._build()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self._error = exc
            return
        finally:
            self._built.set()
        self._loop(self._value)
