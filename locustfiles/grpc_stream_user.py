"""Locust user on Triton's gRPC streaming API, built on tritonclient made gevent-safe.

    locust -f locustfiles/grpc_stream_user.py --host 127.0.0.1:8001 --model continuous_batching

A decoupled model (continuous_batching) answers over the bidirectional stream with one or many
responses per request; static_batching and dynamic_batching (not decoupled) answer it with one response.
TTFT is the arrival of the first response carrying output, E2E the final one. Options and events: see
common.py.
"""

from __future__ import annotations

import queue
import time

# NOTE: locust has monkey-patched the standard library (threads, queues, sockets) by now; gRPC must
# be told to cooperate with gevent before any channel exists, or its calls block the whole process.
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, task

grpc_gevent.init_gevent()

import common  # noqa: E402 - after gevent is initialised
import tritonclient.grpc as grpcclient  # noqa: E402 - after gevent is initialised
from tritonclient.utils import InferenceServerException  # noqa: E402 - after gevent is initialised

from batchlm_client.triton_llm import chunk_from_grpc, grpc_inputs, grpc_model_config  # noqa: E402 - after gevent is initialised


class TritonGrpcStreamUser(User):
    """One closed-loop client with its own tritonclient gRPC connection; one request in flight."""

    host = "127.0.0.1:8001"
    wait_time = constant(0)

    def __init__(self, environment) -> None:
        super().__init__(environment)
        self.options = common.LoadOptions.from_environment(environment)
        self.feed = common.feed_for(self.options.spec)
        self.triton: grpcclient.InferenceServerClient | None = None
        self.config: dict = {}  # the model's config: batched or not, input datatypes

    def on_start(self) -> None:
        url = self.host.split("://", 1)[-1]  # tritonclient takes host:port, no scheme
        self.triton = grpcclient.InferenceServerClient(url)
        try:
            self.config = grpc_model_config(self.triton, self.options.model, self.options.request_timeout)
        except BaseException:
            # NOTE: Locust does not call on_stop for a user whose on_start failed, and an open channel
            # keeps the process from exiting after the run (server unreachable, unknown model).
            self.on_stop()
            raise

    def on_stop(self) -> None:
        if self.triton is not None:
            self.triton.close()
            self.triton = None

    @task
    def generate(self) -> None:
        timer = common.RequestTimer(self.environment, f"grpc {self.options.model}")
        inputs = grpc_inputs(self.options.body(self.feed.next()), self.config)
        responses: queue.Queue = queue.Queue()
        self.triton.start_stream(callback=lambda result, error: responses.put((result, error)),
                                 stream_timeout=self.options.request_timeout)
        ended = False  # the server sent the request's last response (or its error)
        try:
            self.triton.async_stream_infer(self.options.model, inputs, enable_empty_final_response=True)
            tokens, error, ended = self._drain(responses, timer)
        except Exception as exc:  # noqa: BLE001 - a broken stream is this request's failure, not the task's
            tokens, error = 0, common.broken(exc)
        finally:
            # NOTE: cancels the request on the server if this user is stopped mid-request or timed out;
            # never a finished one: cancelling a stream whose last response had arrived left tritonserver
            # 2.51 holding the model, which then never finished unloading (docs/operations.md).
            self.triton.stop_stream(cancel_requests=not ended)
        timer.done(tokens, error)
        if error is not None:
            time.sleep(self.options.failure_wait)  # gevent's sleep: locust has patched time

    def _drain(self, responses: queue.Queue, timer: common.RequestTimer) -> tuple[int, Exception | None, bool]:
        """Read responses until the final one: output tokens, the failure (None on success), and whether
        the server ended the request (False after a timeout)."""
        tokens = 0
        while True:
            try:
                result, error = responses.get(timeout=self.options.request_timeout)
            except queue.Empty:
                return tokens, common.ServerError(f"[timeout] no response in {self.options.request_timeout}s"), False
            if error is not None:
                return tokens, _failure(error), True
            response = result.get_response()
            if response.outputs:
                chunk = chunk_from_grpc(result)
                tokens = chunk.num_output_tokens
                if chunk.text or tokens:
                    timer.first_output(tokens)
            final = response.parameters.get("triton_final_response")
            if final is None or final.bool_param:  # no flag: a non-decoupled model's only response
                return tokens, None, True


def _failure(error: InferenceServerException) -> Exception:
    # NOTE: an error the model sends on the stream carries no gRPC status, only Triton's message.
    status = error.status() or "stream"
    return common.failure(str(status), error.message() or str(error))
