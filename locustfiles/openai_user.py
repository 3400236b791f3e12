"""Locust user on the OpenAI-compatible frontend (`make serve` starts it on port 9000), for every model.

    locust -f locustfiles/openai_user.py --host http://127.0.0.1:9000 --model continuous_batching

Each user keeps one chat completion in flight (closed loop), drawn in order from the benchmark's seeded
workload: the workload's prompt as one user message (the chat template adds a few tokens), its length
as `max_tokens`, greedy, with `ignore_eos` so it makes exactly that many. With streaming on (default for
the continuous models) it asks for `stream: true` with `stream_options.include_usage` and reads the
server-sent events as they arrive: TTFT is the first event carrying text, and the output tokens come
from the usage chunk. Otherwise one JSON answer, and TTFT equals E2E. A streamed request to a model that
cannot stream is answered as one chunk, so its TTFT is its E2E too. Events are named `openai <model>`;
a 429 (overload) or a 503 is an Overloaded failure. Where the frontend asks for an API key, give it with
`--api-key` or $BATCHLM_API_KEY; a 401 is a failure. Options and events: see common.py.
"""

from __future__ import annotations

import json
import time

import common
from batchlm.api_key import bearer_headers
from locust import constant, task
from locust.contrib.fasthttp import FastHttpUser


class OpenAIChatUser(FastHttpUser):
    """One closed-loop client of `/v1/chat/completions`."""

    host = "http://127.0.0.1:9000"
    wait_time = constant(0)

    def __init__(self, environment) -> None:
        self.options = common.LoadOptions.from_environment(environment)
        # NOTE: the server decides every failure; a client timeout beyond any queueing keeps it so
        self.network_timeout = self.connection_timeout = self.options.request_timeout
        super().__init__(environment)
        self.feed = common.feed_for(self.options.spec)
        # NOTE: identity encoding: a compressed event stream could not be read event by event.
        self.request_headers = {"Accept-Encoding": "identity", **bearer_headers(environment.parsed_options.api_key)}

    def body(self) -> dict:
        request = self.feed.next()
        body = {"model": self.options.model, "messages": [{"role": "user", "content": request.prompt}],
                "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": self.options.stream}
        if self.options.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @task
    def chat(self) -> None:
        timer = common.RequestTimer(self.environment, f"openai {self.options.model}")
        with self.client.post("/v1/chat/completions", json=self.body(), name=timer.name, catch_response=True,
                              stream=True, headers=self.request_headers) as response:
            try:
                tokens, error = _read(response, timer, self.options.stream)
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


def _read(response, timer: common.RequestTimer, stream: bool) -> tuple[int, Exception | None]:
    """Output tokens and the failure (None on success) of one answer, reporting TTFT on the way."""
    if response.status_code == 0:  # no HTTP answer at all: connection refused or reset
        return 0, common.ServerError(f"[connection] {response.error}")
    if response.status_code != 200:
        return 0, common.failure(str(response.status_code), _error_message(response.content))
    if not stream:
        tokens = json.loads(response.content)["usage"]["completion_tokens"]
        timer.first_output(tokens)
        return tokens, None
    tokens, done = None, False
    for event in _sse_events(response):
        if event is None:
            done = True
            break
        if "error" in event:
            return 0, common.failure("stream", event["error"].get("message", str(event["error"])))
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if any(choice.get("delta", {}).get("content") for choice in event.get("choices", [])):
            timer.first_output(1)
    if not done or tokens is None:  # the stream closed before its usage chunk and [DONE]
        return tokens or 0, common.ServerError("[stream] ended before its usage chunk and [DONE]")
    return tokens, None


def _sse_events(response):
    """The JSON payloads of a server-sent event stream as their lines arrive; None for `data: [DONE]`."""
    while line := response._response.readline(b"\n"):
        line = line.strip()
        if line == b"data: [DONE]":
            yield None
        elif line.startswith(b"data:"):
            yield json.loads(line[len(b"data:"):])


def _error_message(content: bytes | None) -> str:
    """The message of OpenAI's error JSON; the body as text if it is not one."""
    text = (content or b"").decode(errors="replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text
