"""ModelConfig reads HF Llama config.json files; every error names the offending field."""

import json

import pytest

from batchlm.errors import InvalidArgument
from batchlm.model.model_config import ModelConfig

LLAMA = {  # a TinyLlama-like config.json (no head_dim key)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
}


def test_reads_a_llama_config_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2048, 22, 32, 4)
    assert cfg.head_dim == 64 and cfg.num_queries_per_kv == 8  # head_dim absent: hidden / heads
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and not cfg.tie_word_embeddings


def test_defaults_for_absent_optional_fields():
    raw = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "rope_theta", "eos_token_id")}
    cfg = ModelConfig.from_hf_dict({**raw, "eos_token_id": [2, 7], "tie_word_embeddings": True})
    assert cfg.num_kv_heads == cfg.num_heads == 32 and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (2, 7) and cfg.tie_word_embeddings


def test_config_is_frozen():
    cfg = ModelConfig.from_hf_dict(LLAMA)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": "22"}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"head_dim": 63}, "head_dim"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"bos_token_id": [1, 2]}, "bos_token_id"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
])
def test_bad_values_name_the_field(change, field):
    with pytest.raises(InvalidArgument) as err:
        ModelConfig.from_hf_dict({**LLAMA, **change})
    assert err.value.field == field and str(err.value).startswith(field)


def test_missing_required_field_is_named():
    raw = dict(LLAMA)
    del raw["vocab_size"]
    with pytest.raises(InvalidArgument, match="vocab_size"):
        ModelConfig.from_hf_dict(raw)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(InvalidArgument, match="model_dir"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_llama3_rope_scaling_is_accepted():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf_dict({**LLAMA, "rope_scaling": scaling})
    assert dict(cfg.rope_scaling)["factor"] == 32.0


def test_newer_transformers_rope_parameters_are_read():
    # A config with only rope_parameters must not load with theta 10000 and no scaling, in silence.
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    plain = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    cfg = ModelConfig.from_hf_dict({**plain, "rope_parameters": {"rope_theta": 500000.0, **scaling}})
    assert cfg.rope_theta == 500000.0 and dict(cfg.rope_scaling) == scaling
    assert cfg == ModelConfig.from_hf_dict({**plain, "rope_theta": 500000.0, "rope_scaling": scaling})
    default = ModelConfig.from_hf_dict({**plain, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert default.rope_theta == 1e6 and default.rope_scaling is None
    with pytest.raises(InvalidArgument, match="^rope_scaling: type 'yarn' is not supported"):
        ModelConfig.from_hf_dict({**plain, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(InvalidArgument, match="^rope_parameters: must be an object"):
        ModelConfig.from_hf_dict({**plain, "rope_parameters": 5})
