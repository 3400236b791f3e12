"""Typed view of `continuous_batching_trtllm`'s `config.pbtxt` parameters."""

from __future__ import annotations

from dataclasses import dataclass, fields

from batchlm.errors import InvalidArgument
from batchlm.backend.serving_config import positive_int


@dataclass(frozen=True)
class TrtllmFrontConfig:
    model_dir: str = "models/SmolLM2-135M-Instruct"  # tokenizer (and checkpoint the engine was built from)
    backend_model: str = "tensorrt_llm"  # the Triton model that runs the TensorRT-LLM engine
    # requests in flight (queued in or running on the engine) beyond this are refused with UNAVAILABLE;
    # each holds one thread of this model
    max_in_flight: int = 256
    # longest prompt + max_tokens a request may ask for: the engine's max_seq_len
    max_model_len: int = 1024
    # how often every request is asked whether its client cancelled; a cancelled request is stopped on
    # the engine (a `stop` request) within this period
    cancellation_check_period_ms: int = 100
    # streamed requests: the first text at once, then a response per this many new tokens
    stream_interval: int = 1
    # a request the engine streams is ended here when, after the engine's first response for it, the
    # engine sends nothing for this long: its client gets an error and its slot is freed. Once it has
    # begun, a request sends a response every engine step; on tritonserver 2.51 (python_backend r24.10)
    # an engine error after streamed tokens is lost and would leave the request waiting for ever.
    engine_silence_timeout_ms: int = 30000

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "TrtllmFrontConfig":
        """Parse string parameters; unknown keys and bad values raise InvalidArgument naming the key."""
        known = {f.name for f in fields(cls)}
        for key in params:
            if key not in known:
                raise InvalidArgument(key, f"unknown parameter; expected one of {sorted(known)}")
        defaults = cls()
        if not params.get("backend_model", defaults.backend_model):
            raise InvalidArgument("backend_model", "must name the Triton model that runs the engine")
        return cls(
            model_dir=params.get("model_dir", defaults.model_dir),
            backend_model=params.get("backend_model", defaults.backend_model),
            **{name: positive_int(params, name, getattr(defaults, name))
               for name in ("max_in_flight", "max_model_len", "cancellation_check_period_ms", "stream_interval",
                            "engine_silence_timeout_ms")},
        )
