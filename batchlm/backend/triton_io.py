"""Triton Python-backend glue shared by every model.py: read requests, build responses and errors,
read `config.pbtxt` parameters. Imported only inside the backend stub (needs triton_python_backend_utils).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from batchlm.engine.request_output import RequestOutput
from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument, TimedOut, Unavailable
from batchlm.paths import served_model
from batchlm.request_schema import INPUTS, OUTPUTS, check_parameters, parse_inputs
from batchlm.response_schema import logprob_outputs
from batchlm.backend.serving_config import ServingConfig


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed, validated generation request."""

    prompt: str | list[int]  # text_input, or input_ids
    params: SamplingParams
    stream: bool


def model_config(args: dict) -> dict:
    return json.loads(args["model_config"])


def parameters(config: dict) -> dict[str, str]:
    """`parameters { key: "..." value: { string_value: "..." } }` as a plain dict."""
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def resolve_model_dir(value: str) -> Path:
    """The checkpoint a model serves (batchlm.paths.served_model): a Hugging Face folder or a GGUF file."""
    from batchlm.model.gguf_file import is_gguf

    path = served_model(value)
    if not (path.is_file() if is_gguf(path) else (path / "config.json").exists()):
        raise ValueError(f"parameter model_dir: no checkpoint at {path} (run `make setup`)")
    return path


def parse_request(request) -> GenerateRequest:
    """Parse one pb_utils.InferenceRequest; raises InvalidArgument naming the field, also for a request
    parameter (a JSON field of `/generate` that matches no input)."""
    check_parameters(json.loads(request.parameters() or "{}"))
    inputs = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return generate_request(parse_inputs(inputs))


def generate_request(fields: Mapping[str, object]) -> GenerateRequest:
    """The request of parsed fields (request_schema.parse_inputs); SamplingParams checks the ranges of
    its fields and raises InvalidArgument naming the field."""
    sampling = {name: value for name, value in fields.items() if name not in ("text_input", "input_ids", "stream")}
    prompt = fields["text_input"] if "text_input" in fields else list(fields["input_ids"])
    return GenerateRequest(prompt=prompt, params=SamplingParams(**sampling),
                           stream=fields.get("stream", INPUTS["stream"].default))


def parse_request_level(request, generator, model_name: str) -> GenerateRequest:
    """Parse a request for a request-level batcher (static, dynamic): it cannot stream, and its
    prompt + max_tokens must fit one row of the KV reservation. Raises InvalidArgument."""
    parsed = parse_request(request)
    if parsed.stream:
        raise InvalidArgument("stream", f"{model_name} cannot stream: it answers once, when its whole batch "
                              "is done; use continuous_batching for stream=true")
    check_fits(generator.engine, parsed)
    return parsed


def check_fits(engine, parsed: GenerateRequest) -> list[int]:
    """`engine.check_fits(prompt, params)` on the request (an LLMEngine, or the TensorRT-LLM front): the
    prompt's token ids, or InvalidArgument naming a refused prompt as the input the client sent,
    `text_input` or `input_ids`. Every model checks a request's size here, so the input is named in this one
    place."""
    try:
        return engine.check_fits(parsed.prompt, parsed.params)
    except InvalidArgument as exc:
        if exc.field == "prompt":
            raise InvalidArgument("text_input" if isinstance(parsed.prompt, str) else "input_ids",
                                  exc.message) from None
        raise


def deadline(request, arrival: float) -> float | None:
    """When `request` must be done by, on the `time.monotonic()` clock: `arrival` plus its Triton
    per-request `timeout` in microseconds (gRPC and HTTP `/infer` clients set it, and Triton reads it;
    a `/generate` body's `timeout` field arrives as a request parameter, checked by parse_request), or
    None without one."""
    micros = request.timeout() or json.loads(request.parameters() or "{}").get("timeout", 0)
    return arrival + micros / 1e6 if micros else None


def timed_out(model_name: str, waited: float) -> TimedOut:
    return TimedOut(f"{model_name}: request timeout expired after {waited:.2f} s; the request left "
                    "the model without an answer")


