"""A small client for the repository's LLM models over Triton's HTTP and gRPC protocols.

It speaks the shared request schema (batchlm.request_schema: `text_input`, `max_tokens`, sampling
fields, `stream`) and reads each model's config from the server: whether it is decoupled and batched,
which inputs it declares and their datatypes (a field the model does not declare is refused here, naming
the model's inputs, where HTTP `generate` would silently turn it into a request parameter), and which
outputs it has (the counters `finish_reason`, `num_input_tokens` and `num_output_tokens` are read where
the model declares them, else left None; only `text_output` is required). So the same call works on
every model of this repository and on one with a narrower schema, such as a TensorRT-LLM ensemble:

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
from collections.abc import Callable, Iterator

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchlm.errors import InvalidArgument
from batchlm.request_schema import input_arrays, request_fields
from batchlm.response_schema import Chunk, MalformedResponse
from batchlm_client.result import RequestFailed, Result, collect


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


# http: /generate and /generate_stream (SSE); grpc: ModelInfer and ModelStreamInfer streams; infer: HTTP
# /infer in KServe v2 JSON, one answer, models that are not decoupled (it carries Triton's error code as
# the HTTP status, which /generate on tritonserver 2.51 does not)
PROTOCOLS = ("http", "grpc", "infer")
STREAMING_PROTOCOLS = ("http", "grpc")  # the ones that reach every model, decoupled ones and streams included


def grpc_model_config(triton: grpcclient.InferenceServerClient, model: str, timeout: float) -> dict:
    """The model's config over gRPC, as JSON with `max_batch_size` a number (0 where it is left out, as
    protobuf's JSON leaves out every field at its default)."""
    config = triton.get_model_config(model, as_json=True, client_timeout=timeout)["config"]
    config["max_batch_size"] = int(config.get("max_batch_size", 0))
    return config


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
        the checkpoint the model's config names (batchlm.model.chat_template, as the OpenAI route renders
        it), where this machine can read that checkpoint; else with the plain template."""
        from batchlm.model.chat_template import load_chat_template
        from batchlm.paths import readable_model

        return load_chat_template(readable_model(self.model_config(model, via))).render(messages)

    def is_decoupled(self, model: str, via: str = "http") -> bool:
        return bool(self.model_config(model, via).get("model_transaction_policy", {}).get("decoupled"))

    def outputs(self, model: str, via: str = "http") -> set[str]:
        return {o["name"] for o in self.model_config(model, via).get("output", [])}

    def answer(self, protocol: str, model: str, prompt: str | list[int], max_tokens: int, **options) -> Result:
        """One whole answer over `protocol` (PROTOCOLS): `generate`, `infer_grpc` or `infer_http`."""
        asks = {"http": self.generate, "grpc": self.infer_grpc, "infer": self.infer_http}
        if protocol not in asks:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        return asks[protocol](model, prompt, max_tokens, **options)

    def stream(self, protocol: str, model: str, prompt: str | list[int], max_tokens: int, **options) -> Iterator[Chunk]:
        """The response stream over `protocol` (STREAMING_PROTOCOLS): `generate_stream` or `stream_grpc`.
        "infer" cannot stream: RequestFailed("client", ...)."""
        if protocol == "infer":
            raise RequestFailed("client", f"HTTP /infer answers once and cannot stream {model}; stream over "
                                          f"{' or '.join(STREAMING_PROTOCOLS)}")
        asks = {"http": self.generate_stream, "grpc": self.stream_grpc}
        if protocol not in asks:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        return asks[protocol](model, prompt, max_tokens, **options)

    def _fields(self, model: str, prompt: str | list[int], max_tokens: int, via: str = "http", **options) -> dict:
        """The request's fields (request_fields), each one an input the model declares (its config read
        `via` HTTP or gRPC); else RequestFailed("client", ...) naming the field."""
        try:
            fields = request_fields(prompt, max_tokens, **options)
        except InvalidArgument as exc:
            raise RequestFailed("client", str(exc)) from None
        declared = {i["name"] for i in self.model_config(model, via).get("input", [])}
        unknown = sorted(set(fields) - declared)
        if unknown:
            raise RequestFailed("client", f"{model} has no input {', '.join(map(repr, unknown))}; "
                                          f"its inputs: {', '.join(sorted(declared))}")
        return fields

    # -- HTTP generate ---------------------------------------------------------------------------
    def generate(self, model: str, prompt: str | list[int], max_tokens: int, **options) -> Result:
        """POST /v2/models/<model>/generate: one JSON answer."""
        start = time.perf_counter()
        body = self._fields(model, prompt, max_tokens, **options)
        r = self._http.post(f"http://{self.http_url}/v2/models/{model}/generate", json=body,
                            timeout=self.timeout)
        _raise_for_http(r)
        return collect(iter([chunk_from_json(r.json())]), start)

    def infer_http(self, model: str, prompt: str | list[int], max_tokens: int, **options) -> Result:
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
        return collect(iter([chunk_from_infer_json(r.json())]), start)

    def generate_stream(self, model: str, prompt: str | list[int], max_tokens: int, **options) -> Iterator[Chunk]:
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
                yield chunk_from_json(event)

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

    def stream_grpc(self, model: str, prompt: str | list[int], max_tokens: int, **options) -> Iterator[Chunk]:
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

    def infer_grpc(self, model: str, prompt: str | list[int], max_tokens: int, **options) -> Result:
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
        return collect(iter([chunk_from_grpc(result)]), start)

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None


def _config_arrays(fields: dict, config: dict | None = None) -> list[tuple[str, str, np.ndarray]]:
    """request_schema.input_arrays for a model of this config (JSON, as HTTP or gRPC gives it): typed as
    it declares its inputs (the schema's types without a config), batched where max_batch_size > 0;
    RequestFailed("client", ...) for an integer its type cannot hold."""
    config = config or {}
    declared = {i["name"]: i.get("data_type", "") for i in config.get("input", [])}
    try:
        return input_arrays(fields, declared, batched=config.get("max_batch_size", 0) > 0)
    except InvalidArgument as exc:
        raise RequestFailed("client", str(exc)) from None


def grpc_inputs(fields: dict, config: dict | None = None) -> list[grpcclient.InferInput]:
    """gRPC input tensors for `fields` (see _config_arrays)."""
    inputs = []
    for name, datatype, array in _config_arrays(fields, config):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def http_infer_body(fields: dict, config: dict | None = None) -> dict:
    """The JSON body of POST /v2/models/<model>/infer for `fields` (see _config_arrays)."""
    inputs = []
    for name, datatype, array in _config_arrays(fields, config):
        data = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        inputs.append({"name": name, "datatype": datatype, "shape": list(array.shape), "data": data})
    return {"inputs": inputs}


def chunk_from_grpc(result) -> Chunk:
    """The Chunk of one gRPC InferResult."""
    return _chunk(result.as_numpy)


def chunk_from_json(body: dict) -> Chunk:
    """The Chunk of a /generate answer or one /generate_stream event."""
    return _chunk(body.get)


def chunk_from_infer_json(body: dict) -> Chunk:
    """The Chunk of an /infer answer (its `outputs` list)."""
    return _chunk({o["name"]: o.get("data") for o in body.get("outputs", [])}.get)


def _chunk(output: Callable[[str], object]) -> Chunk:
    try:
        return Chunk.from_outputs(output)
    except MalformedResponse as exc:
        raise RequestFailed("client", str(exc)) from None


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
