"""The FastAPI app: OpenAI's routes, translated to the shared request schema and sent to Triton.

    app = create_app("127.0.0.1:8001")     # serve with uvicorn; see __main__.py

Routes: `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/completions`, `POST /v1/chat/completions`,
and `GET /health` (200 while Triton is ready, else 503). Every error is OpenAI's error JSON (errors.py).
With an API key, every route but `/health` answers 401 to a request without it (auth.py).

Contracts:
- Every request is answered: a body, a stream that ends with `[DONE]`, or an error (an error after a
  stream began is its last event).
- An error that the model answers before any text (bad input, overload) is a plain HTTP error with its
  status, also for `stream: true`: the stream is opened only once the model's first response is in.
- A client that leaves cancels its Triton request, streamed or not (the gRPC call is cancelled).
- `stream: true` to a model that cannot stream (static_batching, dynamic_batching; not decoupled) is
  sent without `stream` and its one answer streamed back as one chunk of text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from batchlm.errors import InvalidArgument
from batchlm.frontend import errors
from batchlm.frontend.auth import RequireApiKey
from batchlm.frontend.errors import ApiError
from batchlm.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SchemaRequest,
    chat_request,
    completion_request,
)
from batchlm.frontend.responses import DONE, Envelope, Usage, sse
from batchlm.frontend.triton_client import (
    SERVABLE_MODELS,
    ModelInfo,
    TritonBackend,
    TritonFailure,
    TritonStream,
    infer_inputs,
)
from batchlm.frontend.validation import validation_error
from batchlm.model.chat_template import ChatTemplate, load_chat_template
from batchlm.request_schema import Chunk

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def create_app(triton_grpc: str, models: tuple[str, ...] = SERVABLE_MODELS, timeout: float | None = None,
               api_key: str | None = None) -> FastAPI:
    """The frontend for the Triton server whose gRPC endpoint is `triton_grpc` ("host:port"), serving
    `models` where Triton has them ready; `timeout`: seconds per Triton request (None: no limit);
    `api_key`: the bearer token every route but `/health` asks for (None: none asked)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # NOTE: the aio channel belongs to the event loop it was made on: make it on uvicorn's
        app.state.backend = TritonBackend(triton_grpc, models, timeout)
        app.state.templates = {}
        yield
        await app.state.backend.close()

    app = FastAPI(title="batchlm OpenAI-compatible frontend", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(RequireApiKey, key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # NOTE: nobody reads it; nginx's code for "client closed"

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ready = await request.app.state.backend.server_ready()
        return JSONResponse({"triton_ready": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        served = await request.app.state.backend.served()
        return {"object": "list", "data": [_model_card(m) for m in served]}

    @app.get("/v1/models/{model}")
    async def get_model(request: Request, model: str) -> dict:
        backend: TritonBackend = request.app.state.backend
        served = await backend.served()
        if model not in served:
            raise errors.model_not_found(model, served)
        return _model_card(model)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        info = await _model_info(request, body.model)
        return await _generate(request, info, completion_request(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        info = await _model_info(request, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = _template(request, info).render(messages)
        except InvalidArgument as exc:
            raise errors.invalid(exc.field, exc.message) from None
        return await _generate(request, info, chat_request(body, prompt), chat=True)

    return app


def _model_card(model: str) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "batchlm"}


async def _model_info(request: Request, model: str) -> ModelInfo:
    backend: TritonBackend = request.app.state.backend
    if model not in backend.models:
        raise errors.model_not_found(model, backend.models)
    try:
        return await backend.info(model)
    except TritonFailure as exc:
        raise errors.from_triton(exc.status, exc.message, (), {}) from None


def _template(request: Request, info: ModelInfo) -> ChatTemplate:
    templates: dict[str, ChatTemplate] = request.app.state.templates
    if info.name not in templates:
        templates[info.name] = load_chat_template(info.model_dir)
    return templates[info.name]


async def _generate(request: Request, info: ModelInfo, schema: SchemaRequest, chat: bool) -> Response:
    backend: TritonBackend = request.app.state.backend
    streams = schema.stream and info.decoupled and "stream" in info.inputs
    fields = {**schema.fields, "stream": True} if streams else schema.fields
    inputs = infer_inputs(info, fields, schema.params)
    envelope = Envelope.new(info.name, chat)

    def failed(exc: TritonFailure) -> ApiError:
        return errors.from_triton(exc.status, exc.message, info.inputs, schema.params)

    if not streams:
        try:
            chunk = await _until_answered(request, backend.answer(info, inputs, envelope.id))
        except TritonFailure as exc:
            raise failed(exc) from None
        if not schema.stream:
            return JSONResponse(envelope.body(chunk.text, chunk.finish_reason, _usage(chunk)))
        return _event_stream(_events(envelope, schema, chunk, None, failed))
    stream = backend.stream(info, inputs, envelope.id)
    try:
        first = await _until_answered(request, stream.__anext__())
    except BaseException as exc:
        stream.cancel()  # NOTE: where the model answered an error, this reads the call to its end instead
        if isinstance(exc, TritonFailure):
            raise failed(exc) from None
        raise
    return _event_stream(_events(envelope, schema, first, stream, failed))


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(envelope: Envelope, schema: SchemaRequest, first: Chunk, rest: TritonStream | None,
                  failed) -> AsyncIterator[str]:
    """The server-sent events of one answer whose first Chunk is `first` (see responses.py)."""
    usage_field = schema.include_usage
    last = first
    try:
        if envelope.chat:
            yield sse(envelope.chunk("", role=True, with_usage_field=usage_field))
        if first.text:
            yield sse(envelope.chunk(first.text, with_usage_field=usage_field))
        if rest is not None and not rest.ended:
            async for chunk in rest:
                last = chunk
                if chunk.text:
                    yield sse(envelope.chunk(chunk.text, with_usage_field=usage_field))
        yield sse(envelope.chunk(None if envelope.chat else "", last.finish_reason, with_usage_field=usage_field))
        if schema.include_usage:
            yield sse(envelope.usage_chunk(_usage(last) or Usage(0, 0)))
        yield DONE
    except TritonFailure as exc:
        yield sse(failed(exc).body())
    finally:
        if rest is not None:
            rest.cancel()  # NOTE: a no-op once the final response came; the client left before it otherwise


def _usage(chunk: Chunk) -> Usage | None:
    if chunk.num_input_tokens is None or chunk.num_output_tokens is None:
        return None
    return Usage(chunk.num_input_tokens, chunk.num_output_tokens)


async def _until_answered(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (so is its Triton request)
    and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # NOTE: also when this coroutine is cancelled (a stop of the server)
        gone.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.wait({task})  # the cancellation has reached the gRPC call
    if not task.cancelled():
        task.exception()  # NOTE: retrieved, so that asyncio does not log it: nobody is left to answer
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
