"""The serving benchmark's client for an OpenAI-compatible server's `/v1/completions`.

    llm = OpenAIClient("http://127.0.0.1:9000/v1")      # api_key=...: else $BATCHLM_API_KEY, where set
    result = llm.complete("continuous_batching", "Hello", 32, stream=True, ignore_eos=True, temperature=0.0)

It returns the same Result as client/triton_llm.py's LLMClient, so a run is measured alike through
either door: TTFT at the first chunk with text, `chunk_times` one per chunk with text (the finish and
usage chunks carry none), and the token counts from the `usage` the server returns (asked for with
`stream_options.include_usage` when streamed). An error answer is RequestFailed with the HTTP status
("429" for an overload, "400" for bad input, ...) and the message of OpenAI's error JSON; an error
event after the stream began is RequestFailed("stream", ...), as over Triton's /generate_stream.

Where the frontend asks for an API key, every request carries `Authorization: Bearer <key>`: the key
given, else $BATCHLM_API_KEY (batchlm/api_key.py); a wrong or missing one is RequestFailed("401", ...).
Plain `requests`, not the openai SDK: it is in the benchmark's hot path, on the cores the server uses.
Not thread-safe: one per thread (its Session is one connection pool).
"""

from __future__ import annotations

import json
import time

import requests

from batchlm.api_key import bearer_headers, client_api_key
from batchlm_client.triton_llm import RequestFailed, Result

# The protocol value that sends the benchmark's requests to an OpenAI-compatible server. Kept out of
# batchlm_client.triton_llm.PROTOCOLS: those reach Triton itself, and the tests loop over them.
OPENAI_PROTOCOL = "openai"
DEFAULT_OPENAI_URL = "http://127.0.0.1:9000/v1"


class OpenAIClient:
    def __init__(self, base_url: str = DEFAULT_OPENAI_URL, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = requests.Session()
        self._http.headers.update(bearer_headers(client_api_key(api_key)))

    def complete(self, model: str, prompt: str, max_tokens: int, stream: bool = False,
                 start: float | None = None, **options) -> Result:
        """POST /v1/completions with `prompt` and `max_tokens`, plus `options` (OpenAI's parameters and
        the extensions `ignore_eos`, `top_k`; None-valued ones are left out). `start`: the
        perf_counter() the timings count from (default: now)."""
        start = time.perf_counter() if start is None else start
        body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens),
                **{k: v for k, v in options.items() if v is not None}}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        try:
            r = self._http.post(f"{self.base_url}/completions", json=body, stream=stream, timeout=self.timeout)
        except requests.ConnectionError as exc:
            raise RequestFailed("connection", f"cannot reach {self.base_url}: {_innermost(exc)}") from None
        with r:
            if r.status_code != 200:
                raise RequestFailed(str(r.status_code), error_message(r.content))
            if not stream:
                answer = r.json()
                elapsed = time.perf_counter() - start
                choice, usage = answer["choices"][0], answer.get("usage") or {}
                _check_usage(usage)
                return Result(choice["text"], choice.get("finish_reason"), usage.get("prompt_tokens"),
                              usage.get("completion_tokens"), ttft=elapsed, latency=elapsed, chunk_times=[elapsed])
            return self._read_stream(r, start)

    @staticmethod
    def _read_stream(r: requests.Response, start: float) -> Result:
        texts, times, finish, usage, done = [], [], None, {}, False
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed("stream", (event["error"] or {}).get("message", str(event["error"])))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                if choice.get("text"):
                    texts.append(choice["text"])
                    times.append(time.perf_counter() - start)
                finish = choice.get("finish_reason") or finish
        if not done:
            raise RequestFailed("stream", "the stream ended without [DONE]")
        _check_usage(usage)
        latency = time.perf_counter() - start
        return Result("".join(texts), finish, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                      ttft=times[0] if times else latency, latency=latency, chunk_times=times)

    def served(self) -> list[str]:
        """GET /v1/models: the models the server serves now."""
        try:
            r = self._http.get(f"{self.base_url}/models", timeout=30)
        except requests.ConnectionError as exc:
            raise RequestFailed("connection", f"cannot reach {self.base_url}: {_innermost(exc)}") from None
        if r.status_code != 200:
            raise RequestFailed(str(r.status_code), error_message(r.content))
        return [m["id"] for m in r.json().get("data", [])]

    def close(self) -> None:
        self._http.close()


def _check_usage(usage: dict) -> None:
    if not isinstance(usage.get("completion_tokens"), int):
        raise RequestFailed("client", "the answer has no usage.completion_tokens: the benchmark counts tokens from it")


def error_message(content: bytes | None) -> str:
    """The message of OpenAI's error JSON `{"error": {"message": ...}}`; the body as text otherwise."""
    text = (content or b"").decode(errors="replace").strip()
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text


def _innermost(exc: BaseException) -> str:
    for _ in range(8):  # requests wraps urllib3's error, which wraps the socket's
        inner = exc.__cause__ or (exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None)
        if inner is None:
            break
        exc = inner
    return str(exc).splitlines()[0]
