"""CancellationWatcher: each watched sender asked once per period, cancelled ids reported once, never an
ask after unwatch() returns, close() stops the thread. The real senders are covered by
tests/functional/test_continuous_batching.py."""

import threading
import time

import pytest

from batchlm.backend.cancellation_watcher import CancellationWatcher


class Sender:
    """Stands in for a pb_utils response sender: counts asks; the ask takes `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.cancelled = False
        self.asks = 0
        self.times: list[float] = []  # when each ask came
        self.unwatched = False
        self.asked_after_unwatch = False
        self.delay = delay

    def is_cancelled(self) -> bool:
        self.asks += 1
        self.times.append(time.monotonic())
        if self.unwatched:
            self.asked_after_unwatch = True
        time.sleep(self.delay)
        return self.cancelled


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def test_reports_each_cancelled_request_once():
    reported = []
    watcher = CancellationWatcher(0.01, reported.extend)
    try:
        a, b = Sender(), Sender()
        watcher.watch("a", a)
        watcher.watch("b", b)
        assert wait_for(lambda: a.asks >= 3 and b.asks >= 3)
        assert reported == []
        b.cancelled = True
        assert wait_for(lambda: reported == ["b"])
        asks = b.asks
        time.sleep(0.1)
        assert reported == ["b"] and b.asks == asks  # not asked again once reported
        assert a.asks > asks  # the others still are
    finally:
        watcher.close()


def test_asks_at_most_once_per_period():
    """Checked on the gaps between asks, not on a count in a fixed time, which a loaded machine that
    starves the watcher's thread would make fail (such as 3 to 5 asks in a 1 s sleep)."""
    watcher = CancellationWatcher(0.2, lambda ids: None)
    try:
        s = Sender()
        watcher.watch("s", s)
        assert wait_for(lambda: s.asks >= 4)
    finally:
        watcher.close()
    gaps = [b - a for a, b in zip(s.times, s.times[1:])]
    assert min(gaps) >= 0.2 * 0.95, gaps  # Event.wait may wake a hair early


def test_never_asks_after_unwatch_returns():
    watcher = CancellationWatcher(0.001, lambda ids: None)
    try:
        senders = [Sender(delay=0.001) for _ in range(20)]
        for i, s in enumerate(senders):
            watcher.watch(str(i), s)
        assert wait_for(lambda: all(s.asks for s in senders))
        for i, s in enumerate(senders):
            watcher.unwatch(str(i))
            s.unwatched = True
        time.sleep(0.1)
        assert not any(s.asked_after_unwatch for s in senders)
    finally:
        watcher.close()


def test_unwatch_waits_for_an_ask_in_flight():
    """Triton frees a sender's response factory after its final response: unwatch() must not return
    while the watcher is still using that sender."""
    entered, release = threading.Event(), threading.Event()

    class Slow(Sender):
        def is_cancelled(self):
            entered.set()
            release.wait(5)
            return False

    watcher = CancellationWatcher(0.01, lambda ids: None)
    try:
        watcher.watch("s", Slow())
        assert entered.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (watcher.unwatch("s"), done.set()), daemon=True).start()
        assert not done.wait(0.2), "unwatch returned while the sender was being asked"
        release.set()
        assert done.wait(5)
    finally:
        release.set()
        watcher.close()


def test_close_stops_the_thread_and_a_failing_ask_is_not_cancelled():
    class Broken(Sender):
        def is_cancelled(self):
            super().is_cancelled()
            raise RuntimeError("Cannot communicate with parent service")

    reported = []
    watcher = CancellationWatcher(0.01, reported.extend, name="watch-under-test")
    broken = Broken()
    watcher.watch("x", broken)
    assert wait_for(lambda: broken.asks >= 2)
    watcher.close(timeout=2)
    assert not any(t.name == "watch-under-test" for t in threading.enumerate())
    assert reported == []


def test_period_must_be_positive():
    with pytest.raises(ValueError, match="period"):
        CancellationWatcher(0, lambda ids: None)
