"""Scrapes a model's Prometheus metrics every `interval` seconds during a benchmark run.

Each sample holds the model's gauges (waiting, running, KV blocks) and, from the counters, the mean
number of sequences per forward pass since the previous sample (0 when no forward ran: idle slots)
the output tokens generated since then, and Triton's executions of the model and the requests they
held (their ratio is the batch Triton's dynamic batcher formed). For dynamic_batching the queue is
Triton's own: `nv_inference_pending_request_count`.

`saturated_window` reads a timeline for the server's throughput while it was saturated, i.e. while
requests were waiting for a slot: a closed-loop run ends with a drain (the last requests finish with
fewer in flight than slots), which is not saturation and which costs the strategies unequally.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

FAMILIES = {
    "forward_sequences": "batchlm_forward_sequences",
    "forward_passes": "batchlm_forward_passes_total",
    "forward_sequences_total": "batchlm_forward_sequences_total",
    "generated_tokens": "batchlm_generated_tokens_total",
    "waiting": "batchlm_waiting_requests",
    "running": "batchlm_running_requests",
    "kv_used": "batchlm_kv_blocks_used",
    "kv_total": "batchlm_kv_blocks_total",
    "triton_pending": "nv_inference_pending_request_count",
    "triton_executions": "nv_inference_exec_count",
    "triton_inferences": "nv_inference_count",
}
# The prefix cache's counters (batchlm.backend.metrics): prompt tokens looked up and found, cached
# blocks taken back, and the blocks findable now.
PREFIX_FAMILIES = {
    "queries": "batchlm_prefix_cache_queries_total",
    "hits": "batchlm_prefix_cache_hits_total",
    "evictions": "batchlm_prefix_cache_evictions_total",
    "cached_blocks": "batchlm_kv_blocks_cached",
}


@dataclass(frozen=True)
class MetricsSample:
    t: float                      # seconds from the run's start
    seqs_per_forward: float       # mean sequences per forward pass since the previous sample
    forward_passes: float         # forward passes since the previous sample
    waiting: float                # requests accepted, not yet running (the model's or Triton's queue)
    running: float
    kv_used: float
    kv_total: float
    generated_tokens: float = 0.0  # output tokens the model generated since the previous sample
    executions: float = 0.0        # Triton's executions of the model (execute calls) since the previous sample
    inferences: float = 0.0        # requests those executions held (a batch of 8 counts 8)


def parse_metrics(text: str, model: str, families: dict[str, str] = FAMILIES) -> dict[str, float]:
    """The `families` values for `model` from a Prometheus text page (missing ones are left out), each
    summed over the model's series: one per instance where the model has several (`instance` label)."""
    wanted = {family: key for key, family in families.items()}
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in wanted and f'model="{model}"' in rest:
            key = wanted[name]
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def metrics_problem(metrics_url: str, model: str) -> str | None:
    """Why `metrics_url` gives no timeline of `model` (unreachable, or no such model's metrics), or None."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            values = parse_metrics(r.read().decode(), model)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"no metrics at {metrics_url} ({exc})"
    if "generated_tokens" not in values:
        return f"{metrics_url} has no batchlm metrics of {model}"
    return None


def scrape(metrics_url: str, model: str, families: dict[str, str] = FAMILIES) -> dict[str, float] | None:
    """parse_metrics of one read of `metrics_url`; None when it cannot be read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as r:
            return parse_metrics(r.read().decode(), model, families)
    except (urllib.error.URLError, OSError):
        return None


def settled_scrape(metrics_url: str, model: str, families: dict[str, str] = FAMILIES, settle: float = 0.05,
                   timeout: float = 2.0) -> dict[str, float] | None:
    """A scrape that two reads `settle` seconds apart agree on (the last read after `timeout` seconds):
    the models push their counters in batches (batchlm.backend.metrics), so the work of a request
    answered just before can reach the page a moment later."""
    deadline = time.monotonic() + timeout
    previous = scrape(metrics_url, model, families)
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = scrape(metrics_url, model, families)
        if now == previous:
            return now
        previous = now
    return previous


