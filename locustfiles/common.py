"""What the Locust users share: command-line options, the seeded workload, failure kinds and reporting.

Every locustfile here imports this module, so one set of custom arguments exists for all of them and
travels from the master to the workers in distributed mode. Each option also reads an environment
variable, so a run can be configured without a command line:

    --model            BATCHLM_MODEL            static_batching | dynamic_batching | continuous_batching
                                                | continuous_batching_trtllm (GPU, scripts/serve_trtllm.py)
    --stream           BATCHLM_STREAM           auto (on for the continuous models) | on | off
    --workload-seed    BATCHLM_WORKLOAD_SEED    seed of the prompts and output lengths (as the benchmark)
    --workload-requests BATCHLM_WORKLOAD_REQUESTS  distinct requests; users cycle through them in order
    --output-mean      BATCHLM_OUTPUT_MEAN      mean output tokens (Exponential), default 128
    --output-cap       BATCHLM_OUTPUT_CAP       most output tokens, default 512
    --request-timeout  BATCHLM_REQUEST_TIMEOUT  seconds; far above any wait, so the server decides failures
    --failure-wait     BATCHLM_FAILURE_WAIT     seconds a user backs off after a failed request (1)
    --api-key          BATCHLM_API_KEY          openai_user.py only: the frontend's API key, sent as
                                                `Authorization: Bearer <key>` (where the frontend asks for one)
    --http-endpoint    BATCHLM_HTTP_ENDPOINT    http_user.py only: generate (default; generate_stream when
                                                streamed) | infer (KServe v2 /infer: one answer, models that
                                                are not decoupled, Triton's status kept: 503 on overload)

Each request is reported as Locust request events of request_type `TTFT` (time to the first response
that carries output) and `E2E` (end to end), named `<protocol> <model>`, with the number of output tokens
as the response length. A rejected or failed request is one `E2E` failure whose message is the server's.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

import gevent
from locust import events, stats

from batchlm.bench.workload import WorkloadRequest, WorkloadSpec, build_requests
from batchlm.request_schema import request_fields
from batchlm_client.triton_llm import RequestFailed

MODELS = ("static_batching", "dynamic_batching", "continuous_batching", "continuous_batching_trtllm")
STREAMING_MODELS = ("continuous_batching", "continuous_batching_trtllm")  # the models that send text as it is made
HTTP_ENDPOINTS = ("generate", "infer")


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    """Custom arguments; Locust shows them in the web UI too, and sends them to workers."""
    env = os.environ.get
    parser.add_argument("--model", choices=MODELS, default=env("BATCHLM_MODEL", "continuous_batching"),
                        help="model (batching strategy) to load [env BATCHLM_MODEL]")
    parser.add_argument("--stream", choices=("auto", "on", "off"), default=env("BATCHLM_STREAM", "auto"),
                        help="ask for streamed text; auto = on for the continuous models [env BATCHLM_STREAM]")
    parser.add_argument("--workload-seed", type=int, default=int(env("BATCHLM_WORKLOAD_SEED", "0")),
                        help="seed of the benchmark's workload spec [env BATCHLM_WORKLOAD_SEED]")
    parser.add_argument("--workload-requests", type=int, default=int(env("BATCHLM_WORKLOAD_REQUESTS", "200")),
                        help="distinct requests in the workload [env BATCHLM_WORKLOAD_REQUESTS]")
    parser.add_argument("--output-mean", type=float, default=float(env("BATCHLM_OUTPUT_MEAN", "128")),
                        help="mean output length in tokens [env BATCHLM_OUTPUT_MEAN]")
    parser.add_argument("--output-cap", type=int, default=int(env("BATCHLM_OUTPUT_CAP", "512")),
                        help="longest output in tokens [env BATCHLM_OUTPUT_CAP]")
    parser.add_argument("--request-timeout", type=float, default=float(env("BATCHLM_REQUEST_TIMEOUT", "900")),
                        help="client-side limit per request, seconds [env BATCHLM_REQUEST_TIMEOUT]")
    parser.add_argument("--failure-wait", type=float, default=float(env("BATCHLM_FAILURE_WAIT", "1")),
                        help="seconds a user waits after a failed request [env BATCHLM_FAILURE_WAIT]")
    # NOTE: is_secret: the web UI shows it masked; the variable keeps it off the command line
    parser.add_argument("--api-key", default=env("BATCHLM_API_KEY", ""), is_secret=True,
                        help="openai_user.py: the OpenAI frontend's API key [env BATCHLM_API_KEY]")
    parser.add_argument("--http-endpoint", choices=HTTP_ENDPOINTS, default=env("BATCHLM_HTTP_ENDPOINT", "generate"),
                        help="http_user.py: /generate (or /generate_stream), or KServe v2 /infer, which keeps "
                             "Triton's status (503 on overload) but cannot stream [env BATCHLM_HTTP_ENDPOINT]")


@dataclass(frozen=True)
class LoadOptions:
    """The parsed custom arguments of one Locust process (the same on master and workers)."""

    model: str
    stream: bool
    spec: WorkloadSpec
    request_timeout: float
    failure_wait: float  # NOTE: a rejected user retrying at once would spin, not measure
    http_endpoint: str = "generate"

    @classmethod
    def from_environment(cls, environment) -> "LoadOptions":
        """The options as parsed; ValueError for a combination no request could serve."""
        o = environment.parsed_options
        stream = o.model in STREAMING_MODELS if o.stream == "auto" else o.stream == "on"
        if o.http_endpoint == "infer" and stream:
            raise ValueError(f"--http-endpoint infer answers once and cannot stream {o.model} (--stream "
                             f"{o.stream}); use --stream off with a model that is not decoupled, or "
                             f"--http-endpoint generate")
        spec = WorkloadSpec(seed=o.workload_seed, num_requests=o.workload_requests,
                            output_mean=o.output_mean, output_cap=o.output_cap)
        return cls(o.model, stream, spec, o.request_timeout, o.failure_wait, o.http_endpoint)

    def body(self, request: WorkloadRequest) -> dict:
        """The request's schema fields: its prompt and length, EOS ignored so it makes exactly that many."""
        return request_fields(request.prompt, request.max_tokens, ignore_eos=True, stream=self.stream)


