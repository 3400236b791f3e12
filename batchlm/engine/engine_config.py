"""EngineConfig: how the engine uses the machine. Frozen, validated once, errors name the field.

In Triton these values come from `config.pbtxt` `parameters` (strings); `from_parameters` parses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from batchlm.errors import InvalidArgument
from batchlm.model.backends import ATTENTION_BACKENDS, LINEAR_BACKENDS, POINTWISE_BACKENDS, check_weights

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"                   # "cpu" or "cuda"
    dtype: str | None = None              # weights and KV; None = float32 on cpu, bfloat16 on cuda
    num_threads: int = 2                  # torch intra-op threads; 0 = leave torch's setting alone
    adaptive_threads: bool = True         # step with fewer threads while other processes hold cores
                                          # (batchlm.engine.thread_governor); False: always num_threads
    attention: str = "auto"               # "kernel" (native CPU op, batch-invariant), "torch" (SDPA),
                                          # "auto": the kernel where it is built and can run
    linear: str = "auto"                  # "kernel" (native CPU op, batch-invariant; float32 on AVX-512
                                          # or AVX2, bfloat16 on AVX-512 BF16), "onednn" (packed oneDNN matmul),
                                          # "auto": the kernel where it has vector code
    weights: str = "auto"                 # "auto": a GGUF file's Q4_0/Q4_1/Q8_0/F16/BF16 tensors stay as
                                          # stored and are multiplied by batchlm::linear_q (float32 CPU
                                          # models; the same bits as "dense" at a fraction of the memory);
                                          # "dense": dequantized at load
    activations: str = "float32"          # what the kept tensors multiply: "float32" (exact); faster, not
                                          # exact: "int8", Q4_0/Q4_1/Q8_0 against each row rounded to int8
                                          # per block of 32, in integers (batchlm::linear_q8, AVX2);
                                          # "bfloat16", BF16 against rows rounded to bfloat16, with the
                                          # bfloat16 dot product (batchlm::linear_bf16, AVX-512 BF16)
    pointwise: str = "auto"               # RMSNorm, SiLU-and-multiply, RoPE and the KV write: "kernel"
                                          # (native CPU ops, one pass each), "torch" (torch's ops),
                                          # "auto": the kernels where they are built and can run
    block_size: int = 16                  # token slots per KV block
    num_kv_blocks: int = 512              # KV blocks in total (512 x 16 = 8 rows x 1024 tokens)
    max_num_seqs: int = 8                 # sequences in one forward pass at most
    max_num_batched_tokens: int = 512     # per-step token budget (decode tokens + prefill chunks)
    enable_chunked_prefill: bool = True   # split long prompts over steps to fit the token budget
    max_model_len: int = 1024             # prompt + max_tokens must fit in this many tokens
    admit_headroom_blocks: int = 2        # on-demand KV only: a waiting sequence is admitted only if
                                          # this many free blocks per running sequence remain after it;
                                          # 0 admits greedily and lets growth preempt (recompute)
    pad_finished_rows: bool = True        # request-level batching only: a finished row stays in the
                                          # forward pass as padding until its batch ends, as in
                                          # fixed-shape batch tensors (HF generate); False drops it
    enable_prefix_caching: bool = True    # full KV blocks are found again by their tokens and shared,
                                          # and kept after their request ends until the space is needed

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise InvalidArgument("device", f"must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgument("dtype", f"must be one of {DTYPES} or None, got {self.dtype!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise InvalidArgument("attention", f"must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.linear not in LINEAR_BACKENDS:
            raise InvalidArgument("linear", f"must be one of {LINEAR_BACKENDS}, got {self.linear!r}")
        check_weights(self.weights, self.activations)
        if self.pointwise not in POINTWISE_BACKENDS:
            raise InvalidArgument("pointwise", f"must be one of {POINTWISE_BACKENDS}, got {self.pointwise!r}")
        _require_int("num_threads", self.num_threads, minimum=0)
        _require_int("admit_headroom_blocks", self.admit_headroom_blocks, minimum=0)
        for name in ("block_size", "num_kv_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len"):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("enable_chunked_prefill", "pad_finished_rows", "adaptive_threads", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(name, "must be a bool")
        if self.max_model_len > self.num_kv_blocks * self.block_size:
            raise InvalidArgument(
                "num_kv_blocks",
                f"{self.num_kv_blocks} blocks x {self.block_size} tokens cannot hold one sequence "
                f"of max_model_len={self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidArgument(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or a long prompt could never be scheduled")

    @property
    def resolved_dtype(self) -> str:
        """The dtype name actually used: the explicit one, else the device's default."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def num_kv_tokens(self) -> int:
        """Token slots in the whole KV cache."""
        return self.num_kv_blocks * self.block_size

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold, prompt + max_tokens: its context, and what a request
        alone can reserve of the KV cache."""
        return min(self.max_model_len, self.num_kv_tokens)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any], strict: bool = False) -> EngineConfig:
        """Build from string values, as Triton `config.pbtxt` `parameters` provide them.

        Values may be plain strings or Triton's `{"string_value": "..."}`. Keys that are not fields
        are ignored (other layers read them) unless `strict`. Errors name the key.
        """
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in parameters.items():
            if key not in kinds:
                if strict:
                    raise InvalidArgument(key, "is not an EngineConfig parameter")
                continue
            text = raw.get("string_value", "") if isinstance(raw, Mapping) else raw
            values[key] = _parse(key, str(text).strip(), kinds[key])
        return cls(**values)


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgument(name, f"must be >= {minimum}, got {value}")


def _parse(key: str, text: str, kind: str) -> Any:
    """Parse one string by the field's annotation ("int", "bool", "str", "str | None")."""
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise InvalidArgument(key, f"must be an integer, got {text!r}") from None
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise InvalidArgument(key, f"must be true or false, got {text!r}")
    if kind == "str | None" and text.lower() in ("", "none", "auto"):
        return None
    return text
