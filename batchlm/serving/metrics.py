"""Prometheus metrics every model publishes through the Python backend's metrics API.

All families carry the label `model`; Triton serves them on its metrics port next to its own
`nv_inference_*` families. Names are shared by the three strategies so one query compares them.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class ModelMetrics:
    """The metrics of one model instance; call the record_* methods from whichever thread steps."""

    def __init__(self, model_name: str) -> None:
        labels = {"model": model_name}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER

        # NOTE: a MetricFamily must outlive its Metrics, so the families are kept here.
        self._families = []

        def metric(name: str, description: str, kind):
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families.append(family)
            return family.Metric(labels=labels)

        self.forward_sequences = metric(
            "batchlm_forward_sequences", "Sequences in the most recent forward pass", gauge)
        self.forward_passes = metric(
            "batchlm_forward_passes_total", "Forward passes run", counter)
        self.forward_sequences_total = metric(
            "batchlm_forward_sequences_total", "Sum over forward passes of the sequences in each", counter)
        self.waiting = metric(
            "batchlm_waiting_requests", "Requests accepted but not yet running", gauge)
        self.running = metric(
            "batchlm_running_requests", "Requests whose sequences are in the running batch", gauge)
        self.kv_used = metric(
            "batchlm_kv_blocks_used", "KV-cache blocks allocated to sequences", gauge)
        self.kv_total = metric(
            "batchlm_kv_blocks_total", "KV-cache blocks in the preallocated pool", gauge)
        self.generated_tokens = metric(
            "batchlm_generated_tokens_total", "Output tokens generated", counter)
        self.ttft_sum = metric(
            "batchlm_time_to_first_token_seconds_sum", "Sum of times to first token", counter)
        self.ttft_count = metric(
            "batchlm_time_to_first_token_seconds_count", "Requests that received a first token", counter)

    def record_step(self, num_sequences: int, new_tokens: int) -> None:
        self.forward_sequences.set(num_sequences)
        self.forward_passes.increment(1)
        self.forward_sequences_total.increment(num_sequences)
        if new_tokens:
            self.generated_tokens.increment(new_tokens)

    def record_queue(self, waiting: int, running: int, kv_used: int, kv_total: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)

    def record_first_token(self, seconds: float) -> None:
        self.ttft_sum.increment(seconds)
        self.ttft_count.increment(1)

    def record_idle(self) -> None:
        self.forward_sequences.set(0)
