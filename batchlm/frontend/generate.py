"""One completion or chat answered: each choice's Triton request sent, and their Chunks shaped into one
body, or one stream of server-sent events (responses.py).

    return await generate(request, models, info, schema, chat=True)

Every choice is a request of its own in the model (schema_request.py). A prompt's first choice is sent
first; where `n` > 1 and the model streams, the other n - 1 follow once it has its first token: its
prompt's KV blocks are in the prefix cache by then, so theirs are read from it, not computed again.
A model that does not stream (static_batching, dynamic_batching) is sent every choice at once.

Contracts:
- Every request is answered: a body, a stream that ends with `[DONE]`, or an error (an error after a
  stream began is its last event).
- An error that the model answers before a choice's first response (bad input, overload) is a plain
  HTTP error with its status, also for `stream: true`: the stream is opened only once every choice's
  first response is in. Any error cancels the choices' other requests.
- A client that leaves cancels its Triton requests, streamed or not (the gRPC calls are cancelled).
- `stream: true` to a model that cannot stream is sent without `stream`, and each choice's one answer
  streamed back as one chunk of text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from batchlm.frontend import errors
from batchlm.frontend.errors import ApiError
from batchlm.frontend.logprobs import ChoiceShaper, Piece
from batchlm.frontend.metrics import RequestTiming
from batchlm.frontend.responses import DONE, Choice, Envelope, Usage, sse
from batchlm.frontend.schema_request import SchemaRequest
from batchlm.frontend.served_models import ServedModels
from batchlm.frontend.triton_client import ModelInfo, TritonBackend, TritonFailure, TritonStream, infer_inputs
from batchlm.response_schema import Chunk, MalformedResponse

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Call:
    """One choice's Triton request once its first response is in: `first`, then `rest()` up to the final
    one. A model that does not stream answers once: `first` is the whole answer."""

    def __init__(self, first: Chunk, stream: TritonStream | None) -> None:
        self.first = first
        self._stream = stream

    async def rest(self) -> AsyncIterator[Chunk]:
        # NOTE: up to the final response, not to the call's end: cancel() reads the rest of the call
        while self._stream is not None and not self._stream.ended:
            yield await self._stream.__anext__()

    async def whole(self) -> Chunk:
        if self._stream is None:
            return self.first
        return Chunk.joined([self.first, *[chunk async for chunk in self.rest()]])

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()


async def generate(request: Request, models: ServedModels, info: ModelInfo, schema: SchemaRequest,
                   chat: bool) -> Response:
    """The answer to one completion (`chat` False) or chat completion, in the shape the caller asked for."""
    backend: TritonBackend = models.backend
    streams = schema.stream and info.decoupled and "stream" in info.inputs
    staged = schema.n > 1 and info.decoupled and "stream" in info.inputs
    inputs = [infer_inputs(info, {**fields, "stream": True} if streams or (staged and i % schema.n == 0)
                           else fields, schema.params) for i, fields in enumerate(schema.choices)]
    envelope = Envelope.new(info.name, chat)
    texts = models.token_texts(info) if schema.logprobs is not None else None
    echoes = await _echo_texts(models, info, schema)
    shapers = [ChoiceShaper(schema, chat, texts, echoes[i // schema.n]) for i in range(len(schema.choices))]
    timing = request.app.state.metrics.request(info.name)

    def failed(exc: TritonFailure) -> ApiError:
        error = errors.from_triton(exc.status, exc.message, info.inputs, schema.params)
        timing.failed(error.status)
        return error

    streams_opened: list[TritonStream] = []
    try:
        calls = await _until_answered(request, _start(backend, info, inputs, schema.n, envelope.id, streams_opened))
        if not schema.stream:
            chunks = await _until_answered(request, _all_of(call.whole() for call in calls))
            pieces = [_piece(shaper, chunk) for shaper, chunk in zip(shapers, chunks)]
    except BaseException as exc:
        for stream in streams_opened:
            stream.cancel()  # NOTE: where the model answered an error, this reads the call to its end instead
        if isinstance(exc, TritonFailure):
            raise failed(exc) from None
        timing.gone()
        raise
    if not schema.stream:
        timing.first_text()
        usage = _usage(chunks, schema)
        _done(timing, chunks, schema.n)
        return JSONResponse(envelope.body([Choice(p.text, c.finish_reason, p.logprobs)
                                           for p, c in zip(pieces, chunks)], usage))
    return _event_stream(_events(envelope, schema, shapers, calls, failed, timing), timing)


async def _echo_texts(models: ServedModels, info: ModelInfo, schema: SchemaRequest) -> list[str | None]:
    """What `echo` puts first in each prompt's choices: the prompt as sent, or the text of its token ids."""
    prompts = [schema.prompt(p * schema.n) for p in range(schema.prompts)]
    if not schema.echo:
        return [None] * len(prompts)
    if all(isinstance(p, str) for p in prompts):
        return prompts
    tokenizer = models.tokenizer(info, "echo a prompt of token ids")
    return [p if isinstance(p, str) else await asyncio.to_thread(tokenizer.decode, list(p)) for p in prompts]


