"""The three HTTP APIs the servers are asked through, each streamed as server-sent events: Triton's
`/v2/models/<model>/generate_stream`, OpenAI's `/v1/completions` (the project's frontend) and llama.cpp's
`/completion` (llama-server's own). Every request is greedy, asks for exactly `max_tokens` tokens with EOS
ignored, and sends the prompt as token ids (each of the three takes them)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import requests

from batchlm.bench.peers_served.stats import StreamRecord
from batchlm.bench.peers_served.workload import ServedRequest


class StreamFailed(RuntimeError):
    """A request that did not end with a whole answer (an HTTP error, an error event, a cut stream)."""


def sse_events(response: requests.Response) -> Iterator[dict | None]:
    """The JSON of each `data:` line of a server-sent event stream; None for OpenAI's `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event:
            raise StreamFailed(f"error event: {event['error']}")
        yield event


@dataclass(frozen=True)
class HttpApi:
    """One server's streaming endpoint. `kind`: "triton" (generate_stream), "openai" (/v1/completions) or
    "llama.cpp" (/completion)."""

    kind: str
    base_url: str        # http://127.0.0.1:PORT
    model: str = ""      # Triton's model name, or the `model` field of an OpenAI request

    def __post_init__(self) -> None:
        if self.kind not in API_KINDS:
            raise ValueError(f"HttpApi.kind must be one of {API_KINDS}, got {self.kind!r}")

    def url(self) -> str:
        paths = {"triton": f"/v2/models/{self.model}/generate_stream", "openai": "/v1/completions",
                 "llama.cpp": "/completion"}
        return self.base_url + paths[self.kind]

    def body(self, request: ServedRequest) -> dict:
        ids = list(request.prompt_ids)
        if self.kind == "triton":
            return {"input_ids": ids, "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "stream": True}
        if self.kind == "openai":
            return {"model": self.model, "prompt": ids, "max_tokens": request.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        # NOTE: top_k 1 makes llama.cpp's sampler chain pick the argmax whatever else it applies
        return {"prompt": ids, "n_predict": request.max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "stream": True, "return_tokens": True}

    def send(self, session: requests.Session, request: ServedRequest, t0: float,
             timeout: float = 600.0) -> StreamRecord:
        """Send `request`, read its stream to the end; times relative to `t0` (time.perf_counter())."""
        sent = time.perf_counter() - t0
        first: float | None = None
        ids: list[int] = []
        texts: list[str] = []
        counted: int | None = None
        ended = False
        # NOTE: llama-server closes a connection after a streamed answer, and the next request on it fails
        # with RemoteDisconnected: a new connection per request there
        headers = {"Connection": "close"} if self.kind == "llama.cpp" else None
        with session.post(self.url(), json=self.body(request), headers=headers, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                raise StreamFailed(f"{self.url()} answered {r.status_code}: {r.text[:300]}")
            for event in sse_events(r):
                if event is None:
                    ended = True
                    break
                new_ids, text, count, last = self._read(event)
                if (new_ids or text) and first is None:
                    first = time.perf_counter() - t0
                ids += new_ids
                texts.append(text)
                counted = count if count is not None else counted
                ended = ended or last
        done = time.perf_counter() - t0
        if not ended:
            raise StreamFailed(f"{self.url()}: the stream ended before the answer did")
        n = counted if counted is not None else len(ids)
        return StreamRecord(request.index, sent, done if first is None else first, done, n, tuple(ids),
                            "".join(texts))

    def _read(self, event: dict) -> tuple[list[int], str, int | None, bool]:
        """(new token ids, new text, the server's output count if this event carries it, whether it ends)."""
        if self.kind == "triton":
            ids = event.get("output_ids") or []
            ids = ids if isinstance(ids, list) else [ids]
            return ids, event.get("text_output", ""), None, bool(event.get("finish_reason"))
        if self.kind == "openai":
            usage = event.get("usage") or {}
            text = "".join(c.get("text") or "" for c in event.get("choices", ()))
            return [], text, usage.get("completion_tokens"), False
        count = (event.get("timings") or {}).get("predicted_n")
        return list(event.get("tokens") or []), event.get("content", ""), count, bool(event.get("stop"))


API_KINDS = ("triton", "openai", "llama.cpp")
