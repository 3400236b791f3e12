"""Dynamic batching behind a plain (not decoupled) Triton model.

Triton's dynamic batcher decides which requests form a batch (full, or the oldest waited
`max_queue_delay_microseconds`); `execute()` runs that batch to completion, so each request in it is
answered when the longest one finishes. Invalid requests are answered with an error in place and do not
disturb the others. A request whose client cancelled is asked every `cancel_check_period` seconds
(`batchlm.serving.cancel_poll`); it leaves the batch and is answered CANCELLED, so a batch whose
clients all went away does not hold up the next one.

Deadlines: Triton's queue answers a request whose per-request `timeout` passes while it waits
(`default_queue_policy { timeout_action: REJECT allow_timeout_override: true }` in config.pbtxt). Once
its batch runs, the same timeout, counted from the batch's start (the model is not told when Triton
queued it), takes a row out of the batch like a cancellation, answered UNAVAILABLE "request timeout
expired".
"""

from __future__ import annotations

import time

from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.sequence import FinishReason
from batchlm.errors import InvalidArgument
from batchlm.serving import triton_io
from batchlm.serving.cancel_poll import CancelPoll, leave_check
from batchlm.serving.metrics import ModelMetrics


class DynamicBatchingService:
    def __init__(self, generator: BatchGenerator, metrics: ModelMetrics, model_name: str,
                 cancel_check_period: float = 0.1) -> None:
        self._generator = generator
        self._metrics = metrics
        self._name = model_name
        self._cancel_check_period = cancel_check_period
        metrics.record_queue(0, 0, *generator.kv_usage())  # the KV pool from the load on, before any request
        metrics.record_idle()

    def execute(self, raw_requests: list) -> list:
        """One response per request, in order."""
        responses: list = [None] * len(raw_requests)
        batch: list[tuple[int, object, object, float | None]] = []
        start = time.monotonic()
        for i, raw in enumerate(raw_requests):
            try:
                request = triton_io.parse_request_level(raw, self._generator, self._name)
                deadline = triton_io.deadline(raw, start)
            except InvalidArgument as exc:
                responses[i] = triton_io.error_response(exc)
                continue
            batch.append((i, request, raw, deadline))
        if batch:
            self._run(batch, responses, start)
        return responses

    def _run(self, batch: list, responses: list, start: float) -> None:
        self._metrics.record_queue(0, len(batch), *self._generator.kv_usage())
        poll = CancelPoll([leave_check(raw.is_cancelled, deadline) for _, _, raw, deadline in batch],
                          self._cancel_check_period)
        try:
            outputs = self._generator.generate([(r.prompt, r.params) for _, r, _, _ in batch],
                                               on_step=self._on_step, cancelled_rows=poll.poll)
        except Exception as exc:  # noqa: BLE001 - answer every request of the batch, keep serving
            triton_io.log_error(f"{self._name}: batch failed: {exc!r}")
            for i, _, _, _ in batch:
                responses[i] = triton_io.error_response(exc)
            return
        finally:
            self._metrics.record_queue(0, 0, *self._generator.kv_usage())
            self._metrics.record_idle()  # NOTE: after the gauges' update, which this flush pushes
        now = time.monotonic()
        for (i, _, _, deadline), out in zip(batch, outputs):
            responses[i] = (triton_io.left_batch_response(self._name, deadline, start, now)
                            if out.finish_reason is FinishReason.CANCELLED
                            else triton_io.output_response(out, out.text, batched=True))

    def _on_step(self, num_sequences: int, new_tokens: int) -> None:
        self._metrics.record_step(num_sequences, new_tokens)
        self._metrics.record_queue(0, num_sequences, *self._generator.kv_usage())
