"""EngineConfig validation and parsing from Triton string parameters."""

import pytest

from batchlm.engine.engine_config import EngineConfig
from batchlm.errors import InvalidArgument


def test_defaults():
    config = EngineConfig()
    assert config.resolved_dtype == "float32"
    assert config.num_kv_tokens == 8 * 1024
    assert EngineConfig(device="cuda").resolved_dtype == "bfloat16"


@pytest.mark.parametrize("field, value", [
    ("device", "tpu"), ("dtype", "int8"), ("num_threads", -1), ("block_size", 0),
    ("num_kv_blocks", 0), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
    ("max_model_len", 0), ("enable_chunked_prefill", "yes"), ("max_num_seqs", 2.5),
    ("attention", "flash"), ("linear", "mkl"), ("pointwise", "fused"),
])
def test_invalid_field_is_named(field, value):
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


def test_cross_field_checks():
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(num_kv_blocks=4, block_size=16, max_model_len=128)
    assert err.value.field == "num_kv_blocks"
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert err.value.field == "max_num_batched_tokens"


def test_from_parameters_parses_strings():
    config = EngineConfig.from_parameters({
        "max_num_seqs": "16", "num_kv_blocks": {"string_value": "1024"}, "dtype": "none",
        "enable_chunked_prefill": "false", "max_num_batched_tokens": "1024", "batch_size": "4",
    })
    assert config.max_num_seqs == 16 and config.num_kv_blocks == 1024
    assert config.dtype is None and config.enable_chunked_prefill is False


def test_from_parameters_errors_name_the_key():
    with pytest.raises(InvalidArgument) as err:
        EngineConfig.from_parameters({"max_num_seqs": "eight"})
    assert err.value.field == "max_num_seqs"
    with pytest.raises(InvalidArgument) as err:
        EngineConfig.from_parameters({"enable_chunked_prefill": "maybe"})
    assert err.value.field == "enable_chunked_prefill"
    with pytest.raises(InvalidArgument) as err:
        EngineConfig.from_parameters({"max_num_sequences": "8"}, strict=True)
    assert err.value.field == "max_num_sequences"