def left_batch_response(model_name: str, deadline: float | None, since: float,
                        now: float) -> "pb_utils.InferenceResponse":
    """The answer to a row that left its running batch early: UNAVAILABLE "request timeout expired" if
    its `deadline` has passed (it has waited `now - since`), else CANCELLED (its client cancelled)."""
    if deadline is not None and now >= deadline:
        return error_response(timed_out(model_name, now - since))
    return cancelled_response(model_name)


def output_response(out: RequestOutput, batched: bool) -> "pb_utils.InferenceResponse":
    """A response carrying the text, ids and counters of `out` and the log-probabilities its request asks
    for; `batched` adds the batch dimension."""
    reason = out.finish_reason.value if out.finish_reason is not None else ""
    values = {"text_output": out.text.encode(), "finish_reason": reason.encode(),
              "num_input_tokens": out.num_prompt_tokens, "num_output_tokens": out.num_output_tokens,
              "num_cached_tokens": out.num_cached_tokens}
    arrays = {name: np.array([value], dtype=OUTPUTS[name].data_type.dtype) for name, value in values.items()}
    arrays.update(logprob_outputs("output", out.token_ids, out.logprobs))
    if out.prompt_logprobs is not None:
        arrays.update(logprob_outputs("prompt", out.prompt_ids, out.prompt_logprobs))
    tensors = [pb_utils.Tensor(name, array.reshape(1, -1) if batched else array) for name, array in arrays.items()]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    """INVALID_ARG for bad input, UNAVAILABLE for overload/shutdown, INTERNAL otherwise."""
    return pb_utils.InferenceResponse(error=triton_error(exc))


def cancelled_response(model_name: str) -> "pb_utils.InferenceResponse":
    """The answer to a request whose client cancelled (CANCELLED). A model that is not decoupled must
    send one response per request before its final flag, even when nobody will read it."""
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(f"{model_name}: the request was cancelled", pb_utils.TritonError.CANCELLED))


def triton_error(exc: BaseException) -> "pb_utils.TritonError":
    if isinstance(exc, InvalidArgument):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
    if isinstance(exc, Unavailable):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    return pb_utils.TritonError(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)


def send_final(sender, response) -> None:
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def log_error(message: str) -> None:
    pb_utils.Logger.log_error(message)


def log_verbose(message: str) -> None:
    pb_utils.Logger.log_verbose(message)


def send_quietly(sender, response) -> bool:
    """A non-final send (a stream's chunk); False, logged, if the client is gone."""
    try:
        sender.send(response)
    except Exception as exc:  # noqa: BLE001 - the client is gone; the caller aborts the request
        log_verbose(f"could not send a response: {exc!r}")
        return False
    return True


def send_final_quietly(sender, response) -> None:
    """Final send to a client that may be gone; a failure is logged, never raised into a worker."""
    try:
        if response is None:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            send_final(sender, response)
    except Exception as exc:  # noqa: BLE001 - the client is gone; log it, keep the thread alive
        log_error(f"could not send a final response: {exc!r}")


def load_serving_config(args: dict, decoupled: bool, static: bool = False) -> tuple[str, ServingConfig, Path]:
    """Model name, typed parameters and checkpoint folder; fails loudly on a wrong config (`static`:
    the static batcher, the one model that reads `max_wait_ms`)."""
    config = model_config(args)
    name = config["name"]
    require_transaction_policy(config, decoupled)
    serving = ServingConfig.from_parameters(parameters(config))
    if serving.max_wait_ms and not static:
        raise InvalidArgument("max_wait_ms", "only static_batching waits for a batch to fill; dynamic_batching's "
                                             "wait is max_queue_delay_microseconds")
    return name, serving, resolve_model_dir(serving.model_dir)


def require_transaction_policy(config: dict, decoupled: bool) -> None:
    """Fail the load if the model's `model_transaction_policy.decoupled` is not `decoupled`."""
    if pb_utils.using_decoupled_model_transaction_policy(config) != decoupled:
        raise ValueError(f"{config['name']}: model_transaction_policy.decoupled must be {str(decoupled).lower()}")


def readiness_probe(model_name: str):
    """A callable telling whether Triton still holds this model ready (false once it is unloading)."""
    return lambda: pb_utils.is_model_ready(model_name)