async def _start(backend: TritonBackend, info: ModelInfo, inputs: list[list], n: int, request_id: str,
                 opened: list[TritonStream]) -> list[Call]:
    """Send each choice's request (`inputs`, in index order, `n` per prompt) and wait for its first
    response; every stream opened is added to `opened`, for the caller to cancel on a failure."""
    calls: list[Call | None] = [None] * len(inputs)

    async def send(index: int) -> None:
        rid = request_id if len(inputs) == 1 else f"{request_id}-{index}"
        if not info.decoupled:
            calls[index] = Call(await backend.answer(info, inputs[index], rid), None)
            return
        stream = backend.stream(info, inputs[index], rid)
        opened.append(stream)
        calls[index] = Call(await stream.__anext__(), stream)

    async def prompt(first: int) -> None:
        if info.decoupled:
            await send(first)
            await _all_of(send(i) for i in range(first + 1, first + n))
        else:
            await _all_of(send(i) for i in range(first, first + n))

    await _all_of(prompt(first) for first in range(0, len(inputs), n))
    return calls


async def _all_of(work: Iterable[Awaitable[T]]) -> list[T]:
    """Each result, the work run concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # NOTE: the cancellations reach the gRPC calls
        raise


def _event_stream(events: AsyncIterator[str], timing: RequestTiming) -> StreamingResponse:
    # NOTE: the background task ends `timing` also where the client left before the first event, when the
    # events' generator never started and so never reached its `finally`; after an end, a no-op
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(timing.gone),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(envelope: Envelope, schema: SchemaRequest, shapers: list[ChoiceShaper], calls: list[Call],
                  failed: Callable[[TritonFailure], ApiError], timing: RequestTiming) -> AsyncIterator[str]:
    """The server-sent events of an answer whose choices' requests are `calls` (see responses.py), each
    shaped by its `shapers`; `timing` ends with it: done, failed, or gone where the client left first."""
    usage_field = schema.include_usage
    lasts = [call.first for call in calls]
    queue: asyncio.Queue[tuple[int, Chunk | TritonFailure | None]] = asyncio.Queue()

    def event(index: int, piece: Piece) -> str:
        if piece.text:
            timing.first_text()
        return sse(envelope.chunk(piece.text, index=index, with_usage_field=usage_field, logprobs=piece.logprobs))

    def finish(index: int) -> str:
        return sse(envelope.chunk(None if envelope.chat else "", lasts[index].finish_reason, index=index,
                                  with_usage_field=usage_field))

    async def pump(index: int, call: Call) -> None:
        try:
            async for chunk in call.rest():
                await queue.put((index, chunk))
            await queue.put((index, None))
        except TritonFailure as exc:
            await queue.put((index, exc))

    pumps: list[asyncio.Task] = []
    try:
        for index in range(len(calls)) if envelope.chat else ():
            yield sse(envelope.chunk("", index=index, role=True, with_usage_field=usage_field))
        for index, call in enumerate(calls):
            if piece := _piece(shapers[index], call.first):
                yield event(index, piece)
        running = {i for i, chunk in enumerate(lasts) if not chunk.finish_reason}
        for index in sorted(set(range(len(calls))) - running):
            yield finish(index)
        pumps = [asyncio.ensure_future(pump(i, calls[i])) for i in sorted(running)]
        while running:
            index, item = await queue.get()
            if isinstance(item, TritonFailure):
                raise item
            if item is None:
                running.discard(index)
                yield finish(index)
                continue
            lasts[index] = item
            if piece := _piece(shapers[index], item):
                yield event(index, piece)
        _done(timing, lasts, schema.n)
        if schema.include_usage:
            yield sse(envelope.usage_chunk(_usage(lasts, schema) or Usage(0, 0)))
        yield DONE
    except TritonFailure as exc:
        yield sse(failed(exc).body())
    finally:
        timing.gone()  # NOTE: a no-op where the answer ended above
        for task in pumps:
            task.cancel()
        for call in calls:
            call.cancel()  # NOTE: a no-op once the final response came; the client left before it otherwise


def _piece(shaper: ChoiceShaper, chunk: Chunk) -> Piece:
    """The Chunk's piece of the choice; TritonFailure where the model's response lacks what it needs."""
    try:
        return shaper.piece(chunk)
    except MalformedResponse as exc:
        raise TritonFailure(None, str(exc)) from None


def _usage(lasts: list[Chunk], schema: SchemaRequest) -> Usage | None:
    """The answer's usage, from each choice's last Chunk: each prompt's tokens once (and those of them
    read from the prefix cache, as its first choice counts them), every choice's generated tokens. A token
    generated only because the engine makes at least one (`echo` with `max_tokens: 0`) is not part of the
    answer, and not counted."""
    firsts = lasts[::schema.n]
    if any(c.num_input_tokens is None or c.num_output_tokens is None for c in lasts):
        return None
    cached = None if any(c.num_cached_tokens is None for c in firsts) else sum(c.num_cached_tokens for c in firsts)
    return Usage(sum(c.num_input_tokens for c in firsts),
                 sum(c.num_output_tokens for c in lasts) if schema.keep_output else 0, cached)


def _done(timing: RequestTiming, lasts: list[Chunk], n: int) -> None:
    """`timing` done: each prompt's tokens once, every choice's generated tokens."""
    outputs = [c.num_output_tokens for c in lasts if c.num_output_tokens is not None]
    timing.done(lasts[0].finish_reason, sum(c.num_input_tokens or 0 for c in lasts[::n]),
                sum(outputs) if outputs else None, max(outputs, default=None))


async def _until_answered(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (so are its Triton requests)
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
