"""The tensor contract of TensorRT-LLM's Triton backend, as `continuous_batching_trtllm` speaks it.

The `tensorrt_llm` model (backend `tensorrtllm`, `gpt_model_type: inflight_fused_batching`) takes token
ids, not text, and answers token ids. Names follow the backend's model configuration (the release that
docker/versions.env pins). The model has `max_batch_size` > 0, so every tensor
carries a leading batch dimension of 1. Pure numpy: no Triton, no torch.

Mapping from this repository's request schema:
- `max_tokens` -> `request_output_len`; the prompt's ids -> `input_ids` and `input_lengths`.
- greedy (`temperature` 0) -> `runtime_top_k` 1; otherwise `temperature`, `runtime_top_k` (0 = off)
  and `runtime_top_p`. A temperature below MIN_TEMPERATURE is sent as greedy, which is what it samples:
  in float32 it is 0 or its inverse overflows the scaled logits (batchlm's sampler clamps it instead).
  A sampled request's `top_k` above TOP_K_MAX is refused (`check_params`): the engine would clip it in
  silence.
- `seed` -> `random_seed`; a sampled request without one gets a fresh random seed, since the engine
  starts every unseeded request from seed 0 (the same prompt would sample the same text each time,
  where batchlm's models draw from a global generator). `stream` -> `streaming`.
- EOS -> `end_id`, left out under `ignore_eos`, so the engine generates exactly `max_tokens` tokens.
- `stop` strings are matched on text by the front model, which then stops the request by id (`stop`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument

BACKEND_OUTPUTS = ("output_ids", "sequence_length")
TOP_K_MAX = 1024  # the largest top_k TensorRT-LLM's sampling layers take; they clip larger ones, with a warning
# below this a temperature samples the argmax: logits of up to ~1e8 scaled by 1/t still fit in float32
MIN_TEMPERATURE = 1e-30

# name -> numpy dtype of what the front sends (the backend declares them INT32 / FP32 / UINT64 / BOOL)
INPUT_DTYPES: dict[str, type] = {
    "input_ids": np.int32,
    "input_lengths": np.int32,
    "request_output_len": np.int32,
    "end_id": np.int32,
    "pad_id": np.int32,
    "temperature": np.float32,
    "runtime_top_k": np.int32,
    "runtime_top_p": np.float32,
    "random_seed": np.uint64,
    "streaming": np.bool_,
    "stop": np.bool_,
}


def end_id(eos_token_ids: Sequence[int] | frozenset[int]) -> int | None:
    """The one id the engine stops at (`end_id`; the backend takes a single one): the smallest of the
    checkpoint's EOS ids, or None where it has none."""
    return min(eos_token_ids) if eos_token_ids else None


def engine_ends_by_itself(output_ids: Sequence[int], params: SamplingParams, engine_end_id: int | None) -> bool:
    """Whether the engine has ended this request on its own after `output_ids`: at `max_tokens`, or at
    its `end_id` where the request carried one (not under `ignore_eos`). Where the front ended the text
    otherwise (a stop string, or an EOS id of the checkpoint other than `end_id`), the engine runs on
    until it is sent a stop."""
    if len(output_ids) >= params.max_tokens:
        return True
    return (engine_end_id is not None and not params.ignore_eos and bool(output_ids)
            and output_ids[-1] == engine_end_id)


def check_params(params: SamplingParams) -> None:
    """Raise InvalidArgument for what the engine would not do as asked (valid for batchlm's models). A
    greedy request is sent `runtime_top_k` 1, so its `top_k` never reaches the engine."""
    if params.top_k > TOP_K_MAX and not samples_greedy(params):
        raise InvalidArgument("top_k", f"at most {TOP_K_MAX} on the TensorRT-LLM engine, got {params.top_k}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise InvalidArgument(name, "continuous_batching_trtllm does not return log-probabilities")
    neutral = SamplingParams(max_tokens=params.max_tokens)
    for name in ("min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "guided_decoding_guide_type"):
        if getattr(params, name) != getattr(neutral, name):
            raise InvalidArgument(name, "continuous_batching_trtllm does not forward it to the engine")


def samples_greedy(params: SamplingParams) -> bool:
    """Whether the engine is sent greedy decoding (`runtime_top_k` 1) for these params."""
    return params.is_greedy or float(np.float32(params.temperature)) < MIN_TEMPERATURE


def request_inputs(prompt_ids: Sequence[int], params: SamplingParams, stream: bool,
                   eos_token_id: int | None, pad_token_id: int) -> dict[str, np.ndarray]:
    """The tensors of one generation request (batch of 1). A sampled request without a seed gets a
    fresh one, so two calls differ in `random_seed`."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    values: dict[str, object] = {
        "input_lengths": len(prompt_ids),
        "request_output_len": params.max_tokens,
        "pad_id": pad_token_id,
        "streaming": stream,
    }
    if samples_greedy(params):
        values["runtime_top_k"] = 1
    else:
        values.update(temperature=params.temperature, runtime_top_k=params.top_k, runtime_top_p=params.top_p,
                      random_seed=secrets.randbits(64) if params.seed is None else params.seed)
    if params.seed is not None:
        values["random_seed"] = params.seed
    if eos_token_id is not None and not params.ignore_eos:
        values["end_id"] = eos_token_id
    tensors = {name: np.array([[value]], dtype=INPUT_DTYPES[name]) for name, value in values.items()}
    tensors["input_ids"] = np.array([list(prompt_ids)], dtype=np.int32)  # (1, prompt_len)
    return tensors


def stop_inputs() -> dict[str, np.ndarray]:
    """The tensors of a stop request: sent with the id of a running request, it ends that request.
    The backend still requires its three mandatory inputs, so they carry placeholders."""
    return {
        "input_ids": np.array([[0]], dtype=np.int32),
        "input_lengths": np.array([[1]], dtype=np.int32),
        "request_output_len": np.array([[1]], dtype=np.int32),
        "stop": np.array([[True]], dtype=np.bool_),
    }


def new_token_ids(output_ids: np.ndarray | None, sequence_length: np.ndarray | None) -> list[int]:
    """The generated ids one backend response carries (beam 0).

    With `exclude_input_in_output: true`, `output_ids` (1, beams, n) holds only generated ids: the new
    ones of this step when streaming, all of them otherwise; `sequence_length` (1, beams) says how many
    are valid. A response without them (the empty final one of a stream) carries none.
    """
    if output_ids is None or output_ids.size == 0:
        return []
    ids = np.asarray(output_ids).reshape(-1, np.asarray(output_ids).shape[-1])[0]
    if sequence_length is not None and np.asarray(sequence_length).size:
        ids = ids[:int(np.asarray(sequence_length).reshape(-1)[0])]
    return [int(t) for t in ids]
