"""BlsReaper: what was retired before a mark is dropped by release(mark), nothing after it; and the
CancellationWatcher releases only after a sweep whose ask was a round trip (answered "not cancelled").
That a round trip after a call has ended keeps the stub's heap whole is checked on the real server by
tests/functional/test_bls_cleanup.py; the front's use of it is covered by tests/functional/test_trtllm_front.py."""

import gc
import threading
import time
import weakref

from batchlm.backend.cancellation_watcher import CancellationWatcher
from batchlm.backend.trtllm.bls_reaper import BlsReaper


class Finished:
    """Stands in for a finished BLS response iterator."""


def retire_new(reaper: BlsReaper) -> weakref.ref:
    obj = Finished()
    reaper.retire(obj)
    return weakref.ref(obj)


def test_release_drops_only_what_was_retired_before_the_mark():
    reaper = BlsReaper()
    before = [retire_new(reaper) for _ in range(3)]
    mark = reaper.mark()
    after = [retire_new(reaper) for _ in range(2)]
    gc.collect()
    assert all(r() is not None for r in before + after), "retire() must keep its objects alive"
    assert reaper.release(mark) == 3
    assert all(r() is None for r in before)
    assert all(r() is not None for r in after) and len(reaper) == 2
    assert reaper.release(mark) == 0  # an old mark drops nothing more
    assert reaper.release(reaper.mark()) == 2 and len(reaper) == 0


def test_retire_from_many_threads():
    reaper = BlsReaper()
    threads = [threading.Thread(target=lambda: [reaper.retire(Finished()) for _ in range(500)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reaper) == 4000 and reaper.mark() == 4000
    assert reaper.release(reaper.mark()) == 4000


class Sender:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.asks = 0

    def is_cancelled(self) -> bool:
        self.asks += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def test_watcher_releases_after_a_sweep_with_a_round_trip():
    reaper = BlsReaper()
    watcher = CancellationWatcher(0.01, lambda ids: None, reaper=reaper)
    try:
        ref = retire_new(reaper)
        time.sleep(0.1)
        assert ref() is not None, "released with no request watched: no round trip was made"
        sender = Sender(False)
        watcher.watch("a", sender)
        assert wait_for(lambda: ref() is None)
        assert sender.asks >= 1
    finally:
        watcher.close()


def test_watcher_does_not_release_on_a_cancelled_or_failed_answer():
    """A "cancelled" answer may be the stub's cached one, and a failed ask proves nothing: no release."""
    reaper = BlsReaper()
    watcher = CancellationWatcher(0.01, lambda ids: None, reaper=reaper)
    try:
        ref = retire_new(reaper)
        cancelled, broken = Sender(True), Sender(RuntimeError("Cannot communicate with parent service"))
        watcher.watch("c", cancelled)
        watcher.watch("b", broken)
        assert wait_for(lambda: cancelled.asks >= 1 and broken.asks >= 3)
        assert ref() is not None and len(reaper) == 1
    finally:
        watcher.close()
