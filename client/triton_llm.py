"""A small client for the repository's LLM models over Triton's HTTP and gRPC protocols.

It speaks the shared request schema (`text_input`, `max_tokens`, sampling fields, `stream`) and reads
each model's config from the server: whether it is decoupled and batched, which inputs it declares and
their datatypes (a field the model does not declare is refused here, naming the model's inputs, where
HTTP `generate` would silently turn it into a request parameter), and which outputs it has (the
counters `finish_reason`, `num_input_tokens` and `num_output_tokens` are read where the model declares
them, else left None; only `text_output` is required). So the same call works on every model of this
repository and on one with a narrower schema, such as a TensorRT-LLM ensemble:

    llm = LLMClient("127.0.0.1:8000", "127.0.0.1:8001")
    result = llm.generate("continuous_batching", "Hello", max_tokens=32)            # HTTP generate
    for chunk in llm.stream_grpc("continuous_batching", "Hello", max_tokens=32):   # gRPC streaming
        print(chunk.text, end="")

Each call records time to first response and end-to-end latency. Not thread-safe: one per thread.
"""

from __future__ import annotations

import json
import queue
import re
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


# gRPC's own UNAVAILABLE when nothing answers at the address (a model's UNAVAILABLE, an overload, says otherwise)
_GRPC_UNREACHABLE = re.compile(r"failed to connect to all addresses|Connection refused|DNS resolution failed")


def unreachable(exc: BaseException, http: str, grpc: str) -> str | None:
    """If `exc` says no server answered at these addresses (connection refused, unknown host, gRPC
    UNAVAILABLE), the one-line error to print, with the innermost cause; None for any other error."""
    if isinstance(exc, RequestFailed):  # a gRPC call that could not connect
        if exc.status != "StatusCode.UNAVAILABLE" or not _GRPC_UNREACHABLE.search(exc.message):
            return None
        reason = exc.message
    elif isinstance(exc, InferenceServerException):
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


# Triton config datatype -> (wire datatype, numpy dtype) for the inputs this client can fill
DATATYPES: dict[str, tuple[str, type]] = {
    "TYPE_STRING": ("BYTES", np.object_), "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_INT32": ("INT32", np.int32), "TYPE_INT64": ("INT64", np.int64),
    "TYPE_UINT32": ("UINT32", np.uint32), "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_FP16": ("FP16", np.float16), "TYPE_FP32": ("FP32", np.float32), "TYPE_FP64": ("FP64", np.float64),
}
COUNTERS = ("finish_reason", "num_input_tokens", "num_output_tokens")
# http: /generate and /generate_stream (SSE); grpc: ModelInfer and ModelStreamInfer streams; infer: HTTP
# /infer in KServe v2 JSON, one answer, models that are not decoupled (it carries Triton's error code as
# the HTTP status, which /generate on tritonserver 2.51 does not)
PROTOCOLS = ("http", "grpc", "infer")
STREAMING_PROTOCOLS = ("http", "grpc")  # the ones that reach every model, decoupled ones and streams included


@dataclass
class Chunk:
    """One response: new text (a delta when streaming) and the model's counters (None where the model
    has no such output)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int | None


@dataclass
class Result:
    """A finished request: the whole text, counters (None where the model has none) and client-side
    timings (seconds)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int | None
    ttft: float  # time to the first response carrying text (whole answer when not streaming)
    latency: float  # end to end
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, from the start


