"""Continuous batching behind a decoupled Triton model: one engine thread steps per decode iteration.

`submit()` runs on Triton's execute thread and only enqueues; the engine thread owns the LLMEngine (it
builds it, see `batchlm.engine.owner_thread`): each turn it admits new requests, aborts the ones a
`CancellationWatcher` found cancelled, runs one `step()` and sends what it produced.
`close()` stops the thread and fails every request it still holds or that waits with UNAVAILABLE, so
unload and shutdown are prompt and no request is dropped silently.

No request is left unanswered: whatever raises on the engine thread fails only the requests it touches
with INTERNAL (a request that could not be added, every request of a failed step) and the thread goes
on; a failed metrics push or abort is logged and fails nothing. If the thread itself cannot go on, every
request it held and every later one is failed at once with INTERNAL "the engine thread stopped".
`fault_injection` (batchlm.backend.fault_injection) makes each of these happen on purpose.

Deadlines: a request that carries Triton's per-request `timeout` leaves at the first turn past it,
waiting or running, and is answered UNAVAILABLE "request timeout expired" (`_expire`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchlm.engine.engine import LLMEngine
from batchlm.engine.owner_thread import OwnerThread
from batchlm.engine.request_output import RequestOutput
from batchlm.errors import InvalidArgument
from batchlm.backend import triton_io
from batchlm.backend.batching_service import BatchingService, fail_quietly
from batchlm.backend.cancellation_watcher import CancellationWatcher
from batchlm.backend.fault_injection import FaultInjector
from batchlm.backend.metrics import ModelMetrics
from batchlm.backend.triton_io import GenerateRequest
from batchlm.backend.stream_buffer import StreamBuffer


@dataclass
class _Active:
    """A request the engine thread is serving: where to send, what is buffered, when it arrived."""

    request: GenerateRequest
    prompt_ids: list[int]  # tokenized on the submitting thread, not on the engine thread
    sender: object
    arrival: float
    buffer: StreamBuffer
    deadline: float | None = None  # arrival + the request's Triton timeout, if it set one
    first_token_seen: bool = False
    cancelled: bool = False  # the client cancelled, as last checked


class ContinuousBatchingService(BatchingService):
    def __init__(self, build_engine: Callable[[], LLMEngine], metrics: ModelMetrics, max_waiting: int,
                 cancel_check_period: float, stream_interval: int, model_name: str,
                 fault_injection: str = "") -> None:
        """Builds the engine on the engine thread and returns when it is built (or raises).

        A streamed request gets its first text as soon as it exists, then a response once
        `stream_interval` new tokens are buffered, and its final response when it finishes."""
        # NOTE: sender.is_cancelled() is an IPC round trip to the server. Asked for every waiting request at
        # every step it cost a third of the step time; asked on the engine thread once per period, 64
        # requests every 100 ms, still about 5%. A CancellationWatcher asks every request once per
        # `cancel_check_period` seconds from its own thread (streamed ones also stop at once when a
        # send fails).
        super().__init__(model_name, metrics, FaultInjector.parse(fault_injection))
        self._max_waiting = max_waiting
        self._stream_interval = stream_interval
        self._ids = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, _Active]] = []  # guarded by _lock
        self._active: dict[str, _Active] = {}  # owned by the engine thread
        # requests waiting in the engine: its count after the last step, plus the ones taken from the inbox
        # since; guarded by _lock
        self._engine_waiting = 0
        self._cancelled: list[str] = []  # ids the watcher found cancelled, guarded by _lock
        self._watcher = CancellationWatcher(cancel_check_period, self._on_cancelled)
        try:
            self._thread = OwnerThread("batchlm-engine", build_engine, self._run)
        except BaseException:
            self._watcher.close()
            raise
        self._engine: LLMEngine = self._thread.value

    # -- Triton's execute thread ------------------------------------------------------------
    def submit(self, raw_request) -> None:
        """Parse and enqueue one request; errors are answered at once on its response sender."""
        sender = raw_request.get_response_sender()
        arrival = time.monotonic()
        try:
            request = triton_io.parse_request(raw_request)
            # NOTE: tokenized here, on Triton's thread: a long prompt's tokenization never holds up the
            # engine thread's steps, and a request that could never run is refused before it queues
            prompt_ids = triton_io.check_fits(self._engine, request)
            deadline = triton_io.deadline(raw_request, arrival)
        except InvalidArgument as exc:
            triton_io.send_final(sender, triton_io.error_response(exc))
            return
        with self._lock:
            error = self._refusal()
            if error is None and len(self._inbox) + self._engine_waiting >= self._max_waiting:
                error = self._overloaded(self._max_waiting)
            if error is None:
                buffer = StreamBuffer(request.stream, self._stream_interval)
                active = _Active(request, prompt_ids, sender, arrival, buffer, deadline)
                self._inbox.append((f"req-{next(self._ids)}", active))
                self._wake.notify()
        if error is not None:
            triton_io.send_final(sender, triton_io.error_response(error))

    def _drain(self, deadline: float) -> None:
        """Stop the watcher and the engine thread; fail what is still held or waiting with UNAVAILABLE."""
        with self._lock:
            self._wake.notify()
        self._watcher.close(max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            waiting, self._inbox = self._inbox, []
        held = list(self._active.values())
        self._active.clear()
        fail_quietly((active.sender for _, active in waiting), self._unloaded())
        fail_quietly((active.sender for active in held), self._unloaded())

    # -- the watcher's thread ---------------------------------------------------------------
    def _on_cancelled(self, request_ids: list[str]) -> None:
        with self._lock:
            self._cancelled.extend(request_ids)
            self._wake.notify()

    # -- the engine thread ------------------------------------------------------------------
    def _run(self, engine: LLMEngine) -> None:
        self._engine = engine
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread cannot go on: answer everyone, refuse the rest
            self._fail_all(self._stop_serving(exc))

    def _serve(self) -> None:
        while True:
            self._faults.hit("loop")  # NOTE: between turns: every request is then in _active or the inbox
            if not self._engine.has_unfinished():
                self._record_idle()  # NOTE: also publishes the KV pool from the load on, before any request
            with self._lock:
                while not self._closed and not self._inbox and not self._engine.has_unfinished():
                    self._wake.wait()
                if self._closed:
                    return
                incoming, self._inbox = self._inbox, []
                # NOTE: they wait in the engine from now on: count them there until the step's count
                # replaces this one, or submit() would see them nowhere and admit up to max_waiting more.
                self._engine_waiting += len(incoming)
                cancelled, self._cancelled = self._cancelled, []
            self._admit(incoming)
            self._abort(cancelled)
            self._expire()
            try:
                if self._engine.has_unfinished():
                    self._step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep the server serving
                self._fail_all(exc)
            self._record_queue()

    def _admit(self, incoming: list[tuple[str, _Active]]) -> None:
        for request_id, active in incoming:
            try:
                self._faults.hit("admit")
                self._engine.add_request(request_id, active.prompt_ids, active.request.params)
            except Exception as exc:  # noqa: BLE001 - InvalidArgument, or a fault: this request alone fails
                if not isinstance(exc, InvalidArgument):
                    triton_io.log_error(f"adding a request to the engine failed: {exc!r}")
                triton_io.send_final_quietly(active.sender, triton_io.error_response(exc))
                continue
            self._active[request_id] = active
            self._watcher.watch(request_id, active.sender)

    def _abort(self, cancelled: list[str]) -> None:
        """Abort what the watcher found cancelled: a cancelled request keeps its batch slot and KV
        blocks for at most one check period plus one step."""
        for request_id in cancelled:
            active = self._active.get(request_id)
            if active is not None and not active.cancelled:
                active.cancelled = True  # NOTE: if the abort fails, it runs on and nothing more is sent
                try:
                    self._faults.hit("abort")
                    self._engine.abort_request(request_id)
                except Exception as exc:  # noqa: BLE001 - the request runs to its end unanswered to
                    triton_io.log_error(f"aborting {request_id} failed: {exc!r}")

    def _expire(self) -> None:
        """Requests whose timeout passed leave now, waiting or running: aborted in the engine (their KV
        freed, their batch place given back) and answered UNAVAILABLE "request timeout expired"."""
        now = time.monotonic()
        for request_id, active in list(self._active.items()):
            if active.deadline is None or now < active.deadline:
                continue
            del self._active[request_id]
            try:
                self._faults.hit("abort")
                self._engine.abort_request(request_id)
            except Exception as exc:  # noqa: BLE001 - it is answered all the same; its output is ignored
                triton_io.log_error(f"aborting {request_id} failed: {exc!r}")
            self._watcher.unwatch(request_id)  # before the final send: Triton then frees the sender
            response = None if active.cancelled else triton_io.error_response(
                triton_io.timed_out(self._name, now - active.arrival))
            triton_io.send_final_quietly(active.sender, response)

    def _step(self) -> None:
        self._faults.hit("step")
        outputs = self._engine.step()
        stats = self._engine.stats()
        now = time.monotonic()
        new_tokens = 0
        for out in outputs:
            new_tokens += len(out.token_ids)
            active = self._active.get(out.request_id)
            if active is not None:
                self._deliver(out, active, now)
        self._record(self._metrics.record_step, stats.last_num_seqs, new_tokens)
        self._record_prefix_cache(stats)

    def _queue_snapshot(self) -> tuple[int, int, int, int]:
        """Also replaces the engine's waiting count kept since the inbox was taken (see `_serve`) by
        the engine's own; called on the engine thread alone."""
        stats = self._engine.stats()
        self._engine_waiting = stats.num_waiting
        return stats.num_waiting + len(self._inbox), stats.num_running, stats.kv_blocks_used, stats.kv_blocks_total

    def _fail_all(self, exc: BaseException) -> None:
        triton_io.log_error(f"engine step failed, failing {len(self._active)} requests: {exc!r}")
        for request_id, active in list(self._active.items()):
            try:
                self._engine.abort_request(request_id)
            except Exception as abort_exc:  # noqa: BLE001 - it is answered below all the same
                triton_io.log_error(f"aborting {request_id} failed: {abort_exc!r}")
            self._watcher.unwatch(request_id)
            triton_io.send_final_quietly(active.sender, triton_io.error_response(exc))
        self._active.clear()

    def _take_waiting(self) -> list:
        """The inbox's requests (the caller holds _lock)."""
        waiting, self._inbox = self._inbox, []
        return [active.sender for _, active in waiting]

    def _deliver(self, out: RequestOutput, active: _Active, now: float) -> None:
        if out.token_ids and not active.first_token_seen:
            active.first_token_seen = True
            self._record(self._metrics.record_first_token, now - active.arrival)
        if out.finished:
            del self._active[out.request_id]
            self._watcher.unwatch(out.request_id)  # before the final send: Triton then frees the sender
        if active.cancelled:
            if out.finished:
                triton_io.send_final_quietly(active.sender, None)
            return
        due = active.buffer.take(out)
        if due is None:
            return
        response = triton_io.output_response(due, batched=False)
        if out.finished:  # quietly: a client gone at its last token must not fail the batch
            triton_io.send_final_quietly(active.sender, response)
        elif not triton_io.send_quietly(active.sender, response):
            active.cancelled = True
            self._engine.abort_request(out.request_id)

