"""A small client for the repository's LLM models over Triton's HTTP and gRPC protocols.

It speaks the shared request schema (`text_input`, `max_tokens`, sampling fields, `stream`) and reads
from the server whether a model is decoupled, so the same call works on every model:

    llm = LLMClient("127.0.0.1:8000", "127.0.0.1:8001")
    result = llm.generate("continuous_batching", "Hello", max_tokens=32)            # HTTP generate
    for chunk in llm.stream_grpc("continuous_batching", "Hello", max_tokens=32):   # gRPC streaming
        print(chunk.text, end="")

Each call records time to first response and end-to-end latency. Not thread-safe: one per thread.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# schema field -> (Triton datatype, numpy dtype)
FIELDS: dict[str, tuple[str, type]] = {
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "stop": ("BYTES", np.object_),
    "ignore_eos": ("BOOL", np.bool_),
    "stream": ("BOOL", np.bool_),
}


def unreachable(exc: BaseException, http: str, grpc: str) -> str | None:
    """If `exc` says no server answered at these addresses (connection refused, unknown host, gRPC
    UNAVAILABLE), the one-line error to print, with the innermost cause; None for any other error."""
    if isinstance(exc, InferenceServerException):
        if exc.status() != "StatusCode.UNAVAILABLE":
            return None
        reason = exc.message() or str(exc)
    elif isinstance(exc, requests.ConnectionError):
        for _ in range(8):  # requests wraps urllib3's error, which wraps the socket's
            inner = exc.__cause__ or (exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None)
            if inner is None:
                break
            exc = inner
        reason = str(exc).splitlines()[0]
    else:
        return None
    return f"error: cannot reach the server (HTTP {http}, gRPC {grpc}): {reason}"


class RequestFailed(RuntimeError):
    """The server answered with an error; `status` is the HTTP status or gRPC status name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message


@dataclass
class Chunk:
    """One response: new text (a delta when streaming) and the model's counters."""

    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int


@dataclass
class Result:
    """A finished request: the whole text, counters and client-side timings (seconds)."""

    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    ttft: float  # time to the first response carrying text (whole answer when not streaming)
    latency: float  # end to end
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, from the start


def request_fields(prompt: str, max_tokens: int, **options) -> dict:
    """The JSON body / input set for one request; None-valued options are left out."""
    body = {"text_input": prompt, "max_tokens": int(max_tokens)}
    for key, value in options.items():
        if key not in FIELDS:
            raise ValueError(f"unknown request field {key!r}; expected one of {sorted(FIELDS)}")
        if value is not None:
            body[key] = list(value) if key == "stop" else value
    return body