@events.init.add_listener
def _check_options(environment, **_kwargs) -> None:
    """Every user file imports this module, so a bad option fails the run at start, not per request:
    one line and exit status 2, as for an option Locust's own parser refuses."""
    try:
        LoadOptions.from_environment(environment)
    except ValueError as e:
        print(f"locust: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# NOTE: Locust writes `--csv` files only from a greenlet that wakes every CSV_STATS_INTERVAL_SEC, never at
# shutdown, so a run that ends within that interval of its last answers left those answers out of
# `_stats.csv`. A shorter interval, and a pause when the users have stopped that lets the writer wake
# twice, put every answer in the files.
stats.CSV_STATS_INTERVAL_SEC = 0.1


@events.test_stop.add_listener
def _let_the_csv_writer_catch_up(environment, **_kwargs) -> None:
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(3 * stats.CSV_STATS_INTERVAL_SEC)


class RequestFeed:
    """The workload's requests in order, round and round; users of one process share one feed.

    Greenlets switch only on I/O, so `next()` needs no lock.
    """

    def __init__(self, requests: tuple[WorkloadRequest, ...]) -> None:
        self._requests = requests
        self._next = 0

    def next(self) -> WorkloadRequest:
        request = self._requests[self._next % len(self._requests)]
        self._next += 1
        return request


@lru_cache(maxsize=None)
def feed_for(spec: WorkloadSpec) -> RequestFeed:
    """The process's feed for `spec`, built once (tokenizing the prompts takes a moment)."""
    return RequestFeed(tuple(build_requests(spec)))


class Overloaded(Exception):
    """The server refused the request for capacity (UNAVAILABLE / 503 / queue full); its message kept."""


class ServerError(Exception):
    """Any other error answer from the server; its message kept."""


# Words in Triton's answers that mean "no capacity now": the models' overload errors (UNAVAILABLE, which
# reaches HTTP as 400 and a gRPC stream without a status) and Triton's own dynamic-batching queue limit
# (HTTP 503). NOTE: a gRPC status UNAVAILABLE is the transport's (server unreachable), not an overload.
_OVERLOAD_MARKS = ("overloaded", "exceeds maximum queue size")


def failure(status: str, message: str) -> Exception:
    """The Locust failure for an error answer: Overloaded or ServerError, `[status] message`."""
    text = f"[{status}] {message}"
    if status == "503" or any(mark in message.lower() for mark in _OVERLOAD_MARKS):
        return Overloaded(text)
    return ServerError(text)


def broken(exc: Exception) -> Exception:
    """The failure for an answer that could not be read to its end (the connection broke, a response
    that does not parse): a RequestFailed keeps its status; anything else is a ServerError
    `[client] <type>: <message>`. Raised, it would escape the user's task without an E2E event."""
    if isinstance(exc, RequestFailed):
        return failure(exc.status, exc.message)
    return ServerError(f"[client] {type(exc).__name__}: {exc}")


class RequestTimer:
    """Times one request and reports its TTFT and E2E events to Locust."""

    def __init__(self, environment, name: str) -> None:
        self._events = environment.events
        self.name = name
        self.start_time = time.time()
        self._start = time.perf_counter()
        self.ttft_ms: float | None = None

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self._start) * 1000.0

    def first_output(self, tokens: int) -> None:
        """Call on every response; the first one carrying output is the TTFT event."""
        if self.ttft_ms is None:
            self.ttft_ms = self.elapsed_ms()
            self._fire("TTFT", self.ttft_ms, tokens, None)

    def done(self, tokens: int, exception: Exception | None = None, response_time_ms: float | None = None) -> None:
        """The E2E event: a success with `tokens` output tokens, or a failure carrying `exception`."""
        elapsed = self.elapsed_ms() if response_time_ms is None else response_time_ms
        self._fire("E2E", elapsed, tokens, exception)

    def _fire(self, kind: str, response_time_ms: float, tokens: int, exception: Exception | None) -> None:
        self._events.request.fire(request_type=kind, name=self.name, response_time=response_time_ms,
                                  response_length=tokens, exception=exception, context={},
                                  start_time=self.start_time, url=None)
