"""GGUF checkpoints: a llama file loads with the same shape, weights, tokenizer and chat template as the
Hugging Face folder it was written from; every supported tensor type dequantizes as transformers'
own GGUF code does; what cannot run is refused naming the key or tensor; the default model's file reads
as its model card says."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from batchlm.errors import InvalidArgument
from batchlm.model.checkpoint import SafetensorsCheckpoint, load_model, write_default_checkpoint
from batchlm.model.gguf_export import write_gguf
from batchlm.model.gguf_file import SUPPORTED_TYPES, is_gguf, open_gguf
from batchlm.model.gguf_header import read_header
from batchlm.model.model_config import ModelConfig
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import DEFAULT_MODEL

SIZE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=512, max_position_embeddings=256)
TEXTS = ["Once upon a time", "the cat sat on 12 mats.\n\nThen?", "  spaces  and\ttabs ", "é ü 日本"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small random Llama folder and the same model as GGUF files of several tensor types."""
    root = tmp_path_factory.mktemp("gguf")
    folder = write_default_checkpoint(root / "hf", seed=3, **SIZE)
    files = {kind: write_gguf(folder, root / f"{kind}.gguf", lambda name, k=kind: k)
             for kind in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")}
    return folder, files


def test_a_gguf_file_has_the_shape_of_its_folder(small):
    folder, files = small
    from_folder = ModelConfig.from_dir(folder)
    from_file = ModelConfig.from_dir(files["F32"])
    assert from_file == from_folder
    assert is_gguf(files["F32"]) and not is_gguf(folder)


def test_an_f32_gguf_file_loads_the_folders_weights_exactly(small):
    folder, files = small
    ref = load_model(folder, attention="torch", linear="onednn", pointwise="torch").state_dict()
    got = load_model(files["F32"], attention="torch", linear="onednn", pointwise="torch").state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_a_quantized_file_loads_the_dequantized_weights_in_hugging_face_order(small, kind):
    """Each matrix is what the `gguf` package's round trip of the folder's tensor gives: the Q and K rows
    are put back in Hugging Face's order, no tensor is swapped for another."""
    folder, files = small
    weights = open_gguf(files[kind]).weights()
    source = SafetensorsCheckpoint(folder)
    qtype = gguf.GGMLQuantizationType[kind]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        want = gguf.quants.dequantize(gguf.quants.quantize(source[name].numpy(), qtype), qtype)
        assert torch.equal(weights[name], torch.from_numpy(np.asarray(want, dtype=np.float32))), name
        err = (weights[name] - source[name]).abs().max().item()
        assert err <= 0.2 * source[name].abs().max().item(), (name, err)
    assert torch.equal(weights["model.norm.weight"], source["model.norm.weight"])


# Byte offsets of the float16 scales in one block of each type (llama.cpp's block layouts): set to a
# finite value so random blocks dequantize to finite numbers in both implementations.
_F16_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("kind", [k for k in SUPPORTED_TYPES if k not in ("F32", "F16", "BF16", "Q5_0", "Q5_1")])
def test_every_quantized_type_dequantizes_as_transformers_does(tmp_path, kind):
    """Random blocks of each type, written to a file and read back, against transformers' own GGUF
    dequantization (an independent implementation; it has no Q5_0 and Q5_1, which the round trip of
    test_a_quantized_file_loads_the_dequantized_weights_in_hugging_face_order covers)."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 4, 2 * 256
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_OFFSETS[kind]:
        raw[..., offset:offset + 2] = rng.uniform(-0.1, 0.1, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    path = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, tensors = read_header(path)
    info = tensors["blk.0.ffn_up.weight"]
    assert (info.type_name, info.shape) == (kind, (rows, cols))
    ours = open_gguf_raw(path, info)
    theirs = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype), torch.float32).reshape(rows, cols)
    assert torch.isfinite(theirs).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def open_gguf_raw(path, info) -> torch.Tensor:
    """One tensor of a file without the llama metadata the full reader asks for."""
    from batchlm.model.gguf_file import GGUFFile

    file = GGUFFile.__new__(GGUFFile)
    file.path = path
    values = gguf.quants.dequantize(file.tensor_bytes(info), gguf.GGMLQuantizationType[info.type_name])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))


def test_the_tokenizer_of_a_gguf_file_encodes_as_its_tokenizer_json(small):
    folder, files = small
    ref, got = Tokenizer.from_dir(folder), Tokenizer.from_dir(files["Q4_0"])
    assert (got.add_bos, got.bos_token_id, got.eos_token_ids) == (ref.add_bos, ref.bos_token_id, ref.eos_token_ids)
    for text in TEXTS:
        assert got.encode(text) == ref.encode(text), text
        assert got.decode(got.encode(text)) == ref.decode(ref.encode(text))


def test_the_chat_template_comes_from_the_file(small):
    from batchlm.model.chat_template import load_chat_template

    folder, files = small
    messages = [{"role": "user", "content": "Hi"}]
    assert load_chat_template(files["F32"]).render(messages) == load_chat_template(folder).render(messages)


def test_a_folder_saved_by_transformers_5_gives_its_chat_template_jinja(small, tmp_path):
    from batchlm.model.chat_template import load_chat_template

    folder, _ = small
    copy = shutil.copytree(folder, tmp_path / "hf5")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_chat_template(copy).render([{"role": "user", "content": "Hi"}]) == "[Hi]"


def _rewrite(src, dst, *, drop_key=None, set_string=None, tensor_kind=None):
    """A copy of the GGUF `src` with one metadata key dropped or one string key changed, or the first
    matrix's type changed."""
    fields, tensors = read_header(src)
    weights = open_gguf(src)
    w = gguf.GGUFWriter(str(dst), fields["general.architecture"] if set_string is None
                        or set_string[0] != "general.architecture" else set_string[1])
    for key, value in fields.items():
        if key in (drop_key, "general.architecture", "GGUF.version") or key.startswith("GGUF."):
            continue
        if set_string and key == set_string[0]:
            value = set_string[1]
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif value and isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_array(key, [int(v) for v in value])
    for name, info in tensors.items():
        raw = np.array(weights.tensor_bytes(info))
        if tensor_kind and name == "blk.0.ffn_up.weight":
            w.add_tensor(name, np.zeros((info.shape[0], info.shape[1]), dtype=np.int8),
                         raw_dtype=gguf.GGMLQuantizationType[tensor_kind])
            continue
        w.add_tensor(name, raw.view(np.float32).reshape(info.shape))  # the F32 file's tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("change, field", [
    (dict(set_string=("general.architecture", "mistral3")), "general.architecture"),
    (dict(drop_key="llama.block_count"), "llama.block_count"),
    (dict(drop_key="tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (dict(set_string=("tokenizer.ggml.model", "llama")), "tokenizer.ggml.model"),
    (dict(set_string=("tokenizer.ggml.pre", "no-such-pre")), "tokenizer.ggml.pre"),
    (dict(tensor_kind="I8"), "blk.0.ffn_up.weight"),
])
def test_what_cannot_run_is_refused_naming_the_key_or_tensor(small, tmp_path, change, field):
    _, files = small
    bad = _rewrite(files["F32"], tmp_path / "bad.gguf", **change)
    with pytest.raises(InvalidArgument) as err:
        load_model(bad)
        Tokenizer.from_dir(bad)
    assert err.value.field == field, str(err.value)


def test_a_file_that_is_not_gguf_is_refused_naming_model_dir(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidArgument, match="model_dir"):
        ModelConfig.from_dir(path)
    with pytest.raises(InvalidArgument, match="model_dir: no GGUF file"):
        ModelConfig.from_dir(tmp_path / "absent.gguf")


def test_the_default_model_reads_as_smollm2_135m_instruct():
    """What set-up put in models/: its shape, tokenizer and template as the model card gives them."""
    cfg = ModelConfig.from_dir(DEFAULT_MODEL)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.max_position_embeddings) \
        == (30, 576, 1536, 9, 3, 64, 49152, 100000.0, True, 8192)
    file = open_gguf(DEFAULT_MODEL)
    assert file.tensor_types() == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    assert (tok.add_bos, tok.bos_token_id, tok.eos_token_ids) == (False, 1, frozenset({2}))
    assert file.special_token(2) == "<|im_end|>"
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are matched whole
    assert tok.encode("2024") == [tok.hf.token_to_id(d) for d in "2024"]  # smollm splits digits one by one
    assert "<|im_start|>assistant" in file.chat_template


