"""ModelConfig: the shape of a Llama-family model, read once from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchlm.errors import InvalidArgument

# Keys of config.json that must be present; the rest have Llama defaults.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_SUPPORTED_ROPE_SCALING = ("linear", "llama3")
# ModelConfig field -> the config.json key it comes from, so errors name what the user can fix.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "eos_token_ids": "eos_token_id"}


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int  # width of the residual stream (D)
    num_layers: int  # decoder blocks
    num_heads: int  # query heads (H)
    num_kv_heads: int  # key/value heads (KVH); H % KVH == 0 (grouped-query attention)
    head_dim: int  # width of one head (hd); usually D / H
    intermediate_size: int  # width of the SwiGLU MLP (I)
    vocab_size: int  # rows of the embedding and of lm_head (V)
    max_position_embeddings: int  # longest sequence the RoPE table covers
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-5  # epsilon inside every RMSNorm
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    bos_token_id: int | None = None  # begin-of-sequence token, if the model has one
    eos_token_ids: tuple[int, ...] = ()  # any of these ends generation
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling dict as sorted items (hashable)
    # Divisors of the RoPE inverse frequencies, one per pair of a head's dimensions: a GGUF file's
    # `rope_freqs.weight`, the form llama.cpp's converter gives llama3 scaling (config key `rope_freq_factors`)
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidArgument(
                "num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim % 2 != 0:
            raise InvalidArgument("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise InvalidArgument("rope_theta", f"must be positive, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise InvalidArgument("rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        if self.rope_freq_factors is not None:
            if len(self.rope_freq_factors) != self.head_dim // 2 or not all(f > 0 for f in self.rope_freq_factors):
                raise InvalidArgument("rope_freq_factors", f"must be {self.head_dim // 2} positive numbers")
            if self.rope_scaling is not None:
                raise InvalidArgument("rope_freq_factors", "cannot be combined with rope_scaling")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in _SUPPORTED_ROPE_SCALING:
                raise InvalidArgument(
                    "rope_scaling", f"type {kind!r} is not supported (supported: {_SUPPORTED_ROPE_SCALING})")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one K/V head (G = H / KVH)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `<model_dir>/config.json`, or the metadata of a GGUF file; raise InvalidArgument naming the
        field that is wrong."""
        from batchlm.model.gguf_file import is_gguf, open_gguf

        if is_gguf(model_dir):
            return cls.from_hf_dict(open_gguf(model_dir).hf_config)
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise InvalidArgument("model_dir", f"no config.json in {model_dir}") from None
        except json.JSONDecodeError as err:
            raise InvalidArgument("config.json", f"not valid JSON: {err}") from None
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a HF Llama config.json (missing head_dim / KV heads get Llama defaults)."""
        for key in _REQUIRED:
            if key not in raw:
                raise InvalidArgument(key, "missing from config.json")
        if raw.get("hidden_act", "silu") != "silu":
            raise InvalidArgument("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key, False):
                raise InvalidArgument(key, "biases are not supported")
        heads = _int(raw, "num_attention_heads")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if _int(raw, "hidden_size") % heads != 0:
                raise InvalidArgument("num_attention_heads",
                                      "does not divide hidden_size and head_dim is absent")
            head_dim = raw["hidden_size"] // heads
        raw = _with_rope_parameters(raw)
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise InvalidArgument("rope_scaling", f"must be an object or null, got {scaling!r}")
        try:
            return cls._from_checked_dict(raw, heads, head_dim, scaling)
        except InvalidArgument as err:
            raise InvalidArgument(_HF_NAMES.get(err.field, err.field), err.message) from None

    @classmethod
    def _from_checked_dict(cls, raw: dict[str, Any], heads: int, head_dim: Any,
                           scaling: dict | None) -> "ModelConfig":
        return cls(
            hidden_size=_int(raw, "hidden_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(raw, "num_key_value_heads", heads),
            head_dim=_int({"head_dim": head_dim}, "head_dim"),
            intermediate_size=_int(raw, "intermediate_size"),
            vocab_size=_int(raw, "vocab_size"),
            max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
            rope_theta=_float(raw, "rope_theta", 10000.0),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=_optional_int(raw, "bos_token_id"),
            eos_token_ids=token_ids(raw.get("eos_token_id"), "eos_token_id"),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            rope_freq_factors=(tuple(float(x) for x in raw["rope_freq_factors"])
                               if raw.get("rope_freq_factors") is not None else None),
        )


def _with_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with newer transformers' `rope_parameters` (`{"rope_type", "rope_theta", "factor", ...}`)
    read into the `rope_theta` and `rope_scaling` keys this module reads; unchanged without it. Without
    this, such a config would load with theta 10000 and no scaling, in silence."""
    params = raw.get("rope_parameters")
    if params is None:
        return raw
    if not isinstance(params, dict):
        raise InvalidArgument("rope_parameters", f"must be an object or null, got {params!r}")
    merged = dict(raw)
    if "rope_theta" in params:
        merged["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        if raw.get("rope_scaling") not in (None, scaling):
            raise InvalidArgument("rope_parameters", "disagrees with rope_scaling")
        merged["rope_scaling"] = scaling
    return merged


def token_ids(value: Any, field: str) -> tuple[int, ...]:
    """An HF token id field that may be null, an int or a list of ints, as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidArgument(field, f"must be a non-negative int or a list of them, got {value!r}")
    return tuple(values)


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(key, f"must be a positive integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidArgument(key, f"must be a number, got {value!r}")
    return float(value)


def _optional_int(raw: dict[str, Any], key: str) -> int | None:
    ids = token_ids(raw.get(key), key)
    if len(ids) > 1:
        raise InvalidArgument(key, f"must be a single id, got {raw[key]!r}")
    return ids[0] if ids else None
