"""The front of a TensorRT-LLM engine: this repository's request schema in, the engine's token ids out.

`continuous_batching_trtllm` is a decoupled Python model in front of the `tensorrt_llm` model
(TensorRT-LLM's Triton backend, in-flight batching on a GPU). The engine schedules per step; this
front only translates, so clients see the same schema, text, stop strings, finish reasons, counters
and streaming as from `continuous_batching`, and the same benchmark measures both.

Per request, one worker thread: tokenize, send the ids to the engine (`TokenBackend.generate`), feed
every id it returns through a `Sequence` (incremental detokenizing, stop strings, EOS, max_tokens) and
send text as a `StreamBuffer` says. The engine streams its ids when the client streams or the request
has stop strings (they are matched as the text grows); otherwise it answers once. When the text ends
early (a stop string) or the client cancelled (a `CancellationWatcher` asks), the engine request is
stopped by id (`TokenBackend.stop`) and its remaining responses are drained unread. `close()` stops
every engine request and answers each client UNAVAILABLE that had no final response yet. A `BlsReaper`,
when given, is released by the watcher's cancellation checks (see `batchlm.backend.trtllm.bls_reaper`
for why the backend's finished BLS calls must wait there).

A request the engine streams, once begun, is answered every engine step. When the engine then sends
nothing for `engine_silence_timeout_ms`, a sweep thread ends the request here: the client gets an
INTERNAL error (`EngineSilent`), the engine a `stop`, and the request's slot is freed. Its worker stays
blocked in the engine call until that ends, which on tritonserver 2.51 it never does: there a streamed
engine error is lost (see `batchlm.backend.trtllm.bls`).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from batchlm.engine.request_output import RequestOutput
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import check_fits
from batchlm.engine.sequence import FinishReason, Sequence
from batchlm.errors import InvalidArgument
from batchlm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from batchlm.backend import triton_io
from batchlm.backend.batching_service import BatchingService
from batchlm.backend.cancellation_watcher import CancellationWatcher
from batchlm.backend.metrics import ModelMetrics
from batchlm.backend.triton_io import GenerateRequest
from batchlm.backend.stream_buffer import StreamBuffer
from batchlm.backend.trtllm import protocol as trtllm_protocol
from batchlm.backend.trtllm.bls_reaper import BlsReaper
from batchlm.backend.trtllm.front_config import TrtllmFrontConfig


class BackendError(RuntimeError):
    """The engine answered a request with an error; the message is the engine's."""


class EngineSilent(RuntimeError):
    """The engine, having begun streaming a request, sent nothing for the silence timeout."""


class TokenBackend(Protocol):
    """What the front needs from the engine (`batchlm.backend.trtllm.bls.TrtllmBls` in Triton)."""

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: bool,
                 on_sent: Callable[[], None] = lambda: None) -> Iterator[list[int]]:
        """Start a request; yield the new ids of each response until the engine's final one.
        `on_sent()` is called once the request has been handed to the engine (on the first `next()`):
        a stop sent before that finds nothing to end. Raises BackendError on an error response."""
        ...

    def stop(self, request_id: str) -> None:
        """Ask the engine to end a running request early (its iterator then ends soon)."""
        ...


@dataclass
class _Flight:
    """One request between its submit and its final response; owned by its worker thread."""

    request_id: str
    request: GenerateRequest
    sender: object
    arrival: float
    seq: Sequence
    buffer: StreamBuffer
    cancelled: threading.Event = field(default_factory=threading.Event)  # set by the watcher
    worker: threading.Thread | None = None  # serves this request (set at submit)
    answered: bool = False  # the final response was sent (or is being sent); set under answer_lock
    answer_lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: bool = False  # a stop request was sent to the engine after it had the request
    stop_wanted: bool = False  # the engine request is to be stopped (sent at once, or once it is sent)
    sent: bool = False  # the engine has the request (set by the worker through on_sent)
    engine_streams: bool = False  # the engine answers every step (set by the worker before it asks)
    last_response: float | None = None  # monotonic time of the engine's last response; None before its first


