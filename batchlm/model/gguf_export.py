"""GGUF files written by the project: a Hugging Face Llama folder as a llama GGUF file (`write_gguf`, the
peers benchmark's llama.cpp input and the tests' files of every tensor type), and a GGUF file as a Hugging
Face folder (`export_hf`, what TensorRT-LLM's checkpoint conversion reads). Reading one: gguf_file.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from batchlm.errors import InvalidArgument
from batchlm.model.gguf_file import _BLOCK_NAMES, ARCHITECTURE, ROPE_FREQS, open_gguf
from batchlm.model.tokenizer import chat_template_of

_HF_BLOCK_NAMES = {hf: gguf for gguf, hf in _BLOCK_NAMES.items()}


def _permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's Q and K rows in llama.cpp's order (the inverse of _unpermute_rope_rows)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



def write_gguf(model_dir: str | Path, out: str | Path, tensor_type: Callable[[str], str] = lambda name: "F32",
               pre: str = "default") -> Path:
    """Write a Hugging Face Llama folder (a byte-level BPE tokenizer.json) as a llama GGUF file, as
    llama.cpp's converter lays one out: its tensor names, Q and K rows in its RoPE order, the vocabulary,
    merges, special tokens and chat template in the metadata. `tensor_type(gguf_name)` picks each matrix's
    type (a name of SUPPORTED_TYPES that the `gguf` package can quantize: F32, F16, BF16, Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1); norms stay F32. `pre` is the pre-tokenizer's name (`tokenizer.ggml.pre`: a folder
    does not say which llama.cpp's is; a GGUF file exported with export_hf does). An `eos_token_id` list is
    written as EOS, then end-of-turn and end-of-message, as gguf_file reads them back. Written to a
    temporary file, then renamed."""
    import json

    import gguf

    from batchlm.model.checkpoint import SafetensorsCheckpoint

    root, out = Path(model_dir), Path(out)
    config = json.loads((root / "config.json").read_text())
    scaling = config.get("rope_scaling") or {}
    if config.get("model_type") != "llama" or scaling.get("rope_type", scaling.get("type", "llama3")) != "llama3":
        raise ValueError("write_gguf handles Llama checkpoints with no RoPE scaling or llama3's only")
    tok = json.loads((root / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"write_gguf handles BPE tokenizers only, not {tok['model']['type']}")
    tok_cfg_path = root / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [vocab[i] for i in range(config["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), ARCHITECTURE)
    w.add_name(root.name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    if config.get("bos_token_id") is not None:
        w.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    for add, token in zip((w.add_eos_token_id, w.add_eot_token_id, w.add_eom_token_id), eos):
        add(token)
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", True)))
    template = chat_template_of(root)[0]
    if template:
        w.add_chat_template(template)
    if scaling:  # NOTE: as llama.cpp's converter writes llama3 scaling: the divisor of each frequency
        from dataclasses import replace

        from batchlm.model.model_config import ModelConfig
        from batchlm.model.rope import rope_inv_freq

        scaled = ModelConfig.from_hf_dict(config)
        factors = rope_inv_freq(replace(scaled, rope_scaling=None)) / rope_inv_freq(scaled)
        w.add_tensor(ROPE_FREQS, factors.numpy().astype(np.float32))
    weights = SafetensorsCheckpoint(root)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.get("tie_word_embeddings"):
        names["lm_head.weight"] = "output.weight"
    for b in range(config["num_hidden_layers"]):
        for hf, short in _HF_BLOCK_NAMES.items():
            names[f"model.layers.{b}.{hf}.weight"] = f"blk.{b}.{short}.weight"
    for hf_name, name in names.items():
        values = np.ascontiguousarray(weights[hf_name].float().numpy())
        proj = hf_name.rsplit(".", 2)[-2]
        if proj in ("q_proj", "k_proj"):
            values = _permute_rope_rows(values, heads if proj == "q_proj" else kv_heads)
        kind = "F32" if values.ndim == 1 else tensor_type(name)
        if kind == "F32":
            w.add_tensor(name, values)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF file at `path` as a Hugging Face Llama folder: config.json, model.safetensors (the
    weights as this package loads them: dequantized to float32), tokenizer.json, tokenizer_config.json,
    chat_template.jinja and generation_config.json. For tools that read only that layout (TensorRT-LLM's
    checkpoint conversion). Kept as it is when its manifest names this file's size and time."""
    import json

    from safetensors.torch import save_file

    gguf = open_gguf(path)
    if gguf.hf_config["rope_freq_factors"] is not None:
        raise InvalidArgument(ROPE_FREQS, "per-frequency RoPE factors have no Hugging Face config form to export")
    out = Path(out_dir)
    stat = gguf.path.stat()
    stamp = {"source": gguf.path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    manifest = out / "batchlm_export.json"
    if manifest.is_file() and json.loads(manifest.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in gguf.hf_config.items() if k != "rope_freq_factors"}
    config["torch_dtype"] = "float32"
    config["eos_token_id"] = config["eos_token_id"][0] if len(config["eos_token_id"]) == 1 else config["eos_token_id"]
    bos, eos = gguf.special_token(gguf.bos_token_id), gguf.special_token(gguf.eos_token_ids[0])
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": gguf.bos_token_id, "eos_token_id": config["eos_token_id"]},
        "tokenizer_config.json": {"add_bos_token": gguf.add_bos, "add_eos_token": False, "bos_token": bos,
                                  "eos_token": eos, "clean_up_tokenization_spaces": False,
                                  "model_max_length": config["max_position_embeddings"],
                                  "tokenizer_class": "PreTrainedTokenizerFast"},
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2) + "\n")
    (out / "tokenizer.json").write_text(gguf.tokenizer().to_str(pretty=True))
    if gguf.chat_template:
        (out / "chat_template.jinja").write_text(gguf.chat_template)
    weights = gguf.weights()
    tensors = {name: weights[name].contiguous() for name in weights}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")
    manifest.write_text(json.dumps(stamp) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m batchlm.model.gguf_export SOURCE OUT [--type BF16]: SOURCE (a Hugging Face Llama folder, or a
    GGUF file, dequantized as this package reads it) written as a GGUF file whose matrices are of --type."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m batchlm.model.gguf_export", description=main.__doc__)
    ap.add_argument("source", type=Path, help="a Hugging Face Llama folder or a llama GGUF file")
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    ap.add_argument("--type", default="BF16", choices=("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
                    help="every matrix's type (norms stay F32)")
    args = ap.parse_args(argv)
    if args.source.is_dir():
        print(write_gguf(args.source, args.out, lambda name: args.type))
        return 0
    with tempfile.TemporaryDirectory(prefix="gguf-export-") as folder:
        hf = export_hf(args.source, Path(folder) / args.source.stem)  # the file's stem: the written name
        pre = open_gguf(args.source).metadata("tokenizer.ggml.pre", "default")
        print(write_gguf(hf, args.out, lambda name: args.type, pre=pre))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