def test_a_gguf_file_exported_as_a_hugging_face_folder_loads_the_same(small, tmp_path):
    """What the TensorRT-LLM build converts: the same weights, tokenizer and chat template as the file."""
    from batchlm.model.chat_template import load_chat_template
    from batchlm.model.gguf_export import export_hf

    _, files = small
    folder = export_hf(files["Q4_1"], tmp_path / "hf")
    ref = load_model(files["Q4_1"], attention="torch", linear="onednn", pointwise="torch").state_dict()
    got = load_model(folder, attention="torch", linear="onednn", pointwise="torch").state_dict()
    assert all(torch.equal(ref[name], got[name]) for name in ref)
    assert ModelConfig.from_dir(folder) == ModelConfig.from_dir(files["Q4_1"])
    tok_ref, tok_got = Tokenizer.from_dir(files["Q4_1"]), Tokenizer.from_dir(folder)
    assert (tok_got.add_bos, tok_got.eos_token_ids) == (tok_ref.add_bos, tok_ref.eos_token_ids)
    assert all(tok_got.encode(t) == tok_ref.encode(t) for t in TEXTS)
    messages = [{"role": "user", "content": "Hi"}]
    assert load_chat_template(folder).render(messages) == load_chat_template(files["Q4_1"]).render(messages)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    export_hf(files["Q4_1"], folder)  # current: kept
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_the_command_rewrites_a_file_or_a_folder_with_every_matrix_of_one_type(small, tmp_path, capsys):
    """python -m batchlm.model.gguf_export: from a GGUF file (dequantized first) the same model as BF16, the
    Q4_1 weights rounded to bfloat16; from a folder, as the writer writes it."""
    from batchlm.model.gguf_export import main

    folder, files = small
    assert main([str(files["Q4_1"]), str(tmp_path / "from-file.gguf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "from-file.gguf")
    reader = gguf.GGUFReader(tmp_path / "from-file.gguf")
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {"BF16"}
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 1} == {"F32"}
    want = open_gguf(files["Q4_1"]).weights()
    got = open_gguf(tmp_path / "from-file.gguf").weights()
    assert all(torch.equal(got[name], want[name].to(torch.bfloat16).float()) for name in want)
    assert main([str(folder), str(tmp_path / "from-folder.gguf"), "--type", "Q8_0"]) == 0
    assert (tmp_path / "from-folder.gguf").read_bytes() == files["Q8_0"].read_bytes()


def test_a_rewritten_file_keeps_its_pre_tokenizer_and_every_end_token(small, tmp_path):
    """What the folder in between cannot say: the file's `tokenizer.ggml.pre` (SmolLM2's `smollm` splits
    digits one by one) and its end-of-turn token beside EOS."""
    from batchlm.model.gguf_export import main

    folder, _ = small
    config = json.loads((folder / "config.json").read_text())
    source = tmp_path / "hf"
    shutil.copytree(folder, source)
    (source / "config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], 7]}))
    write_gguf(source, tmp_path / "source.gguf", lambda name: "Q4_1", pre="smollm")
    assert main([str(tmp_path / "source.gguf"), str(tmp_path / "bf16.gguf")]) == 0
    rewritten, original = open_gguf(tmp_path / "bf16.gguf"), open_gguf(tmp_path / "source.gguf")
    assert rewritten.metadata("tokenizer.ggml.pre") == "smollm"
    assert rewritten.eos_token_ids == original.eos_token_ids == (config["eos_token_id"], 7)
    assert Tokenizer.from_dir(tmp_path / "bf16.gguf").encode("year 2024") == \
        Tokenizer.from_dir(tmp_path / "source.gguf").encode("year 2024")


def test_llama3_rope_scaling_comes_as_per_frequency_factors_and_rotates_as_the_folder(tmp_path):
    """llama.cpp's converter writes llama3 RoPE scaling as `rope_freqs.weight` (Llama 3.1 and 3.2 files):
    read into the config, the RoPE tables equal the folder's llama3 ones to float32 rounding."""
    from batchlm.model.gguf_export import export_hf
    from batchlm.model.rope import RotaryEmbedding, rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    folder = write_default_checkpoint(tmp_path / "hf", seed=4, rope_scaling=scaling, **SIZE)
    file = write_gguf(folder, tmp_path / "llama3.gguf")
    assert "rope_freqs.weight" in read_header(file)[1]
    ref, got = ModelConfig.from_dir(folder), ModelConfig.from_dir(file)
    assert got.rope_scaling is None and len(got.rope_freq_factors) == SIZE["head_dim"] // 2
    assert max(got.rope_freq_factors) == pytest.approx(8.0) and min(got.rope_freq_factors) == pytest.approx(1.0)
    torch.testing.assert_close(rope_inv_freq(got), rope_inv_freq(ref), rtol=1e-6, atol=0)
    torch.testing.assert_close(RotaryEmbedding(got).cos, RotaryEmbedding(ref).cos, rtol=0, atol=1e-5)
    model = load_model(file, attention="torch", linear="onednn", pointwise="torch")  # the factors are no weight
    assert model.config == got
    with pytest.raises(InvalidArgument, match="rope_freqs.weight"):
        export_hf(file, tmp_path / "export")
