"""Locust user on Triton's HTTP endpoints, for every model.

    locust -f locustfiles/http_user.py --host http://127.0.0.1:8000 --model dynamic_batching
    locust -f locustfiles/http_user.py --host http://127.0.0.1:8000 --model static_batching --http-endpoint infer

Each user keeps one request in flight (closed loop), drawn in order from the benchmark's seeded workload.
With streaming on (default for continuous_batching) it posts to `/v2/models/<m>/generate_stream` and
reads the server-sent events as they arrive, so TTFT is the first event carrying output; otherwise it
posts to `/generate` and TTFT equals E2E (the whole answer is the first response). With
`--http-endpoint infer` it posts KServe v2 tensors to `/infer` instead (models that are not decoupled),
whose status is Triton's error code: 503 when a model refuses for overload, where tritonserver 2.51's
`/generate` answers 400. Events are named `http <model>`, or `infer <model>` on /infer. Options and
events: see common.py.
"""

from __future__ import annotations

import json
import time

import common
from locust import constant, task
from locust.contrib.fasthttp import FastHttpUser

from batchlm_client.triton_llm import (
    LLMClient,
    RequestFailed,
    chunk_from_infer_json,
    chunk_from_json,
    http_error_message,
    http_infer_body,
)


class TritonHttpUser(FastHttpUser):
    """One closed-loop client of `/generate`, `/generate_stream` or `/infer`."""

    host = "http://127.0.0.1:8000"
    wait_time = constant(0)

    def __init__(self, environment) -> None:
        self.options = common.LoadOptions.from_environment(environment)
        # NOTE: the server decides every failure (it rejects on overload at once); a client timeout
        # far beyond any queueing keeps the client from ever being the cause.
        self.network_timeout = self.connection_timeout = self.options.request_timeout
        super().__init__(environment)
        self.feed = common.feed_for(self.options.spec)
        self.config: dict | None = None  # the model's config, read on start for /infer (batched, datatypes)

    def on_start(self) -> None:
        if self.options.http_endpoint != "infer":
            return
        model = self.options.model
        # NOTE: not through self.client, whose every call is a Locust request event in the stats.
        triton = LLMClient(http_url=self.host.split("://", 1)[-1].rstrip("/"))
        try:
            config, decoupled = triton.model_config(model), triton.is_decoupled(model)
        except RequestFailed as e:
            raise RuntimeError(f"cannot read {model}'s config: {e}") from None
        finally:
            triton.close()
        if decoupled:
            raise RuntimeError(f"{model} is decoupled, and HTTP /infer cannot serve a decoupled model; "
                               f"use --http-endpoint generate")
        self.config = config

    @task
    def generate(self) -> None:
        model = self.options.model
        body = self.options.body(self.feed.next())
        if self.options.http_endpoint == "infer":
            endpoint, protocol, body = "infer", "infer", http_infer_body(body, self.config)
        else:
            endpoint, protocol = ("generate_stream" if self.options.stream else "generate"), "http"
        timer = common.RequestTimer(self.environment, f"{protocol} {model}")
        # NOTE: identity encoding: a compressed event stream could not be read event by event.
        with self.client.post(f"/v2/models/{model}/{endpoint}", json=body,
                              name=timer.name, catch_response=True, stream=True,
                              headers={"Accept-Encoding": "identity"}) as response:
            try:
                tokens, error = _read(response, timer, self.options.stream, infer=protocol == "infer")
            except Exception as exc:  # noqa: BLE001 - a broken answer is this request's failure, not the task's
                tokens, error = 0, common.broken(exc)
            response.request_meta.update(request_type="E2E", response_time=timer.elapsed_ms(),
                                         response_length=tokens)
            if error is None:
                response.success()
            else:
                response.failure(error)
        if error is not None:
            time.sleep(self.options.failure_wait)  # gevent's sleep: locust has patched time


def _read(response, timer: common.RequestTimer, stream: bool, infer: bool = False) -> tuple[int, Exception | None]:
    """Output tokens and the failure (None on success) of one answer, reporting TTFT on the way."""
    if response.status_code == 0:  # no HTTP answer at all: connection refused or reset
        return 0, common.ServerError(f"[connection] {response.error}")
    if response.status_code != 200:
        return 0, common.failure(str(response.status_code), http_error_message(response.content))
    if infer or not stream:
        read = chunk_from_infer_json if infer else chunk_from_json
        tokens = read(json.loads(response.content)).num_output_tokens
        timer.first_output(tokens)
        return tokens, None
    tokens, finish = 0, None
    for event in _sse_events(response):
        if "error" in event:
            return tokens, common.failure("stream", event["error"])
        chunk = chunk_from_json(event)
        tokens = chunk.num_output_tokens
        finish = "-" if chunk.finish_reason is None else chunk.finish_reason  # NOTE: "-": a model without it
        if chunk.text or tokens:
            timer.first_output(tokens)
    if not finish:  # the stream closed before the response that ends the request
        return tokens, common.ServerError(f"[stream] ended after {tokens} tokens without its final response")
    return tokens, None


def _sse_events(response):
    """The JSON payloads of a server-sent event stream, each as soon as its line arrives."""
    # NOTE: the public readline() splits on b"\r\n"; Triton ends event lines with b"\n" only.
    while line := response._response.readline(b"\n"):
        line = line.strip()
        if line.startswith(b"data:"):
            yield json.loads(line[len(b"data:"):])
