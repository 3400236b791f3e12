"""Prometheus metrics every model publishes through the Python backend's metrics API.

All families carry the label `model`, and `instance` (Triton's `model_instance_name`, e.g.
`dynamic_batching_0_1`) where the model passes it: every instance is its own process with its own
engine, so each publishes its own series, and a model's value is the sum over its instances (a gauge
set by two instances under one label set would hold whichever wrote last). Triton serves them on its
metrics port next to its own `nv_inference_*` families. Names are shared by the three strategies so one
query compares them.

Each metric update is a message from the backend stub to the server, so updates are buffered here and
pushed at most every `min_interval` seconds (and at once when the model goes idle): the engine thread
steps every few milliseconds and must not pay a round trip per counter per step.
"""

from __future__ import annotations

import threading
import time

import triton_python_backend_utils as pb_utils

_GAUGES = {
    "forward_sequences": ("batchlm_forward_sequences", "Sequences in the most recent forward pass"),
    "waiting": ("batchlm_waiting_requests", "Requests accepted but not yet running"),
    "running": ("batchlm_running_requests", "Requests whose sequences are in the running batch"),
    "kv_used": ("batchlm_kv_blocks_used", "KV-cache blocks allocated to sequences"),
    "kv_total": ("batchlm_kv_blocks_total", "KV-cache blocks in the preallocated pool"),
    "kv_cached": ("batchlm_kv_blocks_cached", "KV-cache blocks findable by their tokens (prefix caching), "
                                              "held by requests or not"),
    "up": ("batchlm_serving_up", "1 while the instance's serving thread runs; 0 once it has stopped and every "
                                 "request fails until the model is reloaded"),
}
_COUNTERS = {
    "forward_passes": ("batchlm_forward_passes_total", "Forward passes run"),
    "forward_sequences_total": ("batchlm_forward_sequences_total",
                                "Sum over forward passes of the sequences in each"),
    "generated_tokens": ("batchlm_generated_tokens_total", "Output tokens generated"),
    "ttft_sum": ("batchlm_time_to_first_token_seconds_sum", "Sum of times to first token"),
    "ttft_count": ("batchlm_time_to_first_token_seconds_count", "Requests that received a first token"),
    "prefix_queries": ("batchlm_prefix_cache_queries_total", "Prompt tokens of admitted requests, looked up in "
                                                             "the prefix cache"),
    "prefix_hits": ("batchlm_prefix_cache_hits_total", "Prompt tokens whose KV came from the prefix cache"),
    "prefix_evictions": ("batchlm_prefix_cache_evictions_total", "Cached KV blocks taken back for new tokens"),
}


class ModelMetrics:
    """The metrics of one model instance. Thread-safe: any thread may record."""

    def __init__(self, model_name: str, instance: str | None = None, min_interval: float = 0.1) -> None:
        labels = {"model": model_name} if instance is None else {"model": model_name, "instance": instance}
        # NOTE: a MetricFamily must outlive its Metrics, so the families are kept here.
        self._families = []
        self._metrics = {}
        for kind, table in ((pb_utils.MetricFamily.GAUGE, _GAUGES), (pb_utils.MetricFamily.COUNTER, _COUNTERS)):
            for key, (name, description) in table.items():
                family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
                self._families.append(family)
                self._metrics[key] = family.Metric(labels=labels)
        self._lock = threading.Lock()
        # NOTE: pb_utils metric calls are made by one thread at a time (a model may record from many)
        self._flush_lock = threading.Lock()
        self._gauges: dict[str, float] = {}  # pending gauge values, guarded by _lock
        self._deltas: dict[str, float] = {key: 0.0 for key in _COUNTERS}  # pending counter increments
        self._prefix_totals: dict[str, int] = {}  # the engine's prefix-cache totals at the last record
        self._pushed: dict[str, float] = {}  # gauge values the server has, to skip unchanged ones
        self._min_interval = min_interval
        self._last_flush = 0.0
        self._metrics["up"].set(1)

    def record_stopped(self) -> None:
        """The serving thread cannot go on: `batchlm_serving_up` reads 0 (pushed at once)."""
        with self._lock:
            self._gauges["up"] = 0
        self.flush()

    def record_step(self, num_sequences: int, new_tokens: int) -> None:
        with self._lock:
            self._gauges["forward_sequences"] = num_sequences
            self._deltas["forward_passes"] += 1
            self._deltas["forward_sequences_total"] += num_sequences
            self._deltas["generated_tokens"] += new_tokens
        self.flush_if_due()

    def record_queue(self, waiting: int, running: int, kv_used: int, kv_total: int) -> None:
        self.set_queue(waiting, running, kv_used, kv_total)
        self.flush_if_due()

    def set_queue(self, waiting: int, running: int, kv_used: int, kv_total: int) -> None:
        """As record_queue, but never pushes: cheap enough to call under a caller's lock, so that
        snapshots taken by several threads are set in the order they were taken. `flush_if_due()`
        afterwards, outside that lock."""
        with self._lock:
            self._gauges.update(waiting=waiting, running=running, kv_used=kv_used, kv_total=kv_total)

    def record_prefix_cache(self, queries: int, hits: int, evictions: int, cached_blocks: int) -> None:
        """The engine's prefix-cache totals so far (EngineStats); the counters grow by what is new."""
        with self._lock:
            totals = {"prefix_queries": queries, "prefix_hits": hits, "prefix_evictions": evictions}
            for key, total in totals.items():
                self._deltas[key] += total - self._prefix_totals.get(key, 0)
            self._prefix_totals = totals
            self._gauges["kv_cached"] = cached_blocks
        self.flush_if_due()

    def record_in_flight(self, requests: int) -> None:
        """For a model that runs no forward pass itself (continuous_batching_trtllm): its requests in
        flight (waiting in or running on the engine it fronts) as `running`."""
        with self._lock:
            self._gauges["running"] = requests
        if requests == 0:
            self.flush()  # idle: push everything pending now (as record_idle)
        else:
            self.flush_if_due()

    def record_tokens(self, new_tokens: int) -> None:
        with self._lock:
            self._deltas["generated_tokens"] += new_tokens
        self.flush_if_due()

    def record_first_token(self, seconds: float) -> None:
        with self._lock:
            self._deltas["ttft_sum"] += seconds
            self._deltas["ttft_count"] += 1
        self.flush_if_due()

    def record_idle(self) -> None:
        """Nothing runs now: the last-forward gauge drops to 0 and everything pending is pushed."""
        with self._lock:
            self._gauges["forward_sequences"] = 0
        self.flush()

    def flush(self) -> None:
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            gauges = {k: v for k, v in self._gauges.items() if self._pushed.get(k) != v}
            self._pushed.update(gauges)
            self._gauges = {}
            deltas = {k: v for k, v in self._deltas.items() if v}
            self._deltas = {key: 0.0 for key in _COUNTERS}
            self._last_flush = time.monotonic()
        for key, value in gauges.items():
            self._metrics[key].set(value)
        for key, value in deltas.items():
            self._metrics[key].increment(value)

    def flush_if_due(self) -> None:
        """Push what is pending if `min_interval` has passed since the last push."""
        if time.monotonic() - self._last_flush >= self._min_interval:
            self.flush()
