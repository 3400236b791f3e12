"""Checkpoints on local disk, in Hugging Face Llama layout: write the default one, load any one.

`write_default_checkpoint` makes a small random-weight Llama (and a tokenizer trained on a synthetic
corpus) deterministically from a seed, with no download. `load_model` reads any Llama-family checkpoint
(config.json + model.safetensors, single file or sharded), e.g. this one, SmolLM2-135M or TinyLlama-1.1B.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchlm.model.gguf_file import GGUFWeights
from batchlm.model.model import LlamaForCausalLM
from batchlm.model.model_config import ModelConfig
from batchlm.model.backends import check_weights
from batchlm.model.quantized import FAST_TYPES, can_hold_quantized, load_quantized

log = logging.getLogger(__name__)

# Bump when the bytes write_default_checkpoint produces for a given seed change.
FORMAT_VERSION = 2  # 2: tokenizer_config.json has a chat_template
MANIFEST = "batchlm_checkpoint.json"
DEFAULT_SIZE = {  # ~31M parameters
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1408,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
# NOTE: logits with a std of ~4 make the top-2 gap large next to float reordering error, so greedy
# tokens do not change between a sequence run alone and the same sequence inside a batch.
LM_HEAD_LOGIT_STD = 4.0
# The chat template (Hugging Face's `chat_template`, jinja2) that the OpenAI frontend renders chat
# messages with: a `<|role|>` line, the content and `</s>` (encoded as the EOS id) per message, then
# the assistant's turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_config(*, tie_word_embeddings: bool = False, rope_scaling: dict | None = None, **size: int) -> dict:
    """The HF config.json of the default model; `size` overrides DEFAULT_SIZE keys (small test models).

    `tie_word_embeddings` and `rope_scaling` (an HF rope_scaling object, e.g. `{"rope_type": "linear",
    "factor": 2.0}`) set those keys, for test models of other shapes; their defaults are the default model's.
    """
    unknown = set(size) - set(DEFAULT_SIZE)
    if unknown:
        raise TypeError(f"unknown size overrides: {sorted(unknown)} (allowed: {sorted(DEFAULT_SIZE)})")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **DEFAULT_SIZE,
        **size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None if rope_scaling is None else dict(rope_scaling),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def write_default_checkpoint(out_dir: str | Path, seed: int = 0, *, tie_word_embeddings: bool = False,
                             rope_scaling: dict | None = None, **size: int) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json.

    Same seed, options and size give byte-identical files on every run; nothing is downloaded.
    `tie_word_embeddings` and `rope_scaling` go to config.json (`default_config`); a tied model's
    model.safetensors has no lm_head.weight (HF layout; its weights: `random_weights`).
    A manifest (batchlm_checkpoint.json, written last) records the hashes for `default_checkpoint_is_current`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = default_config(tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling, **size)
    model_config = ModelConfig.from_hf_dict(config)
    files = {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(
            {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}),
        "tokenizer_config.json": _json_bytes({
            "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": DEFAULT_CHAT_TEMPLATE}),
        "tokenizer.json": train_tokenizer(seed, config["vocab_size"]).to_str(pretty=True).encode(),
    }
    hashes = {name: _write_atomic(out / name, data) for name, data in files.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(random_weights(model_config, seed), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # NOTE: safetensors creates the file 0600; the server may run as another user
    os.replace(tmp, out / "model.safetensors")
    hashes["model.safetensors"] = _sha256(out / "model.safetensors")
    manifest = {"format_version": FORMAT_VERSION, "seed": seed, "config": config, "files": hashes}
    _write_atomic(out / MANIFEST, _json_bytes(manifest))
    return out


def default_checkpoint_is_current(out_dir: str | Path, seed: int = 0, *, tie_word_embeddings: bool = False,
                                  rope_scaling: dict | None = None, **size: int) -> bool:
    """True when `out_dir` holds exactly what write_default_checkpoint(out_dir, seed, ...) would write,
    with the same keyword arguments."""
    out = Path(out_dir)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    config = default_config(tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling, **size)
    expected = {"format_version": FORMAT_VERSION, "seed": seed, "config": config}
    if any(manifest.get(k) != v for k, v in expected.items()):
        return False
    return all((out / name).is_file() and _sha256(out / name) == digest
               for name, digest in manifest.get("files", {}).items())


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; each projection preserves unit variance, lm_head spreads the logits.

    With `config.tie_word_embeddings` there is no lm_head.weight: the embedding is the output matrix too.
    Its rows are then drawn with unit norm (the same random numbers, scaled) and the final norm's weight is
    LM_HEAD_LOGIT_STD, so the logits spread as the untied model's while a token's own embedding stays a
    small part of the residual stream. (With a unit-variance embedding, logits had a std of sqrt(D) and
    the current token's own row led them: greedy repeated one or two tokens for ever.)
    """
    g = torch.Generator().manual_seed(seed)
    D, hd, I = config.hidden_size, config.head_dim, config.intermediate_size  # noqa: E741 (the usual names)
    H, KVH, V = config.num_heads, config.num_kv_heads, config.vocab_size

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * std

    tied = config.tie_word_embeddings
    weights = {"model.embed_tokens.weight": normal(V, D, 1 / math.sqrt(D) if tied else 1.0)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(H * hd, D, 1 / math.sqrt(D))
        weights[p + "self_attn.k_proj.weight"] = normal(KVH * hd, D, 1 / math.sqrt(D))
        weights[p + "self_attn.v_proj.weight"] = normal(KVH * hd, D, 1 / math.sqrt(D))
        weights[p + "self_attn.o_proj.weight"] = normal(D, H * hd, 1 / math.sqrt(H * hd))
        weights[p + "mlp.gate_proj.weight"] = normal(I, D, 1 / math.sqrt(D))
        weights[p + "mlp.up_proj.weight"] = normal(I, D, 1 / math.sqrt(D))
        weights[p + "mlp.down_proj.weight"] = normal(D, I, 1 / math.sqrt(I))
        weights[p + "input_layernorm.weight"] = torch.ones(D)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(D)
    weights["model.norm.weight"] = torch.full((D,), LM_HEAD_LOGIT_STD) if tied else torch.ones(D)
    if not tied:
        weights["lm_head.weight"] = normal(V, D, LM_HEAD_LOGIT_STD / math.sqrt(D))
    return weights


def train_tokenizer(seed: int, vocab_size: int):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on the synthetic corpus; deterministic per seed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from batchlm.model import synthetic_corpus

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(synthetic_corpus.generate(seed), trainer=trainer)
    return tokenizer


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, attention: str = "auto",
               linear: str = "auto", pointwise: str = "auto", weights: str = "auto",
               activations: str = "float32") -> LlamaForCausalLM:
    """Load a Llama-family checkpoint from local disk (a HF folder or a GGUF file), in eval mode; `.config`
    is its ModelConfig.

    dtype None means float32 on CPU and bfloat16 elsewhere. Weights are converted on copy.
    `attention` picks the attention path (LlamaForCausalLM.set_attention), `linear` the packed matmul
    (LlamaForCausalLM.prepack_linears), `pointwise` the element-wise ops (LlamaForCausalLM.set_pointwise).
    `weights` "auto" keeps a GGUF file's Q4_0, Q4_1, Q8_0, F16 and BF16 tensors as stored where they can
    run (batchlm/model/quantized.py: a float32 CPU model, `linear` "auto" or "kernel"); "dense"
    dequantizes every tensor to `dtype`. `activations` "int8" multiplies the kept Q4_0, Q4_1 and Q8_0 tensors
    against activations rounded to int8, "bfloat16" the kept BF16 tensors against activations rounded to
    bfloat16 (quantized.py; where the kernel has no vector code, a warning and float32).
    """
    check_weights(weights, activations)
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    tensors = checkpoint_weights(model_dir)
    if weights == "auto" and linear in ("auto", "kernel") and isinstance(tensors, GGUFWeights) \
            and can_hold_quantized(model):
        load_quantized(model, tensors, activations=activations)
    elif activations != "float32":  # NOTE: said, not silent: the user asked for a tier this model cannot run
        log.warning("activations %s multiplies a GGUF file's kept %s blocks; %s has none that run here (a float32 "
                    "CPU model, linear auto or kernel): float32 activations", activations,
                    "/".join(FAST_TYPES[activations]), model_dir)
    model.load_hf_state_dict(tensors)
    if isinstance(tensors, GGUFWeights):
        tensors.unmap()
    model.prepack_linears(linear)  # no-op off CPU
    model.set_attention(attention)
    model.set_pointwise(pointwise)
    return model


def checkpoint_weights(model_dir: str | Path) -> Mapping[str, torch.Tensor]:
    """HF name -> tensor of a checkpoint folder (safetensors) or of a GGUF file (dequantized as read)."""
    from batchlm.model.gguf_file import is_gguf, open_gguf

    return open_gguf(model_dir).weights() if is_gguf(model_dir) else SafetensorsCheckpoint(model_dir)


class SafetensorsCheckpoint(Mapping):
    """Read-only, lazy name -> tensor view of model.safetensors or of the shards an index names."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: root / shard for name, shard in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            single = root / "model.safetensors"
            with safe_open(str(single), framework="pt") as f:
                self._files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {root}")
        self._handles: dict[Path, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"tensor {name!r} missing from checkpoint")
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n").encode()


def _write_atomic(path: Path, data: bytes) -> str:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
