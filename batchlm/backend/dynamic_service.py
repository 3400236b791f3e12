"""Dynamic batching behind a plain (not decoupled) Triton model.

Triton's dynamic batcher decides which requests form a batch (full, or the oldest waited
`max_queue_delay_microseconds`); `execute()` runs that batch to completion, so each request in it is
answered when the longest one finishes. Invalid requests are answered with an error in place and do not
disturb the others. A request whose client cancelled is asked every `cancel_check_period` seconds
(`batchlm.backend.cancel_poll`); it leaves the batch and is answered CANCELLED, so a batch whose
clients all went away does not hold up the next one.

Deadlines: Triton's queue answers a request whose per-request `timeout` passes while it waits
(`default_queue_policy { timeout_action: REJECT allow_timeout_override: true }` in config.pbtxt). Once
its batch runs, the same timeout, counted from the batch's start (the model is not told when Triton
queued it), takes a row out of the batch like a cancellation, answered UNAVAILABLE "request timeout
expired".

No request is left unanswered, and a fault fails only the requests it touches, with INTERNAL: a request
that cannot be read or admitted fails alone; a batch whose run fails (a forward step, or anything else)
is answered as a whole, and the next batch runs as usual; a failed metrics push is logged and fails
nothing. Whatever escapes the batch's run, even a BaseException, is caught at `execute()`'s edge: every
request of the batch not yet answered gets INTERNAL, and the model serves on: the generator leaves its
engine idle after any failure. (Should one escape with the engine not idle, this and every later request
fail at once with INTERNAL "the engine was left mid-batch ...; reload the model".) `fault_injection`
(batchlm.backend.fault_injection: `admit`, `step`, `metrics`, and `loop`, the N-th batch's run raising a
BaseException) makes each of these happen on purpose.
"""

from __future__ import annotations

import time

from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.sequence import FinishReason
from batchlm.errors import InvalidArgument
from batchlm.backend import triton_io
from batchlm.backend.batching_service import BatchingService
from batchlm.backend.cancel_poll import CancelPoll, leave_check
from batchlm.backend.fault_injection import REQUEST_LEVEL_POINTS, FaultInjector
from batchlm.backend.metrics import ModelMetrics


class DynamicBatchingService(BatchingService):
    """Triton calls `execute` one batch at a time (one instance, one stub thread): nothing here is shared
    between threads. It has no thread of its own and holds nothing between calls, so `close` has nothing
    to drain."""

    def __init__(self, generator: BatchGenerator, metrics: ModelMetrics, model_name: str,
                 cancel_check_period: float = 0.1, fault_injection: str = "") -> None:
        """Raises InvalidArgument("fault_injection") for a plan naming a point this model does not have."""
        super().__init__(model_name, metrics, FaultInjector.parse(fault_injection, points=REQUEST_LEVEL_POINTS))
        self._generator = generator
        self._cancel_check_period = cancel_check_period
        self._running = 0  # rows in the forward pass of the batch being run, for metrics only
        self._record_idle()  # the KV pool from the load on

    def execute(self, raw_requests: list) -> list:
        """One response per request, in order; never raises."""
        with self._lock:
            refusal = self._refusal()
        if refusal is not None:
            return [triton_io.error_response(refusal) for _ in raw_requests]
        responses: list = [None] * len(raw_requests)
        try:
            self._execute(raw_requests, responses)
        except BaseException as exc:  # noqa: BLE001 - even a BaseException: this batch fails, not the model
            self._fail_unanswered(responses, exc)
        return responses

    def _execute(self, raw_requests: list, responses: list) -> None:
        batch: list[tuple[int, object, object, float | None]] = []
        start = time.monotonic()
        for i, raw in enumerate(raw_requests):
            try:
                request = triton_io.parse_request_level(raw, self._generator, self._name)
                deadline = triton_io.deadline(raw, start)
                self._faults.hit("admit")
            except Exception as exc:  # noqa: BLE001 - InvalidArgument, or a fault: this request alone fails
                if not isinstance(exc, InvalidArgument):
                    triton_io.log_error(f"{self._name}: admitting a request failed: {exc!r}")
                responses[i] = triton_io.error_response(exc)
                continue
            batch.append((i, request, raw, deadline))
        if batch:
            self._faults.hit("loop")
            self._run(batch, responses, start)

    def _run(self, batch: list, responses: list, start: float) -> None:
        self._running = len(batch)
        self._record_queue()
        try:
            poll = CancelPoll([leave_check(raw.is_cancelled, deadline) for _, _, raw, deadline in batch],
                              self._cancel_check_period)
            outputs = self._generator.generate([(r.prompt, r.params) for _, r, _, _ in batch],
                                               on_step=self._on_step, cancelled_rows=poll.poll)
        except Exception as exc:  # noqa: BLE001 - answer every request of the batch, keep serving
            triton_io.log_error(f"{self._name}: batch failed: {exc!r}")
            for i, _, _, _ in batch:
                responses[i] = triton_io.error_response(exc)
            return
        finally:
            self._running = 0
            self._record_idle()
        now = time.monotonic()
        for (i, _, _, deadline), out in zip(batch, outputs):
            try:
                responses[i] = (triton_io.left_batch_response(self._name, deadline, start, now)
                                if out.finish_reason is FinishReason.CANCELLED
                                else triton_io.output_response(out, batched=True))
            except Exception as exc:  # noqa: BLE001 - this row alone fails; the others are answered
                triton_io.log_error(f"{self._name}: answering a request failed: {exc!r}")
                responses[i] = triton_io.error_response(exc)

    def _on_step(self, num_sequences: int, new_tokens: int) -> None:
        self._faults.hit("step")  # NOTE: raised as the step returns: the batch's rows are aborted, it fails
        self._record(self._metrics.record_step, num_sequences, new_tokens)
        self._record_prefix_cache(self._generator.engine.stats())
        self._running = num_sequences
        self._record_queue()

    def _queue_snapshot(self) -> tuple[int, int, int, int]:
        return (0, self._running, *self._generator.kv_usage())  # Triton's queue holds the waiting ones

    def _fail_unanswered(self, responses: list, exc: BaseException) -> None:
        """Answer INTERNAL every request of the batch that has no response yet. If the engine was left
        with work (a failure its generate could not clean up after), it cannot run another batch: this
        and every later request fail at once, saying to reload the model."""
        triton_io.log_error(f"{self._name}: the batch's run raised, failing its unanswered requests: {exc!r}")
        try:
            left_busy = self._generator.engine.has_unfinished()
        except Exception:  # noqa: BLE001 - an engine that cannot say is not trusted with another batch
            left_busy = True
        if left_busy:
            exc = self._stop_serving(exc, "the engine was left mid-batch")
        for i, response in enumerate(responses):
            if response is None:
                responses[i] = triton_io.error_response(exc)
