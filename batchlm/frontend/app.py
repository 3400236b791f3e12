"""The FastAPI app: OpenAI's routes, translated to the shared request schema and sent to Triton.

    app = create_app("127.0.0.1:8001")     # serve with uvicorn; see __main__.py

Routes: `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/completions`, `POST /v1/chat/completions`,
`POST /tokenize`, `POST /detokenize` (tokenize.py), `GET /health` (200 while Triton is ready, else 503)
and `GET /metrics` (metrics.py, Prometheus' text format). Every error is OpenAI's error JSON (errors.py).
With an API key, every route but `/health` and `/metrics` answers 401 to a request without it (auth.py).
An answer's text and log-probabilities are shaped from the models' Chunks by logprobs.py, with each
token's text and bytes from the checkpoint's tokenizer (token_text.py).

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
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from batchlm.errors import InvalidArgument
from batchlm.frontend import errors
from batchlm.frontend.auth import RequireApiKey
from batchlm.frontend.errors import ApiError
from batchlm.frontend.logprobs import ChoiceShaper, Piece
from batchlm.frontend.metrics import FrontendMetrics, RequestTiming
from batchlm.frontend.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SchemaRequest,
    TokenizeRequest,
    chat_request,
    completion_request,
    template_messages,
)
from batchlm.frontend.responses import DONE, Envelope, Usage, sse
from batchlm.frontend.token_text import TokenTexts
from batchlm.frontend.tokenize import detokenize, load_tokenizer, tokenize
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
from batchlm.model.tokenizer import Tokenizer
from batchlm.response_schema import Chunk, MalformedResponse

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def create_app(triton_grpc: str, models: tuple[str, ...] = SERVABLE_MODELS, timeout: float | None = None,
               api_key: str | None = None) -> FastAPI:
    """The frontend for the Triton server whose gRPC endpoint is `triton_grpc` ("host:port"), serving
    `models` where Triton has them ready; `timeout`: seconds per Triton request (None: no limit);
    `api_key`: the bearer token every route but `/health` and `/metrics` asks for (None: none asked)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # NOTE: the aio channel belongs to the event loop it was made on: make it on uvicorn's
        app.state.backend = TritonBackend(triton_grpc, models, timeout)
        app.state.templates = {}
        app.state.tokenizers = {}
        app.state.token_texts = {}
        app.state.metrics = FrontendMetrics()
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

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
        try:
            prompt = _template(request, info).render(template_messages(body.messages))
        except InvalidArgument as exc:
            raise errors.invalid(exc.field, exc.message) from None
        schema = chat_request(body, prompt, await _rest_of_context(request, info, prompt))
        return await _generate(request, info, schema, chat=True)

    @app.post("/tokenize")
    async def tokenize_route(request: Request, body: TokenizeRequest) -> dict:
        info = await _model_info(request, body.model)
        tokenizer = _tokenizer(request, info)
        text = body.prompt
        if body.messages is not None:
            try:
                text = _template(request, info).render(template_messages(body.messages))
            except InvalidArgument as exc:
                raise errors.invalid(exc.field, exc.message) from None
        tokens = await asyncio.to_thread(tokenize, tokenizer, text, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize_route(request: Request, body: DetokenizeRequest) -> dict:
        info = await _model_info(request, body.model)
        return {"prompt": detokenize(_tokenizer(request, info), body.tokens)}

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


async def _rest_of_context(request: Request, info: ModelInfo, prompt: str) -> int:
    """A chat's default `max_tokens`, as OpenAI's: what is left of the model's context after `prompt`;
    DEFAULT_CHAT_MAX_TOKENS where the model's context or checkpoint is unknown here. A prompt that leaves
    nothing gets 1, which the model refuses naming the prompt."""
    if info.max_model_len is None or info.model_dir is None:
        return DEFAULT_CHAT_MAX_TOKENS
    ids = await asyncio.to_thread(tokenize, _tokenizer(request, info), prompt, True)
    return max(1, info.max_model_len - len(ids))


def _tokenizer(request: Request, info: ModelInfo, purpose: str = "tokenize for it") -> Tokenizer:
    tokenizers: dict[str, Tokenizer] = request.app.state.tokenizers
    if info.name not in tokenizers:
        tokenizers[info.name] = load_tokenizer(info.name, info.model_dir, purpose)
    return tokenizers[info.name]


def _token_texts(request: Request, info: ModelInfo) -> TokenTexts:
    texts: dict[str, TokenTexts] = request.app.state.token_texts
    if info.name not in texts:
        texts[info.name] = TokenTexts(_tokenizer(request, info, "show the text of its tokens' log-probabilities"))
    return texts[info.name]


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
    shaper = ChoiceShaper(schema, chat, _token_texts(request, info) if schema.logprobs is not None else None)

    timing = request.app.state.metrics.request(info.name)

    def failed(exc: TritonFailure) -> ApiError:
        error = errors.from_triton(exc.status, exc.message, info.inputs, schema.params)
        timing.failed(error.status)
        return error

    if not streams:
        try:
            chunk = await _until_answered(request, backend.answer(info, inputs, envelope.id))
            whole = None if schema.stream else _piece(shaper, chunk)
        except TritonFailure as exc:
            raise failed(exc) from None
        except BaseException:
            timing.gone()
            raise
        timing.first_text()
        if whole is not None:
            timing.done(chunk.finish_reason, chunk.num_input_tokens, chunk.num_output_tokens)
            return JSONResponse(envelope.body(whole.text, chunk.finish_reason, _usage(chunk, schema), whole.logprobs))
        return _event_stream(_events(envelope, schema, shaper, chunk, None, failed, timing), timing)
    stream = backend.stream(info, inputs, envelope.id)
    try:
        first = await _until_answered(request, stream.__anext__())
    except BaseException as exc:
        stream.cancel()  # NOTE: where the model answered an error, this reads the call to its end instead
        if isinstance(exc, TritonFailure):
            raise failed(exc) from None
        timing.gone()
        raise
    return _event_stream(_events(envelope, schema, shaper, first, stream, failed, timing), timing)


def _event_stream(events: AsyncIterator[str], timing: RequestTiming) -> StreamingResponse:
    # NOTE: the background task ends `timing` also where the client left before the first event, when the
    # events' generator never started and so never reached its `finally`; after an end, a no-op
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(timing.gone),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(envelope: Envelope, schema: SchemaRequest, shaper: ChoiceShaper, first: Chunk,
                  rest: TritonStream | None, failed, timing: RequestTiming) -> AsyncIterator[str]:
    """The server-sent events of one answer whose first Chunk is `first` (see responses.py), shaped by
    `shaper`; `timing` ends with it: done, failed, or gone where the client left first."""
    usage_field = schema.include_usage

    def event(piece: Piece) -> str:
        if piece.text:
            timing.first_text()
        return sse(envelope.chunk(piece.text, with_usage_field=usage_field, logprobs=piece.logprobs))

    last = first
    try:
        if envelope.chat:
            yield sse(envelope.chunk("", role=True, with_usage_field=usage_field))
        if piece := _piece(shaper, first):
            yield event(piece)
        if rest is not None and not rest.ended:
            async for chunk in rest:
                last = chunk
                if piece := _piece(shaper, chunk):
                    yield event(piece)
        timing.done(last.finish_reason, last.num_input_tokens, last.num_output_tokens)
        yield sse(envelope.chunk(None if envelope.chat else "", last.finish_reason, with_usage_field=usage_field))
        if schema.include_usage:
            yield sse(envelope.usage_chunk(_usage(last, schema) or Usage(0, 0)))
        yield DONE
    except TritonFailure as exc:
        yield sse(failed(exc).body())
    finally:
        timing.gone()  # NOTE: a no-op where the answer ended above
        if rest is not None:
            rest.cancel()  # NOTE: a no-op once the final response came; the client left before it otherwise


def _piece(shaper: ChoiceShaper, chunk: Chunk) -> Piece:
    """The Chunk's piece of the choice; TritonFailure where the model's response lacks what it needs."""
    try:
        return shaper.piece(chunk)
    except MalformedResponse as exc:
        raise TritonFailure(None, str(exc)) from None


def _usage(chunk: Chunk, schema: SchemaRequest) -> Usage | None:
    """The answer's usage; a token generated only because the engine makes at least one (`echo` with
    `max_tokens: 0`) is not part of the answer, and not counted."""
    if chunk.num_input_tokens is None or chunk.num_output_tokens is None:
        return None
    return Usage(chunk.num_input_tokens, chunk.num_output_tokens if schema.keep_output else 0)


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