class TrtllmFrontService(BatchingService):
    """The front runs no engine of its own, so it never stops: a failed request fails alone."""

    def __init__(self, model_name: str, config: TrtllmFrontConfig, tokenizer: Tokenizer, backend: TokenBackend,
                 metrics: ModelMetrics, reaper: BlsReaper | None = None) -> None:
        super().__init__(model_name, metrics)
        self._config = config
        self._tokenizer = tokenizer
        self._end_id = trtllm_protocol.end_id(tokenizer.eos_token_ids)  # the one the engine stops at
        self._backend = backend
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]  # NOTE: engine request ids must be unique across instances
        self._flights: dict[str, _Flight] = {}  # guarded by _lock
        self._watcher = CancellationWatcher(config.cancellation_check_period_ms / 1000, self._on_cancelled,
                                            name="batchlm-trtllm-cancel-watch", reaper=reaper)
        self._stop_sweep = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_silent, name="batchlm-trtllm-silence", daemon=True)
        self._sweeper.start()

    # -- Triton's execute thread ------------------------------------------------------------
    def submit(self, raw_request) -> None:
        """Parse, tokenize and start one request on its own worker; errors are answered at once."""
        sender = raw_request.get_response_sender()
        arrival = time.monotonic()
        try:
            request = triton_io.parse_request(raw_request)
            prompt_ids = triton_io.check_fits(self, request)
            trtllm_protocol.check_params(request.params)
        except InvalidArgument as exc:
            triton_io.send_final(sender, triton_io.error_response(exc))
            return
        request_id = f"{self._prefix}-{next(self._ids)}"
        seq = Sequence(request_id, prompt_ids, request.params, self._tokenizer.eos_token_ids,
                       IncrementalDetokenizer(self._tokenizer, prompt_ids))
        flight = _Flight(request_id, request, sender, arrival, seq,
                         StreamBuffer(request.stream, self._config.stream_interval))
        with self._lock:
            error = self._refusal()
            if error is None and len(self._flights) >= self._config.max_in_flight:
                error = self._overloaded(self._config.max_in_flight, "in flight")
            if error is None:
                self._flights[request_id] = flight
                flight.worker = threading.Thread(target=self._serve, args=(flight,), name=f"batchlm-{request_id}",
                                                 daemon=True)
                in_flight = len(self._flights)
        if error is not None:
            triton_io.send_final(sender, triton_io.error_response(error))
            return
        self._watcher.watch(request_id, sender)
        self._record(self._metrics.record_in_flight, in_flight)
        flight.worker.start()

    def check_fits(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or InvalidArgument unless they are the tokenizer's and prompt + max_tokens
        fits `max_model_len`."""
        if isinstance(prompt, str):
            prompt_ids = self._tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            vocab = self._tokenizer.vocab_size
            if not all(0 <= t < vocab for t in prompt_ids):
                raise InvalidArgument("prompt", f"token ids must be integers in [0, {vocab})")
        check_fits(len(prompt_ids), params.max_tokens, self._config.max_model_len)
        return prompt_ids

    def _drain(self, deadline: float) -> None:
        """Stop the engine's requests and the workers; a client that got no final response by then gets
        UNAVAILABLE from its worker."""
        with self._lock:
            flights = list(self._flights.values())
        self._watcher.close(max(0.0, deadline - time.monotonic()))
        self._stop_sweep.set()
        self._sweeper.join(max(0.0, deadline - time.monotonic()))
        for flight in flights:
            self._stop_engine_request(flight)
        for flight in flights:
            if flight.worker.ident is not None:  # NOTE: submit() starts it just after registering it
                flight.worker.join(max(0.0, deadline - time.monotonic()))

    # -- the watcher's thread ---------------------------------------------------------------
    def _on_cancelled(self, request_ids: list[str]) -> None:
        with self._lock:
            flights = [self._flights[r] for r in request_ids if r in self._flights]
        for flight in flights:
            flight.cancelled.set()
            self._stop_engine_request(flight)

    # -- a worker thread, one per request ------------------------------------------------------
    def _serve(self, flight: _Flight) -> None:
        try:
            # NOTE: stop strings are matched as tokens come, so a request with any asks the engine to stream
            flight.engine_streams = flight.request.stream or bool(flight.request.params.stop)
            if self._gone(flight):  # cancelled or closing before the engine was asked: it never is
                return
            for new_ids in self._backend.generate(flight.request_id, list(flight.seq.prompt_ids),
                                                  flight.request.params, flight.engine_streams,
                                                  on_sent=lambda: self._on_sent(flight)):
                flight.last_response = time.monotonic()
                if not flight.answered:
                    self._on_tokens(flight, new_ids)
            if not flight.answered:
                self._on_engine_done(flight)
        except Exception as exc:  # noqa: BLE001 - answer this client, keep the model serving
            if not flight.answered:
                triton_io.log_error(f"{self._name}: request {flight.request_id} failed: {exc!r}")
                self._answer(flight, triton_io.error_response(exc))
        finally:
            self._watcher.unwatch(flight.request_id)
            with self._lock:
                self._flights.pop(flight.request_id, None)
                in_flight = len(self._flights)
            self._record(self._metrics.record_in_flight, in_flight)

    def _on_sent(self, flight: _Flight) -> None:
        """The engine has the request now: a stop asked for before (a cancel or a close in between)
        found nothing to end then, so it is sent again."""
        flight.sent = True
        if flight.stop_wanted:
            self._stop_engine_request(flight)

    def _on_tokens(self, flight: _Flight, new_ids: list[int]) -> None:
        if self._gone(flight):
            return
        seq = flight.seq
        if new_ids and seq.num_output_tokens == 0:
            self._record(self._metrics.record_first_token, time.monotonic() - flight.arrival)
        taken = 0
        for token_id in new_ids:
            if seq.is_finished:
                break
            seq.append_token(token_id)
            taken += 1
        self._record(self._metrics.record_tokens, taken)
        out = RequestOutput.take(seq)
        if seq.is_finished:
            self._answer(flight, triton_io.output_response(flight.buffer.take(out), batched=False))
            if self._engine_still_generating(seq):
                self._stop_engine_request(flight)
            return
        due = flight.buffer.take(out)
        if due is not None and not triton_io.send_quietly(
                flight.sender, triton_io.output_response(due, batched=False)):
            flight.cancelled.set()  # the client is gone
            self._stop_engine_request(flight)

    def _engine_still_generating(self, seq: Sequence) -> bool:
        """The front ended the text (a stop string, or an EOS id other than the engine's `end_id`): the
        engine, which stops only at its `end_id` or max_tokens, goes on."""
        return (seq.finish_reason is FinishReason.STOP
                and not trtllm_protocol.engine_ends_by_itself(seq.output_ids, seq.params, self._end_id))

    def _on_engine_done(self, flight: _Flight) -> None:
        """The engine sent its final response and the text has not ended: finish it here."""
        if self._gone(flight):
            return
        seq = flight.seq
        # NOTE: an engine that ends before max_tokens met its end_id (EOS), which it may leave out of output_ids
        seq.finish(FinishReason.LENGTH if seq.num_output_tokens >= seq.params.max_tokens else FinishReason.STOP)
        out = RequestOutput.take(seq)
        self._answer(flight, triton_io.output_response(flight.buffer.take(out), batched=False))

    def _gone(self, flight: _Flight) -> bool:
        """Answer a request whose client cancelled (an empty final) or whose model is closing
        (UNAVAILABLE); True if it was answered so."""
        if flight.cancelled.is_set():
            self._answer(flight, None)
        elif self._closed:
            self._answer(flight, triton_io.error_response(self._unloaded()))
        return flight.answered

    def _answer(self, flight: _Flight, response) -> bool:
        """Send the final response, once: False if the request was answered already (the worker and the
        silence sweep may both try)."""
        with flight.answer_lock:
            if flight.answered:
                return False
            flight.answered = True
        # NOTE: unwatch before the final send: Triton frees the sender once its final response is sent
        self._watcher.unwatch(flight.request_id)
        triton_io.send_final_quietly(flight.sender, response)
        return True

    # -- the silence sweep's thread --------------------------------------------------------------
    def _sweep_silent(self) -> None:
        """End the requests whose engine went silent after it began streaming them; and, while any
        request is in flight, push the metrics: requests the engine answers once record nothing until
        they end, so the in-flight gauge of a burst would read its first request until then."""
        limit = self._config.engine_silence_timeout_ms / 1000
        while not self._stop_sweep.wait(min(1.0, limit / 4)):
            now = time.monotonic()
            with self._lock:
                silent = [f for f in self._flights.values() if f.engine_streams and f.last_response is not None
                          and now - f.last_response > limit and not f.answered]
                busy = bool(self._flights)
            if busy:  # NOTE: quietly: this thread must live on, it ends silent requests
                self._record(self._metrics.flush)
            for flight in silent:
                self._end_silent(flight, now - flight.last_response)

    def _end_silent(self, flight: _Flight, silence: float) -> None:
        error = EngineSilent(
            f"{self._name}: the engine sent nothing for {silence:.1f} s after {flight.seq.num_output_tokens} "
            f"tokens of request {flight.request_id}; it was ended here (on tritonserver 2.51 an engine error "
            "after streamed tokens never arrives)")
        if not self._answer(flight, triton_io.error_response(error)):
            return
        triton_io.log_error(str(error))
        self._stop_engine_request(flight)
        with self._lock:  # free the slot; the worker, still waiting on the engine, no longer holds it
            self._flights.pop(flight.request_id, None)
            in_flight = len(self._flights)
        self._record(self._metrics.record_in_flight, in_flight)

    def _stop_engine_request(self, flight: _Flight) -> None:
        """Stop the engine's request, now if the engine has it, else as soon as the worker has sent it
        (`_on_sent`). Without the latter, a stop that came before the request would find nothing, still
        count as sent, and the engine would run the request to max_tokens."""
        # NOTE: the worker, the watcher and close() may race here; a second stop for an id is harmless.
        # stop_wanted is set before sent is read here, and sent before stop_wanted is read in
        # _on_sent, so one of the two sends it.
        flight.stop_wanted = True
        if flight.stopped or not flight.sent:
            return
        flight.stopped = True
        try:
            self._backend.stop(flight.request_id)
        except Exception as exc:  # noqa: BLE001 - the request may have ended meanwhile
            triton_io.log_verbose(f"{self._name}: stopping {flight.request_id}: {exc!r}")
