"""Typed view of a model's `config.pbtxt` parameters: what the Triton adapter needs, plus the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from batchlm.engine.engine_config import EngineConfig
from batchlm.errors import InvalidArgument
from batchlm.backend.fault_injection import FaultInjector

SERVING_KEYS = ("model_dir", "batch_size", "max_waiting", "cancellation_check_period_ms", "stream_interval",
                "fault_injection", "max_wait_ms")


@dataclass(frozen=True)
class ServingConfig:
    model_dir: str  # checkpoint: a HF folder or a GGUF file, absolute or relative to the project root
    batch_size: int  # static batching only: requests per batch
    max_waiting: int  # requests held before new ones are refused with UNAVAILABLE
    engine: EngineConfig  # everything else in `parameters`
    # how often every running request is asked whether it was cancelled (a round trip to the server per
    # request: from a CancellationWatcher thread in continuous batching, from the stepping thread between
    # steps in static and dynamic batching); the TensorRT-LLM backend's parameter and default
    cancellation_check_period_ms: int = 100
    # continuous batching, streamed requests: send text once this many new tokens are buffered (the
    # first text and the final response always go at once); 1 = a response per token
    stream_interval: int = 1
    # `POINT@N,...`: make the N-th pass through a serving thread's POINT raise (batchlm.backend.fault_injection);
    # empty, as shipped: no fault
    fault_injection: str = ""
    # static batching only: run an incomplete batch once its oldest request has waited this long (a
    # departure from pure static batching); 0, as shipped: wait for a full batch however long it takes
    max_wait_ms: int = 0

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServingConfig":
        """Parse string parameters; unknown keys and bad values raise naming the key."""
        rest = {k: v for k, v in params.items() if k not in SERVING_KEYS}
        return cls(
            model_dir=params.get("model_dir", "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            batch_size=positive_int(params, "batch_size", 8),
            max_waiting=positive_int(params, "max_waiting", 64),
            cancellation_check_period_ms=positive_int(params, "cancellation_check_period_ms", 100),
            stream_interval=positive_int(params, "stream_interval", 1),
            fault_injection=fault_spec(params),
            max_wait_ms=non_negative_int(params, "max_wait_ms", 0),
            engine=EngineConfig.from_parameters(rest, strict=True),
        )


def check_batch_fits(engine: EngineConfig, rows: int, key: str) -> None:
    """Request-level batching reserves KV for prompt + max_tokens of every row when its batch starts, so
    a batch of `rows` requests of up to `max_model_len` tokens each must fit `max_num_seqs` and the KV
    pool, or a full batch of long requests would fail as a whole. Raises InvalidArgument naming `key`
    (the model's batch size: `batch_size` or `max_batch_size`) at load."""
    if rows > engine.max_num_seqs:
        raise InvalidArgument(key, f"{rows} rows exceed max_num_seqs={engine.max_num_seqs}")
    per_row = -(-engine.max_model_len // engine.block_size)
    if rows * per_row > engine.num_kv_blocks:
        raise InvalidArgument(
            key, f"{rows} rows of max_model_len={engine.max_model_len} need {rows * per_row} KV blocks of "
                 f"{engine.block_size} tokens, num_kv_blocks is {engine.num_kv_blocks}")


def fault_spec(params: dict[str, str]) -> str:
    """The `fault_injection` parameter, checked (InvalidArgument naming it at load); "" when absent."""
    spec = params.get("fault_injection", "")
    FaultInjector.parse(spec)
    return spec


def non_negative_int(params: dict[str, str], key: str, default: int) -> int:
    """`params[key]` as an integer >= 0 (`default` when absent); raises InvalidArgument naming the key."""
    return _int_at_least(params, key, default, 0)


def positive_int(params: dict[str, str], key: str, default: int) -> int:
    """`params[key]` as an integer >= 1 (`default` when absent); raises InvalidArgument naming the key."""
    return _int_at_least(params, key, default, 1)


def _int_at_least(params: dict[str, str], key: str, default: int, minimum: int) -> int:
    raw = params.get(key, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(key, f"must be an integer, got {raw!r}") from None
    if value < minimum:
        raise InvalidArgument(key, f"must be >= {minimum}, got {value}")
    return value
