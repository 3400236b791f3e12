"""The frontend's own Prometheus metrics, served at `/metrics` on its port: what an OpenAI client sees.

Triton's metrics (port 8002, `batchlm_*`) measure the models from inside; these measure each OpenAI
request from the frontend, as serving benchmarks read them. The names are vLLM's, with this project's
prefix (`vllm:time_to_first_token_seconds` is `batchlm:time_to_first_token_seconds`), labelled by
`model_name`:

    batchlm:request_success_total{finished_reason}   requests answered to their end (`length`, `stop`, ...)
    batchlm:request_failure_total{status}            requests answered with an error status (400, 429, 503, ...)
    batchlm:num_requests_running                     requests between their arrival and their last byte
    batchlm:e2e_request_latency_seconds              arrival to the answer's end
    batchlm:time_to_first_token_seconds              arrival to the first text
    batchlm:time_per_output_token_seconds            (end - first text) / (output tokens - 1), per request
                                                     (its longest choice's tokens, with several choices)
    batchlm:prompt_tokens_total, batchlm:generation_tokens_total

A request whose client left before its answer counts in none of them but `num_requests_running` while it ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: from a cached short answer to a long one on a small CPU
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class FrontendMetrics:
    """The metric families of one frontend app, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name",)
        r = self.registry
        self.success = Counter("batchlm:request_success", "Requests answered to their end.",
                               (*labels, "finished_reason"), registry=r)
        self.failure = Counter("batchlm:request_failure", "Requests answered with an error status.",
                               (*labels, "status"), registry=r)
        self.running = Gauge("batchlm:num_requests_running", "Requests the frontend is answering.", labels,
                             registry=r)
        self.e2e = Histogram("batchlm:e2e_request_latency_seconds", "Arrival to the answer's end.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("batchlm:time_to_first_token_seconds", "Arrival to the first text.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("batchlm:time_per_output_token_seconds",
                              "A request's time per output token after the first.", labels,
                              buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("batchlm:prompt_tokens", "Prompt tokens of the answered requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("batchlm:generation_tokens", "Tokens generated for answered requests.",
                                         labels, registry=r)

    def request(self, model: str) -> RequestTiming:
        """Start timing one request of `model`; it counts as running until its `done`, `failed` or `gone`."""
        self.running.labels(model).inc()
        return RequestTiming(self, model, time.monotonic())


@dataclass
class RequestTiming:
    """One request's clock: `first_text()` when its first text is ready, then exactly one of `done`,
    `failed` or `gone`."""

    metrics: FrontendMetrics
    model: str
    start: float
    first: float | None = None
    _over: bool = field(default=False, repr=False)

    def first_text(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def done(self, finish_reason: str | None, prompt_tokens: int | None, output_tokens: int | None,
             longest_choice: int | None = None) -> None:
        """The answer ended: `output_tokens` of all its choices, the most of them in one choice
        `longest_choice` (None: one choice), whose tokens came one after another."""
        if not self._end():
            return
        m, model, end = self.metrics, self.model, time.monotonic()
        first = self.first if self.first is not None else end
        m.success.labels(model, finish_reason or "none").inc()
        m.e2e.labels(model).observe(end - self.start)
        m.ttft.labels(model).observe(first - self.start)
        sequential = output_tokens if longest_choice is None else longest_choice
        if sequential is not None and sequential > 1:
            m.tpot.labels(model).observe((end - first) / (sequential - 1))
        m.prompt_tokens.labels(model).inc(prompt_tokens or 0)
        m.generation_tokens.labels(model).inc(output_tokens or 0)

    def failed(self, status: int) -> None:
        if self._end():
            self.metrics.failure.labels(self.model, str(status)).inc()

    def gone(self) -> None:
        self._end()

    def _end(self) -> bool:
        if self._over:
            return False
        self._over = True
        self.metrics.running.labels(self.model).dec()
        return True
