"""TrtllmBls: the `TokenBackend` of `continuous_batching_trtllm`, as Triton BLS calls to the engine model.

Imported only inside the backend stub (needs triton_python_backend_utils). The tensors are
`batchlm.backend.trtllm.protocol`'s. Each request is one decoupled BLS call that this thread iterates;
the Python backend of tritonserver 2.51 has no way to cancel a BLS call from the caller's side, so a
request is ended early the way TensorRT-LLM's backend offers: a second request with the same request id
and `stop` set.

Every call's iterator is read to its final response (an iterator left unfinished is never freed by the
stub) and then handed to the `BlsReaper`, never dropped here: see `batchlm.backend.trtllm.bls_reaper` for the
stub's heap corruption that dropping it here causes.

Known defect of tritonserver 2.51 (python_backend r24.10, fixed in r25.04): a BLS error response that is
not a call's first is saved without its call's id, so it never reaches this iterator, which then waits
for ever. An engine error after streamed tokens therefore leaves its worker waiting
(`python -m tests.functional.bls_threads_repro --fail-at 1`); the front's silence sweep answers the client and frees the
slot (`TrtllmFrontService`, `engine_silence_timeout_ms`). An error as the first response (not streamed,
or before any token) arrives. The lost response is filed by the stub as a call of its own; after two or
more, the stub may deadlock while it destroys them at unload (before `finalize` is called), so the
server waits out its exit timeout (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import triton_python_backend_utils as pb_utils

from batchlm.engine.sampling import SamplingParams
from batchlm.backend.trtllm import protocol as trtllm_protocol
from batchlm.backend.trtllm.bls_reaper import BlsReaper
from batchlm.backend.trtllm.service import BackendError


class TrtllmBls:
    def __init__(self, model_name: str, eos_token_id: int | None, pad_token_id: int, reaper: BlsReaper) -> None:
        self.model_name = model_name
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.reaper = reaper

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: bool,
                 on_sent: Callable[[], None] = lambda: None) -> Iterator[list[int]]:
        inputs = trtllm_protocol.request_inputs(prompt_ids, params, stream, self.eos_token_id, self.pad_token_id)
        responses = self._exec(request_id, inputs)
        finished = False
        try:
            # NOTE: a stop exec'd from now on reaches the engine model after this request (one queue);
            # called inside the try, so that even if it raised, the responses are read and retired
            on_sent()
            for response in responses:
                if response.has_error():
                    raise BackendError(f"{self.model_name}: {response.error().message()}")
                yield trtllm_protocol.new_token_ids(_output(response, "output_ids"),
                                                    _output(response, "sequence_length"))
            finished = True
        finally:
            if not finished:  # an error response, or the caller let go early: end the request, read its rest
                try:
                    self.stop(request_id)  # NOTE: an error is usually final; then this stop finds nothing to end
                except Exception:  # noqa: BLE001 - the request may have ended, or the engine model be unloading
                    pass
                for _ in responses:
                    pass
            self.reaper.retire(responses)

    def stop(self, request_id: str) -> None:
        responses = self._exec(request_id, trtllm_protocol.stop_inputs())
        try:
            errors = [response.error().message() for response in responses if response.has_error()]
        finally:
            self.reaper.retire(responses)
        if errors:
            raise BackendError(f"{self.model_name}: stop: {errors[0]}")

    def _exec(self, request_id: str, inputs: dict):
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, request_id=request_id,
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            requested_output_names=list(trtllm_protocol.BACKEND_OUTPUTS))
        return request.exec(decoupled=True)


def _output(response, name: str):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()
