"""A stand-in for TensorRT-LLM's Triton backend, for tests only: its tensor contract over batchlm's engine.

TensorRT-LLM needs a GPU, which these machines lack. `tests/functional/test_trtllm_front.py` serves this
file as the `tensorrt_llm` model, under the shipped config's inputs and outputs, so that
`continuous_batching_trtllm` runs end to end through a real tritonserver: BLS calls, request ids,
streaming, `stop` requests. What it takes from the contract (see batchlm.backend.trtllm.protocol):
`input_ids`, `input_lengths`, `request_output_len`, `end_id` (absent: generate past EOS),
`runtime_top_k` 1 = greedy, `temperature` / `runtime_top_k` / `runtime_top_p`, `random_seed`,
`streaming`, and `stop`, which ends the running request that has the same request id. Responses carry
only generated ids (`exclude_input_in_output`): each step's new ones when streaming.
Every request it stops is logged as "stand-in stopped <id>", for the tests to find. Its parameters are
`continuous_batching`'s (the test copies them), so the engine behind the front is that model's engine.
Test hook (parameters `failing_output_len`, `failing_after`): a request for exactly that many tokens is
aborted after `failing_after` of them and answered with an error (streamed, those tokens were sent
first), as the backend answers a request that fails inside the engine.
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# NOTE: the engine's modules (torch) are imported where used, as in the project's model.py files

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _value(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _ids_response(ids):
    ids = np.array(ids, dtype=np.int32).reshape(1, 1, -1)
    return pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", ids),
                                       pb_utils.Tensor("sequence_length", np.array([[ids.shape[-1]]], np.int32))])


def _params(request):
    top_k = _value(request, "runtime_top_k")
    greedy = top_k is not None and int(top_k) == 1
    values = {"max_tokens": int(_value(request, "request_output_len")),
              "ignore_eos": _value(request, "end_id") is None}
    if not greedy:
        for name, key, cast in (("temperature", "temperature", float), ("runtime_top_k", "top_k", int),
                                ("runtime_top_p", "top_p", float)):
            if _value(request, name) is not None:
                values[key] = cast(_value(request, name))
        values.setdefault("temperature", 1.0)
    if _value(request, "random_seed") is not None:
        values["seed"] = int(_value(request, "random_seed"))
    from batchlm.engine.sampling import SamplingParams

    return SamplingParams(**values)


class TritonPythonModel:
    def initialize(self, args):
        from batchlm.engine.engine import LLMEngine
        from batchlm.engine.owner_thread import OwnerThread
        from batchlm.backend.serving_config import ServingConfig
        from batchlm.backend.triton_io import resolve_model_dir

        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self._failing_output_len = int(params.pop("failing_output_len"))
        self._failing_after = int(params.pop("failing_after"))
        serving = ServingConfig.from_parameters(params)  # continuous_batching's engine settings
        model_dir = resolve_model_dir(serving.model_dir)
        self._lock = threading.Condition()
        self._inbox = []  # ("add", id, ids, params, stream, sender) or ("stop", id); guarded by _lock
        self._closed = False
        self._senders = {}  # request id -> (sender, stream, ids so far, max_tokens); owned by the engine thread
        self._thread = OwnerThread("standin-engine", lambda: LLMEngine(model_dir, serving.engine), self._run)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            request_id = request.request_id()
            if _value(request, "stop"):
                with self._lock:
                    self._inbox.append(("stop", request_id))
                    self._lock.notify()
                sender.send(flags=FINAL)
                continue
            length = int(_value(request, "input_lengths"))
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)[:length]
            ids = [int(t) for t in ids]
            stream = bool(_value(request, "streaming") or False)
            try:
                entry = ("add", request_id, ids, _params(request), stream, sender)
            except Exception as exc:  # noqa: BLE001 - answered as the real backend would: an error
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                continue
            with self._lock:
                self._inbox.append(entry)
                self._lock.notify()
        return None

    def finalize(self):
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(10)

    def _run(self, engine):
        while True:
            with self._lock:
                while not self._closed and not self._inbox and not engine.has_unfinished():
                    self._lock.wait()
                if self._closed:
                    for sender, *_ in self._senders.values():
                        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("unloaded")), flags=FINAL)
                    return
                inbox, self._inbox = self._inbox, []
            for entry in inbox:
                if entry[0] == "stop":
                    if entry[1] in self._senders:
                        pb_utils.Logger.log_info(f"stand-in stopped {entry[1]}")
                        engine.abort_request(entry[1])
                    continue
                _, request_id, ids, params, stream, sender = entry
                engine.add_request(request_id, ids, params)
                self._senders[request_id] = (sender, stream, [], params.max_tokens)
            for out in engine.step() if engine.has_unfinished() else []:
                if out.request_id not in self._senders:  # failed by the test hook: its CANCELLED output
                    continue
                sender, stream, so_far, max_tokens = self._senders[out.request_id]
                so_far.extend(out.token_ids)
                if (not out.finished and len(so_far) >= self._failing_after
                        and max_tokens == self._failing_output_len):
                    if stream and out.token_ids:
                        sender.send(_ids_response(out.token_ids))
                    engine.abort_request(out.request_id)
                    del self._senders[out.request_id]
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"stand-in failed {out.request_id} after {len(so_far)} tokens")), flags=FINAL)
                    continue
                if out.finished:
                    del self._senders[out.request_id]
                    sender.send(_ids_response(out.token_ids if stream else so_far), flags=FINAL)
                elif stream and out.token_ids:
                    sender.send(_ids_response(out.token_ids))
