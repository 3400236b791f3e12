"""The OpenAI frontend's app driven over ASGI with a stand-in for Triton: no server, no gRPC.

    backend = FakeBackend(lambda fields: [Chunk(...), ...])     # the Chunks each request is answered with
    status, content = post(backend, "/v1/completions", {...})
    backend.sent                                                # each request's fields, in the order sent
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np

from batchlm.frontend.app import create_app
from batchlm.frontend.served_models import ServedModels
from batchlm.frontend.triton_client import ModelInfo
from batchlm.paths import TINY_MODEL_DIR
from batchlm.request_schema import INPUTS
from batchlm.response_schema import Chunk


class FakeStream:
    """A decoupled model's stream of Chunks; `log` records when its first one is read."""

    def __init__(self, chunks: list[Chunk], log: list[tuple[str, str]], request_id: str) -> None:
        self._chunks, self._log, self._id = list(chunks), log, request_id
        self.ended, self.cancelled, self._read = False, False, 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if not self._chunks:
            raise StopAsyncIteration
        await asyncio.sleep(0)  # NOTE: another task may run between two responses, as on a real stream
        answer = self._chunks.pop(0)
        self._read += 1
        if self._read == 1:
            self._log.append(("first", self._id))
        self.ended = bool(answer.finish_reason)
        return answer

    def cancel(self) -> None:
        self.cancelled = True


class FakeBackend:
    """Triton as the app sees it: continuous_batching streams its Chunks, dynamic_batching answers them
    joined (Chunk.joined), at once. `answers(fields)` gives the Chunks of the request with those fields."""

    models = ("continuous_batching", "dynamic_batching")

    def __init__(self, answers: Callable[[dict], list[Chunk]] | list[Chunk], model_dir=TINY_MODEL_DIR) -> None:
        self.answers = answers if callable(answers) else (lambda _fields: answers)
        self.model_dir = model_dir
        self.sent: list[dict] = []
        self.log: list[tuple[str, str]] = []

    async def served(self) -> list[str]:
        return list(self.models)

    async def info(self, model: str) -> ModelInfo:
        return ModelInfo(model, decoupled=model == "continuous_batching", batched=False, model_dir=self.model_dir,
                         inputs={n: f.data_type.config for n, f in INPUTS.items()}, max_model_len=1024)

    def _record(self, inputs, request_id: str) -> dict:
        fields = {t.name(): _value(t) for t in inputs}
        self.sent.append(fields)
        self.log.append(("sent", request_id))
        return fields

    async def answer(self, info, inputs, request_id) -> Chunk:
        return Chunk.joined(self.answers(self._record(inputs, request_id)))

    def stream(self, info, inputs, request_id) -> FakeStream:
        return FakeStream(self.answers(self._record(inputs, request_id)), self.log, request_id)

    async def close(self) -> None:
        pass


def _value(tensor):
    """An input tensor's values: a scalar where it holds one, else a list (strings decoded)."""
    raw = tensor._get_content() if hasattr(tensor, "_get_content") else None
    kind = tensor.datatype()
    if kind == "BYTES":
        values, at = [], 0
        while at < len(raw):
            size = int.from_bytes(raw[at:at + 4], "little")
            values.append(raw[at + 4:at + 4 + size].decode())
            at += 4 + size
    else:
        dtype = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}[kind]
        values = np.frombuffer(raw, dtype).tolist()
    return values[0] if len(values) == 1 and tensor.name() not in ("input_ids", "stop", "logit_bias_ids",
                                                                      "logit_bias") else values


def request(backend: FakeBackend, method: str, path: str, body: dict | None = None,
            query: str = "") -> tuple[int, bytes]:
    """One request to the app over ASGI, Triton replaced by `backend`: (status, body)."""
    app = create_app("127.0.0.1:1")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80)}
    incoming = [{"type": "http.request", "body": json.dumps(body).encode() if body is not None else b"",
                 "more_body": False}]
    status, parts = [], []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # the client stays until its answer ends

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    async def run():
        async with app.router.lifespan_context(app):
            await app.state.backend.close()
            app.state.backend = backend
            app.state.models = ServedModels(backend)
            await app(scope, receive, send)

    asyncio.run(run())
    return status[0], b"".join(parts)


def post(backend: FakeBackend, path: str, body: dict) -> tuple[int, bytes]:
    return request(backend, "POST", path, body)


def events(content: bytes) -> list[dict]:
    """A stream's events, `[DONE]` checked and left out."""
    lines = [line for line in content.decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-1]
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]
