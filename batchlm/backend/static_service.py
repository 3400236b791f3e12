"""Static batching behind a Triton model that is not decoupled: hold requests until a full batch is waiting.

`submit()` (Triton's execute thread) parks each request with its response sender and returns; when
`batch_size` are parked, they go to the worker thread as one batch, which runs to completion and answers
every request when the slowest is done. Every request gets exactly one response, then the final flag
(Triton's rule for a model that is not decoupled; a cancelled one gets CANCELLED).
The worker thread also builds the generator (see `batchlm.engine.owner_thread`).
There is no timer by default: an incomplete batch waits, which is what static batching is. With
`max_wait` > 0 (`max_wait_ms`, a departure from pure static batching) the watchdog releases an
incomplete batch once its oldest request has waited that long.

Deadlines: a request that carries Triton's per-request `timeout` and is still parked when it passes is
answered UNAVAILABLE "request timeout expired" by the watchdog; a row of a running batch whose timeout
passes leaves the batch like a cancelled one and gets the same answer when the batch ends.

Unload and shutdown: Triton unloads a model only once every response sender it handed out is done,
and it never tells the model that it wants to. So a watchdog asks Triton whether this model is still
ready; once it is not (unload requested, or the server is exiting), parked requests are answered with
UNAVAILABLE, which lets the unload proceed. A reload leaves the model ready (its successor is), so the
watchdog also asks `is_superseded` (`batchlm.backend.instance_claim`), and fails parked requests the
same way once a successor instance holds this one's name. `close()` (from finalize) lets a running
batch finish.

Cancellation: a parked request whose client cancelled is answered CANCELLED by the watchdog; a row of
a running batch is asked every `cancel_check_period` seconds (`batchlm.backend.cancel_poll`) and, once
cancelled, leaves the batch and is answered CANCELLED when the batch ends. A batch whose clients all
went away ends within a period and a step.

No request is left unanswered: whatever raises fails only the requests it touches, with INTERNAL, and the
model goes on serving. A request that cannot be parked is answered at once; a batch whose run fails
(a forward step, or anything else) is answered as a whole, row by row if its answers had begun; a
failed metrics push is logged and fails nothing; a failed watchdog check is logged and the watchdog
looks again. If the worker thread itself cannot go on (a BaseException), the batch it held, every
parked or queued request and every later one is failed at once with INTERNAL "the engine thread
stopped ...; reload the model". `fault_injection` (batchlm.backend.fault_injection: `admit` in
`submit`, `step`, `metrics`, `loop`) makes each of these happen on purpose.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.owner_thread import OwnerThread
from batchlm.engine.sequence import FinishReason
from batchlm.errors import InvalidArgument, Unavailable
from batchlm.backend import triton_io
from batchlm.backend.batching_service import BatchingService, EngineStopped, fail_quietly
from batchlm.backend.cancel_poll import CancelPoll, leave_check
from batchlm.backend.fault_injection import REQUEST_LEVEL_POINTS, FaultInjector
from batchlm.backend.metrics import ModelMetrics
from batchlm.backend.triton_io import GenerateRequest

_STOP = object()


@dataclass(frozen=True)
class _Parked:
    """A request waiting for its batch, with where to answer it."""

    request: GenerateRequest
    sender: object
    arrival: float
    deadline: float | None  # arrival + its Triton timeout, if it set one

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class StaticBatchingService(BatchingService):
    _close_timeout = 60.0  # a running batch finishes first

    def __init__(self, build_generator: Callable[[], BatchGenerator], metrics: ModelMetrics, batch_size: int,
                 max_waiting: int, model_name: str, is_ready: Callable[[], bool] | None = None,
                 watch_interval: float = 0.5, is_superseded: Callable[[], bool] = lambda: False,
                 cancel_check_period: float = 0.1, max_wait: float = 0.0, fault_injection: str = "") -> None:
        """Builds the generator on the worker thread and returns when it is built (or raises).

        Raises InvalidArgument("max_waiting") if `max_waiting` < `batch_size`: no batch could ever fill;
        InvalidArgument("fault_injection") for a plan naming a point this model does not have."""
        if max_waiting < batch_size:
            raise InvalidArgument("max_waiting", f"{max_waiting} is below batch_size={batch_size}: requests "
                                                 "past it are refused, so no batch could ever fill")
        super().__init__(model_name, metrics, FaultInjector.parse(fault_injection, points=REQUEST_LEVEL_POINTS))
        self._cancel_check_period = cancel_check_period
        self._batch_size = batch_size
        self._max_waiting = max_waiting
        self._max_wait = max_wait  # seconds; 0: an incomplete batch waits for ever
        self._parked: list[_Parked] = []  # guarded by _lock
        self._batches: queue.Queue = queue.Queue()
        self._running = 0  # rows in the batch being run, for metrics only; guarded by _lock
        self._worker = OwnerThread("batchlm-static", build_generator, self._run)
        self._generator: BatchGenerator = self._worker.value
        self._stop_watch = threading.Event()
        self._poke = threading.Event()  # a request was parked or the service closes: the watchdog looks now
        self._watcher: threading.Thread | None = None
        if is_ready is not None:
            self._watcher = threading.Thread(target=self._watch, args=(is_ready, is_superseded, watch_interval),
                                             name="batchlm-static-watch", daemon=True)
            self._watcher.start()

    def submit(self, raw_request) -> None:
        """Park one request, and release a batch when `batch_size` are parked. A request that cannot be
        parked (bad input, overload, unloading, a stopped worker, a fault) is answered at once."""
        sender = raw_request.get_response_sender()
        try:
            self._park(raw_request, sender)
        except Exception as exc:  # noqa: BLE001 - never parked: this request alone is answered, here
            if not isinstance(exc, (InvalidArgument, Unavailable, EngineStopped)):
                triton_io.log_error(f"{self._name}: parking a request failed: {exc!r}")
            triton_io.send_final_quietly(sender, triton_io.error_response(exc))
        self._record_queue()

    def _park(self, raw_request, sender) -> None:
        arrival = time.monotonic()
        request = triton_io.parse_request_level(raw_request, self._generator, self._name)
        deadline = triton_io.deadline(raw_request, arrival)
        self._faults.hit("admit")
        self._drop_cancelled()
        with self._lock:
            if (refusal := self._refusal()) is not None:
                raise refusal
            if self._waiting() >= self._max_waiting:
                raise self._overloaded(self._max_waiting)
            self._parked.append(_Parked(request, sender, arrival, deadline))
            if len(self._parked) >= self._batch_size:
                batch, self._parked = self._parked[: self._batch_size], self._parked[self._batch_size:]
                self._batches.put(batch)
            if self._parked and (self._max_wait or deadline is not None):
                self._poke.set()  # the watchdog's next look may be due sooner than its interval

    def _drain(self, deadline: float) -> None:
        """Fail parked requests, let a running batch finish, stop the threads.

        Returns only once the watchdog has stopped too: its checks are calls to the server, and one
        still in flight when `finalize` returns makes tritonserver abort (boost lock_exception) as the
        stub is torn down."""
        self._stop_watch.set()
        self._poke.set()
        if self._watcher is not None:
            self._watcher.join(max(0.0, deadline - time.monotonic()))
        self._fail_parked()
        self._batches.put(_STOP)
        self._worker.join(max(0.0, deadline - time.monotonic()))

    def _fail_parked(self, what: str = "unloaded") -> None:
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, []
        fail_quietly((entry.sender for entry in parked),
                     Unavailable(f"{self._name} was {what} before a full batch of {self._batch_size} requests arrived"))

    def _drop_cancelled(self) -> None:
        """Close the parked requests whose clients cancelled. Each gets its one response (CANCELLED)
        and final flag: Triton counts a request in flight (and will not unload the model) until its
        sender is closed."""
        with self._lock:
            parked = list(self._parked)
        # is_cancelled() is a round trip to the server: asked outside the lock, so the worker's metrics
        # and other submits do not wait on it.
        cancelled = [entry.sender for entry in parked if _asks_cancelled(entry.sender)]
        if not cancelled:
            return
        with self._lock:  # only those still parked: a batch or an unload may have taken some meanwhile
            ids = {id(sender) for sender in cancelled}
            removed = [e for e in self._parked if id(e.sender) in ids]
            self._parked = [e for e in self._parked if id(e.sender) not in ids]
        for entry in removed:
            triton_io.send_final_quietly(entry.sender, triton_io.cancelled_response(self._name))
        if removed:  # NOTE: pushed now: with nothing left parked the watchdog flushes nothing more
            self._record_queue()
            self._record(self._metrics.flush)

    def _expire_and_release(self) -> None:
        """Answer the parked requests whose timeout passed (UNAVAILABLE), and release an incomplete batch
        whose oldest request has waited `max_wait`."""
        now = time.monotonic()
        with self._lock:
            expired = [e for e in self._parked if e.expired(now)]
            self._parked = [e for e in self._parked if not e.expired(now)]
            if self._max_wait and self._parked and now - self._parked[0].arrival >= self._max_wait:
                self._batches.put(self._parked)
                self._parked = []
        for entry in expired:
            triton_io.send_final_quietly(entry.sender, triton_io.error_response(
                triton_io.timed_out(self._name, now - entry.arrival)))
        if expired:
            self._record_queue()
            self._record(self._metrics.flush)

    def _next_look(self, interval: float) -> float:
        """Seconds until the watchdog must look again: `interval`, or sooner if a parked request's
        timeout or the oldest's `max_wait` comes first."""
        now = time.monotonic()
        with self._lock:
            due = [e.deadline for e in self._parked if e.deadline is not None]
            if self._max_wait and self._parked:
                due.append(self._parked[0].arrival + self._max_wait)
        return max(0.0, min([interval, *(t - now for t in due)]))

    def _watch(self, is_ready: Callable[[], bool], is_superseded: Callable[[], bool], interval: float) -> None:
        """Every `interval` while requests are parked: close those whose clients cancelled, and fail the
        others once Triton stops reporting this model ready, or once a successor instance was loaded
        (a reload; new requests go to it). The model is not ready while it loads, but no request is
        parked then (Triton sends requests only to a ready model), so not ready with requests parked
        always means an unload or a shutdown, even one that began before any check had seen the model
        ready (an unload within one `interval` of the first requests ever parked).

        With nothing parked it asks nothing. Triton finalizes the instance only after every sender is
        closed, so a check can overlap finalize only while nothing is parked; one that overlaps it makes
        tritonserver abort at shutdown (boost lock_exception in TRITONBACKEND_ModelInstanceFinalize)."""
        while True:
            try:
                if self._look(is_ready, is_superseded, interval):
                    return
            except Exception as exc:  # noqa: BLE001 - a failed check fails no request: look again next time
                triton_io.log_error(f"{self._name}: the watchdog's check failed: {exc!r}")
                self._stop_watch.wait(interval)

    def _look(self, is_ready: Callable[[], bool], is_superseded: Callable[[], bool], interval: float) -> bool:
        """One look of the watchdog, once its interval or a poke says so; True when it is done for good."""
        self._poke.wait(self._next_look(interval))
        self._poke.clear()
        if self._stop_watch.is_set():
            return True
        self._expire_and_release()
        with self._lock:
            idle = not self._parked
        if idle:  # nothing to close or fail; and no call to the server that could overlap finalize
            return False
        # Metrics are buffered (ModelMetrics): with requests parked and nothing else recorded,
        # push the waiting count now, or it reads the first of a burst until the next request
        self._metrics.flush()
        self._drop_cancelled()
        if is_superseded():
            self._fail_parked("reloaded")
            return True
        try:
            ready = is_ready()
        except Exception as exc:  # noqa: BLE001 - the server is going away; treat as not ready
            triton_io.log_verbose(f"{self._name}: readiness check failed: {exc!r}")
            ready = False
        if not ready:
            self._fail_parked()
            return True
        return False

    def _run(self, generator: BatchGenerator) -> None:
        self._generator = generator
        self._record_idle()  # the KV pool from the load on, before any request
        held: list[_Parked] = []
        try:
            while (batch := self._batches.get()) is not _STOP:
                held = batch
                self._faults.hit("loop")
                try:
                    self._run_batch(batch)
                except Exception as exc:  # noqa: BLE001 - whatever escaped _run_batch's own guards: answer
                    # the batch (a row already answered just logs a failed send), keep the worker
                    triton_io.log_error(f"{self._name}: batch failed outside its guards: {exc!r}")
                    fail_quietly((entry.sender for entry in batch), exc)
                held = []
        except BaseException as exc:  # noqa: BLE001 - the thread cannot go on: answer everyone, refuse the rest
            fail_quietly((entry.sender for entry in held), self._stop_serving(exc))
            self._record_queue()

    def _take_waiting(self) -> list:
        """The parked requests and the full batches queued behind the held one (the caller holds _lock)."""
        self._running = 0
        waiting, self._parked = self._parked, []
        while not self._batches.empty():
            queued = self._batches.get_nowait()
            waiting += [] if queued is _STOP else queued
        return [entry.sender for entry in waiting]

    def _run_batch(self, batch: list[_Parked]) -> None:
        with self._lock:
            self._running = len(batch)
        start = time.monotonic()
        try:
            poll = CancelPoll([leave_check(e.sender.is_cancelled, e.deadline) for e in batch],
                              self._cancel_check_period)
            outputs = self._generator.generate(
                [(e.request.prompt, e.request.params) for e in batch], on_step=self._on_step, cancelled_rows=poll.poll)
        except Exception as exc:  # noqa: BLE001 - answer every request of the batch, keep serving
            triton_io.log_error(f"{self._name}: batch failed: {exc!r}")
            fail_quietly((entry.sender for entry in batch), exc)
            return
        finally:
            with self._lock:
                self._running = 0
            self._record_idle()
        now = time.monotonic()
        for entry, out in zip(batch, outputs):
            try:
                response = self._answer(entry, out, now)
            except Exception as exc:  # noqa: BLE001 - this row alone fails; the others are answered
                triton_io.log_error(f"{self._name}: answering a request failed: {exc!r}")
                response = triton_io.error_response(exc)
            triton_io.send_final_quietly(entry.sender, response)
        triton_io.log_verbose(f"{self._name}: batch of {len(batch)} in {time.monotonic() - start:.2f}s")

    def _answer(self, entry: _Parked, out, now: float):
        if out.finish_reason is FinishReason.CANCELLED:
            return triton_io.left_batch_response(self._name, entry.deadline, entry.arrival, now)
        if entry.sender.is_cancelled():
            return triton_io.cancelled_response(self._name)
        return triton_io.output_response(out, batched=False)

    def _on_step(self, num_sequences: int, new_tokens: int) -> None:
        self._faults.hit("step")  # NOTE: raised as the step returns: the batch's rows are aborted, it fails
        self._record(self._metrics.record_step, num_sequences, new_tokens)
        self._record_prefix_cache(self._generator.engine.stats())
        self._record_queue()

    def _waiting(self) -> int:
        """Requests parked or in full batches behind the running one; the caller holds _lock."""
        return len(self._parked) + self._batches.qsize() * self._batch_size

    def _queue_snapshot(self) -> tuple[int, int, int, int]:
        return (self._waiting(), self._running, *self._generator.kv_usage())


def _asks_cancelled(sender) -> bool:
    """`sender.is_cancelled()`; a question that raises counts as "not cancelled" (as in CancelPoll)."""
    try:
        return sender.is_cancelled()
    except Exception as exc:  # noqa: BLE001 - the server is going away: the request is failed by other means
        triton_io.log_verbose(f"asking whether a request was cancelled failed: {exc!r}")
        return False
