"""The default checkpoint is deterministic, in HF layout; load_model reads single, sharded, tied files."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from batchlm import kernels
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache
from batchlm.model.checkpoint import (
    SafetensorsCheckpoint,
    default_checkpoint_is_current,
    load_model,
    write_default_checkpoint,
)
from batchlm.model.model import LlamaForCausalLM
from batchlm.model.model_config import ModelConfig

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json"]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    return write_default_checkpoint(tmp_path_factory.mktemp("default"), seed=0)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_default_checkpoint(tmp_path_factory.mktemp("small"), seed=3, **SMALL)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, num_blocks=8, block_size=4)
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        query_lens=[n], context_lens=[n], block_tables=torch.arange(-(-n // 4))[None],
        logits_indices=torch.tensor([n - 1]))
    return model(batch, cache)[0]


def test_default_checkpoint_is_byte_identical_when_written_twice(default_dir, tmp_path):
    again = write_default_checkpoint(tmp_path / "again", seed=0)
    for name in FILES:
        assert sha256(default_dir / name) == sha256(again / name), name


def test_default_checkpoint_layout_and_size(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    tensors = SafetensorsCheckpoint(default_dir)
    assert "model.layers.7.self_attn.k_proj.weight" in tensors and "lm_head.weight" in tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 64, 512)  # GQA: 2 KV heads
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (1408, 512)
    params = sum(tensors[name].numel() for name in tensors)
    assert 30e6 < params < 32e6
    cfg = ModelConfig.from_dir(default_dir)
    shape = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (512, 8, 8, 2, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (8192, 2048)
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((2,), 1)


def test_is_current_detects_seed_size_and_tampering(small_dir, tmp_path):
    assert default_checkpoint_is_current(small_dir, seed=3, **SMALL)
    assert not default_checkpoint_is_current(small_dir, seed=4, **SMALL)
    assert not default_checkpoint_is_current(small_dir, seed=3)
    copy = shutil.copytree(small_dir, tmp_path / "copy")
    (copy / "tokenizer_config.json").write_text("{}")
    assert not default_checkpoint_is_current(copy, seed=3, **SMALL)
    assert not default_checkpoint_is_current(tmp_path / "missing", seed=3)


def test_tied_and_rope_scaled_checkpoint_in_hf_layout(small_dir, tmp_path):
    scaling = {"rope_type": "linear", "factor": 2.0}
    tied = write_default_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True, rope_scaling=scaling, **SMALL)
    config = json.loads((tied / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"] == scaling
    assert "lm_head.weight" not in SafetensorsCheckpoint(tied)  # HF layout: the embedding is the output matrix
    assert default_checkpoint_is_current(tied, seed=3, tie_word_embeddings=True, rope_scaling=scaling, **SMALL)
    assert not default_checkpoint_is_current(tied, seed=3, **SMALL)
    assert not default_checkpoint_is_current(small_dir, seed=3, tie_word_embeddings=True, rope_scaling=scaling,
                                             **SMALL)
    model = load_model(tied)
    assert model.config.tie_word_embeddings and dict(model.config.rope_scaling) == scaling
    logits = last_logits(model, [1, 50, 60, 70, 80])
    assert 2.0 < logits.std() < 8.0  # spread as the untied model's (LM_HEAD_LOGIT_STD), not sqrt(hidden_size)


def test_load_model_round_trip(small_dir):
    model = load_model(small_dir)
    assert not model.training and model.config == ModelConfig.from_dir(small_dir)
    tensors = SafetensorsCheckpoint(small_dir)
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    norm = tensors["model.layers.1.input_layernorm.weight"]
    assert torch.equal(model.layers[1].input_layernorm.weight, norm)
    logits = last_logits(model, [1, 50, 60, 70, 80])
    assert logits.shape == (8192,) and torch.isfinite(logits).all()
    assert logits.std() > 2.0  # well-spread logits: greedy argmax has no near-ties


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_a_model_imports_no_compiler_stack(small_dir, dtype):
    """A model is allocated where and as it lives, never on the meta device: there the embedding's random
    init imports torch._dynamo and to_empty imports sympy, seconds of every model load and so of every
    Triton model instance's start."""
    code = (f"import sys, torch; from batchlm.model.checkpoint import load_model; "
            f"m = load_model({str(small_dir)!r}, dtype=torch.{dtype}); "
            "print(sorted({str(p.dtype) for p in m.parameters()}), "
            "[n for n in ('torch._dynamo', 'sympy') if n in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"['torch.{dtype}'] []", proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["kernel", "onednn"])
def test_dense_and_packed_linears_agree(small_dir, backend):
    config = load_model(small_dir).config
    dense, packed = LlamaForCausalLM(config), LlamaForCausalLM(config)  # plain F.linear until prepacked
    for model in (dense, packed):
        model.load_hf_state_dict(SafetensorsCheckpoint(small_dir))
    if backend == "kernel" and not kernels.linear_is_native(torch.float32):
        pytest.skip("batchlm::linear has no float32 vector code on this machine or build: nothing packed to compare")
    moved = packed.prepack_linears(backend)
    if moved == 0:
        pytest.skip(f"this torch build cannot pack float32 linears for {backend}: nothing packed to compare")
    assert dense.linear_backend == "dense" and packed.linear_backend == backend, (moved, packed.linear_backend)
    ids = [1, 9, 8, 7, 6, 5]
    torch.testing.assert_close(last_logits(dense, ids), last_logits(packed, ids), atol=1e-4, rtol=0)


def test_load_sharded_checkpoint(small_dir, tmp_path):
    tensors = dict(SafetensorsCheckpoint(small_dir))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(small_dir / name, sharded / name)
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(last_logits(load_model(sharded), ids), last_logits(load_model(small_dir), ids))


def test_tied_embeddings_use_the_embedding_matrix_as_lm_head(small_dir, tmp_path):
    tensors = dict(SafetensorsCheckpoint(small_dir))
    tied = tmp_path / "tied"
    tied.mkdir()
    config = json.loads((small_dir / "config.json").read_text())
    config.update(tie_word_embeddings=True)
    config.pop("head_dim")  # absent: hidden_size / num_attention_heads
    (tied / "config.json").write_text(json.dumps(config))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tied / "model.safetensors"))
    model = load_model(tied)
    assert model.config.tie_word_embeddings and model.config.head_dim == 16
    h = torch.randn(3, 64)
    expected = h @ tensors["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.lm_head(h), expected, atol=1e-4, rtol=0)


def test_missing_tensor_is_named(small_dir, tmp_path):
    tensors = dict(SafetensorsCheckpoint(small_dir))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(small_dir / "config.json", broken / "config.json")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(broken)


def test_make_tiny_model_script_is_idempotent(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"
    out = tmp_path / "default"

    def run() -> str:
        done = subprocess.run([sys.executable, str(script), "--out", str(out), "--seed", "0"],
                              capture_output=True, text=True, check=True)
        return done.stdout

    assert "wrote" in run()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert "nothing to do" in run()
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
