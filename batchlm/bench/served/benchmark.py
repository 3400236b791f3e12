"""The serving benchmark: sends a seeded workload to one model, open or closed loop, and measures it.

    config = BenchmarkConfig("continuous_batching", arrival=ArrivalSpec.closed_loop(32))
    run = Benchmark(config).run(build_requests(WorkloadSpec(num_requests=64)))

Greedy; a synthetic workload's request asks for exactly its length (`ignore_eos`), a chat one ends
at the model's EOS (batchlm.bench.workload). Models that stream are read as a
stream (true TTFT and inter-token gaps); the others answer once, so their TTFT is their E2E.
`protocol` picks the transport: "http" (default: `/generate`, and `/generate_stream` server-sent events
when streaming), "grpc" (`ModelInfer`, and a `ModelStreamInfer` stream for decoupled models) or "infer"
(HTTP `/infer`, one answer, only for models that are not decoupled; its failures carry Triton's status,
503 for an overload, where `/generate` on tritonserver 2.51 answers every model error with 400), or
"openai" (OPENAI_PROTOCOL: `/v1/completions` of the OpenAI-compatible frontend at `openai_url`, through
client/openai_client.py; Triton's HTTP address still serves the model's config and its metrics the
timeline; streamed where the model streams, its token counts from the answer's `usage`).
The client shares the machine with the server, so its own cost per response is part of what it
measures: a streamed response costs this client about three times as much CPU over gRPC as over HTTP
(`batchlm-bench client-cost` measures both), hence the default.
One LLMClient per thread: tritonclient and requests clients are not thread-safe.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tritonclient.utils import InferenceServerException

from batchlm.bench.workload import WorkloadRequest
from batchlm.bench.served.arrivals import CLOSED, ArrivalSpec
from batchlm.bench.served.metrics_timeline import MetricsTimeline, requests_per_execution, saturated_window
from batchlm_client.openai_client import DEFAULT_OPENAI_URL, OPENAI_PROTOCOL, OpenAIClient
from batchlm.bench.served.request_record import SLO, RequestRecord, summarize
from batchlm_client.triton_llm import PROTOCOLS, STREAMING_PROTOCOLS, LLMClient, RequestFailed, collect

# NOTE: gRPC Python wakes every thread blocked on a call or stream every 0.1 s
# (grpc._common.MAXIMUM_WAIT_TIMEOUT, so that Ctrl-C is seen), whether or not anything arrived. With 64
# streams in flight that is 640+ wake-ups a second; on a machine the client shares with the server each
# one preempts an engine thread, which costs served throughput. A longer wait delays no answer: a wait
# ends as soon as its call is notified.
GRPC_WAIT_SECONDS = 5.0


class UnmeasurableModel(ValueError):
    """The model cannot be measured as configured: it lacks what the benchmark reads (its token
    counter), or the transport cannot reach it (HTTP /infer and a decoupled model)."""


@contextlib.contextmanager
def _quiet_grpc_waits(seconds: float = GRPC_WAIT_SECONDS) -> Iterator[None]:
    """Within the block, gRPC Python's idle wake-up period is `seconds` (restored after; no-op if this
    grpc has no such setting)."""
    from grpc import _common  # NOTE: private; grpc comes with tritonclient[grpc]

    old = getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None)
    if old is None:
        yield
        return
    _common.MAXIMUM_WAIT_TIMEOUT = max(old, seconds)
    try:
        yield
    finally:
        _common.MAXIMUM_WAIT_TIMEOUT = old


@dataclass(frozen=True)
class BenchmarkConfig:
    model: str
    http_url: str = "127.0.0.1:8000"
    grpc_url: str = "127.0.0.1:8001"
    metrics_url: str | None = "http://127.0.0.1:8002/metrics"  # None: no timeline
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    stream: bool | None = None     # None: stream when the model can (decoupled and accepts stream)
    slo: SLO = field(default_factory=SLO)
    timeout: float = 900.0         # per request, seconds
    max_open_in_flight: int = 512  # open loop: threads available to requests in flight
    protocol: str = "http"         # "http", "grpc", "infer" or "openai" (see the module docstring)
    openai_url: str = DEFAULT_OPENAI_URL  # protocol "openai": the OpenAI-compatible server's /v1
    # protocol "openai": the key it asks for; None: $BATCHLM_API_KEY where set. Never in a report.
    openai_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.protocol not in (*PROTOCOLS, OPENAI_PROTOCOL):
            raise ValueError(f"BenchmarkConfig.protocol must be one of {(*PROTOCOLS, OPENAI_PROTOCOL)}, "
                             f"got {self.protocol!r}")
        if self.protocol not in (*STREAMING_PROTOCOLS, OPENAI_PROTOCOL) and self.stream:
            raise ValueError(f"BenchmarkConfig.stream: protocol {self.protocol!r} cannot stream; "
                             f"use one of {STREAMING_PROTOCOLS}")


@dataclass
class BenchmarkRun:
    config: BenchmarkConfig
    streamed: bool
    records: list[RequestRecord]
    duration: float
    timeline: list[dict]

    @property
    def summary(self) -> dict:
        """summarize()'s figures, plus `saturated`: saturated_window() of the timeline (closed loop only),
        and `requests_per_execution`: the mean batch Triton handed the model (None without a timeline)."""
        summary = summarize(self.records, self.duration, self.config.slo)
        summary["saturated"] = saturated_window(self.timeline) if self.config.arrival.mode == CLOSED else None
        summary["requests_per_execution"] = requests_per_execution(self.timeline)
        return summary


def can_stream(llm: LLMClient, model: str, protocol: str = "http") -> bool:
    """Decoupled and accepts `stream: true` (a decoupled model may still refuse it); asked over
    `protocol`, so a server reachable on that one alone is enough."""
    if not llm.is_decoupled(model, protocol):
        return False
    try:
        collect(llm.stream(protocol, model, "hello", 1, stream=True))
    except RequestFailed as exc:
        if "stream" in exc.message:
            return False
        raise
    return True


def unfillable_batches(model_config: dict, num_requests: int, arrival: ArrivalSpec) -> str | None:
    """Why a run would leave requests waiting for ever on a model that answers only full batches (its
    `batch_size` parameter, as static_batching's), or None: closed loop below the batch size never fills
    one, and a request count that is not a multiple of it leaves the last ones parked."""
    batch = model_config.get("parameters", {}).get("batch_size", {}).get("string_value")
    if batch is None or not batch.isdigit() or int(batch) <= 1:
        return None
    batch, name = int(batch), model_config.get("name", "the model")
    if arrival.mode == CLOSED and arrival.concurrency < batch:
        return (f"{name} answers only full batches of {batch}: closed loop at {arrival.concurrency} in flight "
                f"never fills one; use a concurrency of {batch} or more")
    if num_requests % batch:
        return (f"{name} answers only full batches of {batch}: the last {num_requests % batch} of "
                f"{num_requests} requests would wait for ever; send a multiple of {batch}")
    return None


class Benchmark:
    def __init__(self, config: BenchmarkConfig) -> None:
        self.config = config
        self._local = threading.local()
        self._clients: list[LLMClient] = []
        self._clients_lock = threading.Lock()
        self._streamed = False
        self._t0 = 0.0
        self._probe: LLMClient | None = None  # its configs go to every request's client

    def run(self, requests: list[WorkloadRequest]) -> BenchmarkRun:
        """Send every request and wait for all answers; failures are recorded, not raised."""
        probe = self._probe = LLMClient(self.config.http_url, self.config.grpc_url, self.config.timeout)
        try:
            openai = self.config.protocol == OPENAI_PROTOCOL
            via = "http" if openai else self.config.protocol  # NOTE: openai: the config from Triton's HTTP
            if "num_output_tokens" not in probe.outputs(self.config.model, via):
                raise UnmeasurableModel(f"{self.config.model} has no num_output_tokens output: the benchmark "
                                        "counts each request's tokens from it")
            problem = unfillable_batches(probe.model_config(self.config.model, via), len(requests), self.config.arrival)
            if problem is not None:
                raise UnmeasurableModel(problem)
            if self.config.protocol == "grpc":
                probe.check_grpc()  # NOTE: else an unreachable gRPC address fails every request, not the run
            if openai:
                self._check_openai()
            elif self.config.protocol not in STREAMING_PROTOCOLS and probe.is_decoupled(self.config.model, via):
                raise UnmeasurableModel(f"{self.config.model} is decoupled, and protocol {self.config.protocol!r} "
                                        f"(HTTP /infer) cannot reach it; use one of {STREAMING_PROTOCOLS}")
            if self.config.stream is None and openai:  # the frontend streams what the model streams
                self._streamed = probe.is_decoupled(self.config.model, via)
            elif self.config.stream is None:
                self._streamed = can_stream(probe, self.config.model, self.config.protocol)
            else:
                self._streamed = self.config.stream
        finally:
            probe.close()
        timeline = MetricsTimeline(self.config.metrics_url, self.config.model) \
            if self.config.metrics_url else None
        with contextlib.ExitStack() as stack:  # NOTE: unwinds in reverse: waits, timeline, then clients
            stack.callback(self._close_clients)
            if timeline is not None:
                stack.enter_context(timeline)
            stack.enter_context(_quiet_grpc_waits())
            self._t0 = time.perf_counter()
            if self.config.arrival.mode == CLOSED:
                records = self._closed_loop(requests)
            else:
                records = self._open_loop(requests)
        duration = max((r.sent_at + r.latency for r in records), default=0.0)
        samples = timeline.as_dicts() if timeline is not None else []
        return BenchmarkRun(self.config, self._streamed, records, duration, samples)

    def _check_openai(self) -> None:
        """The OpenAI-compatible server answers and serves the model (else RequestFailed, before the run)."""
        oa = OpenAIClient(self.config.openai_url, timeout=30.0, api_key=self.config.openai_api_key)
        try:
            served = oa.served()
        finally:
            oa.close()
        if self.config.model not in served:
            raise RequestFailed("404", f"{self.config.openai_url} does not serve {self.config.model}; it serves "
                                       f"{', '.join(served) or 'none'}")

    def _close_clients(self) -> None:
        for llm in self._clients:
            llm.close()

    # -- arrival processes ---------------------------------------------------------------------
    def _closed_loop(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        todo: queue.Queue = queue.Queue()
        for request in requests:
            todo.put(request)
        records: list[RequestRecord] = []

        def worker() -> None:
            while True:
                try:
                    request = todo.get_nowait()
                except queue.Empty:
                    return
                records.append(self._send(request))  # NOTE: list.append is atomic

        threads = [threading.Thread(target=worker, name=f"bench-{i}", daemon=True)
                   for i in range(self.config.arrival.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(records, key=lambda r: r.index)

    def _open_loop(self, requests: list[WorkloadRequest]) -> list[RequestRecord]:
        times = self.config.arrival.send_times(len(requests))
        workers = min(len(requests), self.config.max_open_in_flight)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as pool:
            futures = []
            for at, request in zip(times, requests):
                delay = self._t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(self._send, request))
            return [f.result() for f in futures]

    # -- one request ---------------------------------------------------------------------------
    def _client(self) -> LLMClient | OpenAIClient:
        llm = getattr(self._local, "llm", None)
        if llm is None:
            if self.config.protocol == OPENAI_PROTOCOL:
                llm = OpenAIClient(self.config.openai_url, self.config.timeout, self.config.openai_api_key)
            else:
                llm = LLMClient(self.config.http_url, self.config.grpc_url, self.config.timeout,
                                configs_of=self._probe)
            self._local.llm = llm
            with self._clients_lock:
                self._clients.append(llm)
        return llm

    def _send(self, request: WorkloadRequest) -> RequestRecord:
        llm = self._client()
        record = RequestRecord(request.index, request.prompt_tokens, request.max_tokens)
        start = time.perf_counter()
        record.sent_at = start - self._t0
        options = dict(ignore_eos=request.ignore_eos, temperature=0.0)
        ask = (self.config.protocol, self.config.model, request.prompt, request.max_tokens)
        try:
            if isinstance(llm, OpenAIClient):
                result = llm.complete(self.config.model, request.prompt, request.max_tokens,
                                      stream=self._streamed, start=start, **options)
            elif self._streamed:
                result = collect(llm.stream(*ask, stream=True, **options), start)
            else:
                result = llm.answer(*ask, **options)
        except RequestFailed as exc:
            record.error, record.error_message = exc.status, exc.message
            record.latency = time.perf_counter() - start
            return record
        except (OSError, RuntimeError, queue.Empty, InferenceServerException) as exc:  # transport failures, timeouts
            record.error, record.error_message = type(exc).__name__, str(exc)
            record.latency = time.perf_counter() - start
            return record
        record.ttft, record.latency = result.ttft, result.latency
        record.num_output_tokens = result.num_output_tokens
        record.chunk_times = result.chunk_times if self._streamed else []
        return record