class MetricsTimeline:
    """Use as a context manager around a run; `samples` holds the timeline afterwards.

    Entering scrapes a baseline before the run sends anything, and exiting takes a closing sample, so
    the samples' counter deltas add up to the whole run, even one shorter than `interval`. The baseline
    is a settled one (`settled_scrape`), so the work of a request answered just before (the benchmark's
    streaming probe) is not counted in the run.
    """

    settle = 0.05
    settle_timeout = 2.0

    def __init__(self, metrics_url: str, model: str, interval: float = 0.25) -> None:
        self.metrics_url = metrics_url
        self.model = model
        self.interval = interval
        self.samples: list[MetricsSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-timeline", daemon=True)
        self._start = 0.0
        self._previous: dict[str, float] | None = None  # the last scrape samples are counted from

    def __enter__(self) -> MetricsTimeline:
        self._previous = self._settled_scrape()  # the baseline, taken before the run sends anything
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def as_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.samples]

    def _settled_scrape(self) -> dict[str, float] | None:
        return settled_scrape(self.metrics_url, self.model, settle=self.settle, timeout=self.settle_timeout)

    def _scrape(self) -> dict[str, float] | None:
        return scrape(self.metrics_url, self.model)  # NOTE: None is a gap in the plot, not a failed run

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()
        self._sample()  # the closing sample: the counters' last interval, however short the run was

    def _sample(self) -> None:
        now = self._scrape()
        if now is None:
            return
        previous = self._previous
        self._previous = now
        if previous is None:  # no baseline yet (a missed scrape): counting from 0 would count old runs
            return
        passes = now.get("forward_passes", 0.0) - previous.get("forward_passes", 0.0)
        seqs = now.get("forward_sequences_total", 0.0) - previous.get("forward_sequences_total", 0.0)
        waiting = now.get("waiting", 0.0) + now.get("triton_pending", 0.0)
        tokens = now.get("generated_tokens", 0.0) - previous.get("generated_tokens", 0.0)
        executions = now.get("triton_executions", 0.0) - previous.get("triton_executions", 0.0)
        inferences = now.get("triton_inferences", 0.0) - previous.get("triton_inferences", 0.0)
        self.samples.append(MetricsSample(
            t=time.perf_counter() - self._start, seqs_per_forward=seqs / passes if passes else 0.0,
            forward_passes=passes, waiting=waiting, running=now.get("running", 0.0),
            kv_used=now.get("kv_used", 0.0), kv_total=now.get("kv_total", 0.0), generated_tokens=tokens,
            executions=executions, inferences=inferences))


def requests_per_execution(samples: list[dict]) -> float | None:
    """Mean requests Triton handed the model per execution over the timeline: the batch size its
    dynamic batcher formed (1.0 for a model Triton does not batch), or None when nothing executed."""
    executions = sum(s.get("executions", 0.0) for s in samples)
    return sum(s.get("inferences", 0.0) for s in samples) / executions if executions else None


def saturated_window(samples: list[dict]) -> dict | None:
    """Output tokens/s from the timeline's start to its last sample with requests waiting.

    Counts the tokens the server generated (its counter, not the answers received), so tokens of
    requests still running at the window's end count. None when fewer than two samples saw a request
    waiting (requests sent together wait for the engine's next step to take them: one sample that sees
    them is not saturation, and its window holds a token or two) or the timeline has no token counts
    (a model without the counter, or a run shorter than a sample).
    """
    waiting = [i for i, s in enumerate(samples) if s["waiting"] > 0]
    if len(waiting) < 2 or samples[waiting[-1]]["t"] <= 0:
        return None
    window = samples[:waiting[-1] + 1]
    tokens = sum(s.get("generated_tokens", 0.0) for s in window)
    if tokens <= 0:
        return None
    duration = window[-1]["t"]
    return {"output_tokens": tokens, "duration_s": duration, "output_token_throughput": tokens / duration}