class LLMClient:
    def __init__(self, http_url: str = "127.0.0.1:8000", grpc_url: str = "127.0.0.1:8001",
                 timeout: float = 600.0) -> None:
        self.http_url = http_url
        self.grpc_url = grpc_url
        self.timeout = timeout
        self._http = requests.Session()
        self._grpc: grpcclient.InferenceServerClient | None = None
        self._configs: dict[str, dict] = {}

    # -- model metadata --------------------------------------------------------------------------
    def model_config(self, model: str) -> dict:
        if model not in self._configs:
            r = self._http.get(f"http://{self.http_url}/v2/models/{model}/config", timeout=30)
            _raise_for_http(r)
            self._configs[model] = r.json()
        return self._configs[model]

    def is_decoupled(self, model: str) -> bool:
        return bool(self.model_config(model).get("model_transaction_policy", {}).get("decoupled"))

    # -- HTTP generate ---------------------------------------------------------------------------
    def generate(self, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """POST /v2/models/<model>/generate: one JSON answer."""
        start = time.perf_counter()
        r = self._http.post(f"http://{self.http_url}/v2/models/{model}/generate",
                            json=request_fields(prompt, max_tokens, **options), timeout=self.timeout)
        _raise_for_http(r)
        chunk = _chunk_from_json(r.json())
        elapsed = time.perf_counter() - start
        return Result(chunk.text, chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens,
                      ttft=elapsed, latency=elapsed, chunk_times=[elapsed])

    def generate_stream(self, model: str, prompt: str, max_tokens: int, **options) -> Iterator[Chunk]:
        """POST /v2/models/<model>/generate_stream (server-sent events), one Chunk per event."""
        body = request_fields(prompt, max_tokens, **options)
        with self._http.post(f"http://{self.http_url}/v2/models/{model}/generate_stream", json=body,
                             stream=True, timeout=self.timeout) as r:
            _raise_for_http(r)
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise RequestFailed("stream", event["error"])
                yield _chunk_from_json(event)

    # -- gRPC ------------------------------------------------------------------------------------
    @property
    def grpc(self) -> grpcclient.InferenceServerClient:
        if self._grpc is None:
            self._grpc = grpcclient.InferenceServerClient(self.grpc_url)
        return self._grpc

    def stream_grpc(self, model: str, prompt: str, max_tokens: int, **options) -> Iterator[Chunk]:
        """gRPC bidirectional stream (decoupled models): yield each response as it arrives."""
        responses: queue.Queue = queue.Queue()
        self.grpc.start_stream(callback=lambda result, error: responses.put((result, error)),
                               stream_timeout=self.timeout)
        try:
            self.grpc.async_stream_infer(model, grpc_inputs(request_fields(prompt, max_tokens, **options)),
                                         enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=self.timeout)
                if error is not None:
                    raise _grpc_failure(error)
                response = result.get_response()
                chunk = chunk_from_grpc(result) if response.outputs else None
                if chunk is not None:
                    yield chunk
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
        finally:
            self.grpc.stop_stream(cancel_requests=True)

    def infer_grpc(self, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """A whole answer over gRPC: the stream API for decoupled models, infer() otherwise."""
        start = time.perf_counter()
        if self.is_decoupled(model):
            return collect(self.stream_grpc(model, prompt, max_tokens, **options), start)
        fields = request_fields(prompt, max_tokens, **options)
        batched = self.model_config(model).get("max_batch_size", 0) > 0
        try:
            result = self.grpc.infer(model, grpc_inputs(fields, batched), client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise _grpc_failure(exc) from None
        chunk = chunk_from_grpc(result)
        elapsed = time.perf_counter() - start
        return Result(chunk.text, chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens,
                      ttft=elapsed, latency=elapsed, chunk_times=[elapsed])

    def close(self) -> None:
        self._http.close()
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None


def collect(chunks: Iterator[Chunk], start: float | None = None) -> Result:
    """Drain a chunk stream into a Result with client-side timings."""
    start = time.perf_counter() if start is None else start
    texts, times, last = [], [], None
    ttft = None
    for chunk in chunks:
        now = time.perf_counter() - start
        texts.append(chunk.text)
        times.append(now)
        if ttft is None and chunk.text:
            ttft = now
        last = chunk
    if last is None:
        raise RequestFailed("empty", "the stream ended without a response")
    latency = time.perf_counter() - start
    return Result("".join(texts), last.finish_reason, last.num_input_tokens, last.num_output_tokens,
                  ttft=latency if ttft is None else ttft, latency=latency, chunk_times=times)


def grpc_inputs(fields: dict, batched: bool = False) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in fields.items():
        datatype, dtype = FIELDS[name]
        values = value if name == "stop" else [value]
        if dtype is np.object_:
            values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=dtype)
        if batched:
            array = array.reshape(1, -1)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def chunk_from_grpc(result) -> Chunk:
    def first(name):
        return np.asarray(result.as_numpy(name)).reshape(-1)[0]

    return Chunk(text=first("text_output").decode(), finish_reason=first("finish_reason").decode(),
                 num_input_tokens=int(first("num_input_tokens")),
                 num_output_tokens=int(first("num_output_tokens")))


def _chunk_from_json(body: dict) -> Chunk:
    def scalar(value):
        while isinstance(value, list):
            value = value[0]
        return value

    return Chunk(text=scalar(body["text_output"]), finish_reason=scalar(body["finish_reason"]),
                 num_input_tokens=int(scalar(body["num_input_tokens"])),
                 num_output_tokens=int(scalar(body["num_output_tokens"])))


def _raise_for_http(r: requests.Response) -> None:
    if r.status_code != 200:
        try:
            message = r.json().get("error", r.text)
        except ValueError:
            message = r.text
        raise RequestFailed(str(r.status_code), message)


def _grpc_failure(error) -> RequestFailed:
    status = error.status() if hasattr(error, "status") and error.status() else "grpc"
    message = error.message() if hasattr(error, "message") else str(error)
    return RequestFailed(str(status), message)
