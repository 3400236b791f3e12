"""The frontend's one connection to Triton: tritonclient's asyncio gRPC client, shared by every request.

A model that is not decoupled (static_batching, dynamic_batching) is asked with `ModelInfer`, whose
error carries Triton's status. A decoupled one (continuous_batching, continuous_batching_trtllm) is
asked on a `ModelStreamInfer` call of its own, on the same channel; its errors carry the message only.
Either call is cancelled when the HTTP client leaves (`TritonStream.cancel`, or cancelling the
`answer` coroutine), which Triton passes on to the model: it frees the request's KV within its
`cancellation_check_period_ms` plus one step.

A stream's request side sends the one request and then half-closes; Triton ends the call after the
request's final response, so a finished call is never cancelled. The final response is the one that
carries a `finish_reason` (every model of this repository sets one on its last response), or an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from batchlm.errors import InvalidArgument
from batchlm.frontend.errors import invalid
from batchlm.paths import readable_model
from batchlm.request_schema import DATA_TYPES, Chunk, MalformedResponse, input_arrays

# The models the frontend serves, where Triton has them loaded and ready.
SERVABLE_MODELS = ("static_batching", "dynamic_batching", "continuous_batching", "continuous_batching_trtllm")


class TritonFailure(Exception):
    """Triton or a model answered an error: `status` is the gRPC status name, None on a stream."""

    def __init__(self, status: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs of a model's config."""

    name: str
    decoupled: bool                 # streams: asked on a ModelStreamInfer call
    batched: bool                   # max_batch_size > 0: every input gets a batch dimension of 1
    inputs: Mapping[str, str]       # input name -> config data type ("TYPE_INT32")
    model_dir: Path | None          # its checkpoint, where this process can read it (chat template, tokenizer)
    max_model_len: int | None = None  # its `max_model_len` parameter, where it has one

    @classmethod
    def from_config(cls, config: dict) -> "ModelInfo":
        """From the model's config as gRPC's JSON (fields at their default are left out)."""
        return cls(
            name=config["name"],
            decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)),
            batched=int(config.get("max_batch_size", 0)) > 0,
            inputs={i["name"]: i.get("data_type", "TYPE_STRING") for i in config.get("input", [])},
            model_dir=readable_model(config),
            max_model_len=_int_parameter(config, "max_model_len"),
        )


def _int_parameter(config: dict, name: str) -> int | None:
    value = config.get("parameters", {}).get(name, {}).get("string_value")
    return int(value) if value is not None and value.strip().isdigit() else None


def infer_inputs(info: ModelInfo, fields: Mapping[str, object],
                 params: Mapping[str, str]) -> list[grpcclient.InferInput]:
    """The request's input tensors (request_schema.input_arrays), typed as the model declares them;
    ApiError 400 naming the parameter for a field the model has no input for, or an integer out of its
    type's range."""
    for name in fields:
        if info.inputs.get(name) not in DATA_TYPES:
            raise invalid(params.get(name, name), f"{info.name} does not take this parameter")
    try:
        arrays = input_arrays(fields, info.inputs, info.batched)
    except InvalidArgument as exc:
        raise invalid(params.get(exc.field, exc.field), exc.message) from None
    tensors = []
    for name, wire, array in arrays:
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def chunk_of(result) -> Chunk:
    """The Chunk of one InferResult; TritonFailure for a response without text."""
    try:
        return Chunk.from_outputs(result.as_numpy)
    except MalformedResponse as exc:
        raise TritonFailure(None, str(exc)) from None


class TritonStream:
    """One request on its own ModelStreamInfer call: iterate for its Chunks, up to the final one.

    After the final Chunk (or an error) the iteration reads the call to its end, which Triton sends
    once the request is done: a call whose request finished is never cancelled (see `cancel`)."""

    _draining: set[asyncio.Task] = set()  # drains left running by cancel(), held until they end

    def __init__(self, client: aio.InferenceServerClient, model: str, inputs: list, request_id: str,
                 timeout: float | None) -> None:
        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": request_id}

        self._call = client.stream_infer(requests(), stream_timeout=timeout)
        self.ended = False    # the final response (or an error) has arrived
        self._closed = False  # the call is over: read to its end, failed or cancelled

    def __aiter__(self) -> "TritonStream":
        return self

    async def __anext__(self) -> Chunk:
        if self.ended:
            await self._drain()
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self.ended = self._closed = True
            raise TritonFailure(None, "Triton ended the stream before the request's final response") from None
        except grpc.RpcError as exc:
            self.ended = self._closed = True
            raise TritonFailure(str(exc.code()), exc.details() or str(exc)) from None
        if error is not None:
            self.ended = True
            raise TritonFailure(None, error.message())
        chunk = chunk_of(result)
        self.ended = bool(chunk.finish_reason)
        return chunk

    async def _drain(self) -> None:
        try:
            while not self._closed:
                await self._call.__anext__()
        except (StopAsyncIteration, grpc.RpcError):
            pass
        finally:
            self._closed = True

    def cancel(self) -> None:
        """Cancel the request in Triton if it still runs (the HTTP client left). Once its final
        response came, the call is read to its end in the background instead.
        NOTE: a cancel after the final response once left tritonserver 2.51 holding the model, which
        then never finished unloading (docs/operations.md, "Why drain before the SIGTERM")."""
        if self._closed:
            return
        if self.ended:
            task = asyncio.ensure_future(self._drain())
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
            return
        self.ended = self._closed = True
        self._call.cancel()


class TritonBackend:
    """The asyncio gRPC client and the model configs it has read. Create and use it on one event loop."""

    def __init__(self, url: str, models: tuple[str, ...] = SERVABLE_MODELS, timeout: float | None = None) -> None:
        self.url = url
        self.models = models
        self.timeout = timeout  # per request, seconds; None: no limit (static_batching waits for a full batch)
        self._client = aio.InferenceServerClient(url)
        self._infos: dict[str, ModelInfo] = {}

    async def server_ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready(client_timeout=5))
        except InferenceServerException:
            return False

    async def served(self) -> list[str]:
        """The servable models that Triton has ready now."""
        async def ready(model: str) -> bool:
            try:
                return bool(await self._client.is_model_ready(model, client_timeout=5))
            except InferenceServerException:
                return False

        flags = await asyncio.gather(*(ready(m) for m in self.models))
        return [m for m, ok in zip(self.models, flags) if ok]

    async def info(self, model: str) -> ModelInfo:
        """The model's config, read once; TritonFailure if Triton cannot give it."""
        if model not in self._infos:
            try:
                config = await self._client.get_model_config(model, as_json=True, client_timeout=10)
            except InferenceServerException as exc:
                raise TritonFailure(exc.status(), exc.message() or str(exc)) from None
            self._infos[model] = ModelInfo.from_config(config["config"])
        return self._infos[model]

    async def answer(self, info: ModelInfo, inputs: list, request_id: str) -> Chunk:
        """The whole answer: ModelInfer, or a decoupled model's stream collected. Cancelling this
        coroutine cancels the request in Triton."""
        if info.decoupled:
            stream = self.stream(info, inputs, request_id)
            try:
                return Chunk.joined([chunk async for chunk in stream])
            finally:
                stream.cancel()
        try:
            result = await self._client.infer(info.name, inputs, request_id=request_id, client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise TritonFailure(exc.status(), exc.message() or str(exc)) from None
        return chunk_of(result)

    def stream(self, info: ModelInfo, inputs: list, request_id: str) -> TritonStream:
        return TritonStream(self._client, info.name, inputs, request_id, self.timeout)

    async def close(self) -> None:
        await self._client.close()