def grpc_model_config(triton: grpcclient.InferenceServerClient, model: str, timeout: float) -> dict:
    """The model's config over gRPC, as JSON with `max_batch_size` a number (0 where it is left out, as
    protobuf's JSON leaves out every field at its default)."""
    config = triton.get_model_config(model, as_json=True, client_timeout=timeout)["config"]
    config["max_batch_size"] = int(config.get("max_batch_size", 0))
    return config


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
                 timeout: float = 600.0, configs_of: LLMClient | None = None) -> None:
        """`configs_of`: another client whose model configs this one starts with, so its first request
        reads none of them again (the benchmark's clients, whose first request's latency would carry
        the read)."""
        self.http_url = http_url
        self.grpc_url = grpc_url
        self.timeout = timeout
        self._http = requests.Session()
        self._grpc: grpcclient.InferenceServerClient | None = None
        # (channel, model) -> config
        self._configs: dict[tuple[str, str], dict] = dict(configs_of._configs) if configs_of is not None else {}

    # -- model metadata --------------------------------------------------------------------------
    def model_config(self, model: str, via: str = "http") -> dict:
        """The model's config as JSON, read on the channel that requests over protocol `via` (PROTOCOLS)
        use, and cached: over gRPC for "grpc", over HTTP for "http" and "infer".

        gRPC requests read it over gRPC, so a client that only asks over gRPC needs no HTTP port and
        holds no HTTP connection open: an open one, even idle, makes tritonserver's SIGTERM wait out its
        exit timeout and exit without unloading its models (docs/operations.md, "Why drain before the SIGTERM").
        The two carry the fields read here alike; gRPC's leaves out fields at their default value."""
        if via not in PROTOCOLS:
            raise ValueError(f"via must be one of {PROTOCOLS}, got {via!r}")
        channel = "grpc" if via == "grpc" else "http"
        if (channel, model) not in self._configs:
            if channel == "grpc":
                try:
                    config = grpc_model_config(self.grpc, model, timeout=30.0)
                except InferenceServerException as exc:
                    raise _grpc_failure(exc) from None
            else:
                r = self._http.get(f"http://{self.http_url}/v2/models/{model}/config", timeout=30)
                _raise_for_http(r)
                config = r.json()
            self._configs[(channel, model)] = config
        return self._configs[(channel, model)]

    def chat_prompt(self, model: str, messages: list[dict[str, str]], via: str = "http") -> str:
        """`messages` (dicts with `role` and `content`) as one prompt, rendered with the chat template of
        the checkpoint the model's config names (batchlm.frontend.chat_template, as the OpenAI route
        renders it), where this machine can read that checkpoint; else with the plain template."""
        from batchlm.frontend.chat_template import load_chat_template
        from batchlm.frontend.triton_client import ModelInfo

        return load_chat_template(ModelInfo.from_config(self.model_config(model, via)).model_dir).render(messages)

    def is_decoupled(self, model: str, via: str = "http") -> bool:
        return bool(self.model_config(model, via).get("model_transaction_policy", {}).get("decoupled"))

    def outputs(self, model: str, via: str = "http") -> set[str]:
        return {o["name"] for o in self.model_config(model, via).get("output", [])}

    def answer(self, protocol: str, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """One whole answer over `protocol` (PROTOCOLS): `generate`, `infer_grpc` or `infer_http`."""
        asks = {"http": self.generate, "grpc": self.infer_grpc, "infer": self.infer_http}
        if protocol not in asks:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        return asks[protocol](model, prompt, max_tokens, **options)

    def stream(self, protocol: str, model: str, prompt: str, max_tokens: int, **options) -> Iterator[Chunk]:
        """The response stream over `protocol` (STREAMING_PROTOCOLS): `generate_stream` or `stream_grpc`.
        "infer" cannot stream: RequestFailed("client", ...)."""
        if protocol == "infer":
            raise RequestFailed("client", f"HTTP /infer answers once and cannot stream {model}; stream over "
                                          f"{' or '.join(STREAMING_PROTOCOLS)}")
        asks = {"http": self.generate_stream, "grpc": self.stream_grpc}
        if protocol not in asks:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        return asks[protocol](model, prompt, max_tokens, **options)

    def _fields(self, model: str, prompt: str, max_tokens: int, via: str = "http", **options) -> dict:
        """The request's fields, each one an input the model declares (its config read `via` HTTP or
        gRPC); else RequestFailed("client", ...) naming the model's inputs."""
        fields = request_fields(prompt, max_tokens, **options)
        declared = {i["name"] for i in self.model_config(model, via).get("input", [])}
        unknown = sorted(set(fields) - declared)
        if unknown:
            raise RequestFailed("client", f"{model} has no input {', '.join(map(repr, unknown))}; "
                                          f"its inputs: {', '.join(sorted(declared))}")
        return fields

    # -- HTTP generate ---------------------------------------------------------------------------
    def generate(self, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """POST /v2/models/<model>/generate: one JSON answer."""
        start = time.perf_counter()
        body = self._fields(model, prompt, max_tokens, **options)
        r = self._http.post(f"http://{self.http_url}/v2/models/{model}/generate", json=body,
                            timeout=self.timeout)
        _raise_for_http(r)
        chunk = _chunk_from_json(r.json())
        elapsed = time.perf_counter() - start
        return Result(chunk.text, chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens,
                      ttft=elapsed, latency=elapsed, chunk_times=[elapsed])

    def infer_http(self, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """POST /v2/models/<model>/infer (KServe v2 JSON): one answer, from a model that is not decoupled.

        Unlike /generate it carries Triton's error code as the HTTP status (503 for UNAVAILABLE): on
        tritonserver 2.51 /generate answers every error a model returns with 400. A decoupled model is
        refused here, RequestFailed("client", ...): Triton's /infer cannot serve one."""
        start = time.perf_counter()
        if self.is_decoupled(model):
            raise RequestFailed("client", f"{model} is decoupled, and HTTP /infer cannot serve a decoupled "
                                          f"model; ask over {' or '.join(STREAMING_PROTOCOLS)}")
        body = http_infer_body(self._fields(model, prompt, max_tokens, **options), self.model_config(model))
        r = self._http.post(f"http://{self.http_url}/v2/models/{model}/infer", json=body, timeout=self.timeout)
        _raise_for_http(r)
        chunk = chunk_from_infer_json(r.json())
        elapsed = time.perf_counter() - start
        return Result(chunk.text, chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens,
                      ttft=elapsed, latency=elapsed, chunk_times=[elapsed])

    def generate_stream(self, model: str, prompt: str, max_tokens: int, **options) -> Iterator[Chunk]:
        """POST /v2/models/<model>/generate_stream (server-sent events), one Chunk per event."""
        body = self._fields(model, prompt, max_tokens, **options)
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

    def check_grpc(self) -> None:
        """Raise RequestFailed if the gRPC address does not answer (see `unreachable`)."""
        try:
            self.grpc.is_server_live(client_timeout=min(self.timeout, 30.0))
        except InferenceServerException as exc:
            raise _grpc_failure(exc) from None

    def stream_grpc(self, model: str, prompt: str, max_tokens: int, **options) -> Iterator[Chunk]:
        """gRPC bidirectional stream (decoupled models): yield each response as it arrives."""
        inputs = grpc_inputs(self._fields(model, prompt, max_tokens, "grpc", **options),
                             self.model_config(model, "grpc"))
        responses: queue.Queue = queue.Queue()
        self.grpc.start_stream(callback=lambda result, error: responses.put((result, error)),
                               stream_timeout=self.timeout)
        ended = False  # the server sent the request's last response (or its error)
        try:
            try:
                self.grpc.async_stream_infer(model, inputs, enable_empty_final_response=True)
            except InferenceServerException as exc:  # the stream failed before it was used ...
                ended = True
                try:  # ... and its callback has (or soon has) the cause, e.g. a refused connection
                    _, error = responses.get(timeout=1.0)
                except queue.Empty:
                    error = None
                raise _grpc_failure(error if error is not None else exc) from None
            while True:
                result, error = responses.get(timeout=self.timeout)
                if error is not None:
                    ended = True
                    raise _grpc_failure(error)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                ended = final is not None and final.bool_param
                chunk = chunk_from_grpc(result) if response.outputs else None
                if chunk is not None:
                    yield chunk
                if ended:
                    return
        finally:
            # NOTE: cancel only a request still running (a timeout, or the caller stopped reading).
            # Cancelling a stream whose last response had arrived left tritonserver 2.51 holding the
            # model, which then never finished unloading (docs/operations.md, "Why drain before the SIGTERM").
            self.grpc.stop_stream(cancel_requests=not ended)

    def infer_grpc(self, model: str, prompt: str, max_tokens: int, **options) -> Result:
        """A whole answer over gRPC: the stream API for decoupled models, infer() otherwise."""
        start = time.perf_counter()
        if self.is_decoupled(model, "grpc"):
            return collect(self.stream_grpc(model, prompt, max_tokens, **options), start)
        inputs = grpc_inputs(self._fields(model, prompt, max_tokens, "grpc", **options),
                             self.model_config(model, "grpc"))
        try:
            result = self.grpc.infer(model, inputs, client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise _grpc_failure(exc) from None
        chunk = chunk_from_grpc(result)
        elapsed = time.perf_counter() - start
        return Result(chunk.text, chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens,
                      ttft=elapsed, latency=elapsed, chunk_times=[elapsed])

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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


def input_arrays(fields: dict, config: dict | None = None) -> list[tuple[str, str, np.ndarray]]:
    """(name, wire datatype, array) per field: datatypes as the model's config declares them (the
    schema's own without a config), one row more when the model is batched (max_batch_size > 0)."""
    config = config or {}
    declared = {i["name"]: i for i in config.get("input", [])}
    batched = config.get("max_batch_size", 0) > 0
    arrays = []
    for name, value in fields.items():
        datatype, dtype = FIELDS[name]
        if name in declared and declared[name].get("data_type") in DATATYPES:
            datatype, dtype = DATATYPES[declared[name]["data_type"]]
        values = value if name == "stop" else [value]
        if dtype is np.object_:
            values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=dtype)
        arrays.append((name, datatype, array.reshape(1, -1) if batched else array))
    return arrays


def grpc_inputs(fields: dict, config: dict | None = None) -> list[grpcclient.InferInput]:
    """gRPC input tensors for `fields` (see input_arrays)."""
    inputs = []
    for name, datatype, array in input_arrays(fields, config):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def http_infer_body(fields: dict, config: dict | None = None) -> dict:
    """The JSON body of POST /v2/models/<model>/infer for `fields` (see input_arrays)."""
    inputs = []
    for name, datatype, array in input_arrays(fields, config):
        data = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        inputs.append({"name": name, "datatype": datatype, "shape": list(array.shape), "data": data})
    return {"inputs": inputs}


def chunk_from_grpc(result) -> Chunk:
    def first(name):
        array = result.as_numpy(name)
        return None if array is None else np.asarray(array).reshape(-1)[0]

    text = first("text_output")
    if text is None:
        raise RequestFailed("client", "the response has no text_output")
    reason, num_in, num_out = (first(name) for name in COUNTERS)
    return Chunk(text=text.decode(), finish_reason=None if reason is None else reason.decode(),
                 num_input_tokens=_int_or_none(num_in), num_output_tokens=_int_or_none(num_out))


def _chunk_from_json(body: dict) -> Chunk:
    def scalar(value):
        while isinstance(value, list):
            value = value[0]
        return value

    if "text_output" not in body:
        raise RequestFailed("client", "the response has no text_output")
    reason, num_in, num_out = (scalar(body.get(name)) for name in COUNTERS)
    return Chunk(text=scalar(body["text_output"]), finish_reason=reason,
                 num_input_tokens=_int_or_none(num_in), num_output_tokens=_int_or_none(num_out))


def chunk_from_infer_json(body: dict) -> Chunk:
    """A Chunk from an /infer answer: its `outputs` list, flattened to the fields /generate returns."""
    return _chunk_from_json({o["name"]: o.get("data") for o in body.get("outputs", [])})


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


def http_error_message(content: bytes | None) -> str:
    """Triton's message from an HTTP error body: `{"error": ...}`, or one event `data: {"error": ...}`
    when /generate_stream refuses a request before streaming; the body as text if it is neither."""
    text = (content or b"").decode(errors="replace").strip()
    try:
        return json.loads(text.removeprefix("data:"))["error"]
    except (ValueError, KeyError, TypeError):
        return text


def _raise_for_http(r: requests.Response) -> None:
    if r.status_code != 200:
        raise RequestFailed(str(r.status_code), http_error_message(r.content))


def _grpc_failure(error) -> RequestFailed:
    status = error.status() if hasattr(error, "status") and error.status() else "grpc"
    message = error.message() if hasattr(error, "message") else str(error)
    return RequestFailed(str(status), message)
