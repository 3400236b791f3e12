"""torch.ops.batchlm.linear_q and models holding a GGUF file's Q4_0, Q4_1 and Q8_0 tensors as stored: a
weight dequantizes exactly as the `gguf` package reads it, every output has the bits of batchlm::linear on
the dequantized weight (so the quantized model answers as the float32 one, token for token and
log-probability for log-probability), whatever the batch, the register block, the chunk and the threads."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from batchlm import kernels
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.model.checkpoint import load_model, write_default_checkpoint
from batchlm.model.gguf_export import write_gguf
from batchlm.model.gguf_file import QUANTIZED_TYPES
from batchlm.model.quantized import QuantizedEmbedding
from batchlm.model.tokenizer import Tokenizer
from tests.unit.torch_threads import intra_op_threads

KINDS = tuple(QUANTIZED_TYPES)
# Row counts that run the in-register blocks (AVX-512: up to 4 rows in one pass, 5 to 8 in two; AVX2: up to
# 4), the L1 tiles (from 9, or 5 with AVX2: blocks of 6 and a short last one) and more than one chunk of 96 rows.
ROWS = (1, 3, 4, 5, 8, 9, 13, 96, 97, 200)
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog and then", "A"]


@pytest.fixture(scope="module", autouse=True)
def native():
    if not kernels.linear_q_is_native():
        pytest.skip("batchlm::linear_q has no vector code here (needs AVX-512, or AVX2 with FMA and F16C)")


def quantized(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks the gguf package writes for a random (n, k) matrix, their dequantization (n, k))."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / k ** 0.5
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype).view(np.uint8).reshape(n, -1)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of random bytes (every nibble and byte value), with random finite float16 scales: normal,
    subnormal, negative and zero. F16 and BF16: random values with such rows."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F16", "BF16"):
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        w[::7] *= 3e-6 if kind == "F16" else 1e-39  # subnormal in the type
        w[::11] = 0
        raw = gguf.quants.quantize(w, qtype).view(np.uint8).reshape(n, -1)
        return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block_size, block_bytes), dtype=np.uint8)
    scales = 2 if kind == "Q4_1" else 1
    f16 = rng.standard_normal((n, k // block_size, scales)).astype(np.float16) * np.float16(0.01)
    f16[::7] = np.float16(3e-6)  # subnormal
    f16[::11] = 0
    raw[..., :2 * scales] = f16.view(np.uint8)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [quantized, random_blocks], ids=["written", "random"])
def test_rows_dequantize_as_the_gguf_package_reads_them(kind, make):
    raw, dense = make(kind, 100, 96)
    packed = torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[kind])
    assert packed.shape[:2] == (2, 3) and packed.dtype == torch.uint8
    got = torch.ops.batchlm.embedding_q(packed, QUANTIZED_TYPES[kind], torch.arange(100))
    assert torch.equal(got, dense)
    ids = torch.tensor([99, 0, 64, 5, 5])
    assert torch.equal(torch.ops.batchlm.embedding_q(packed, QUANTIZED_TYPES[kind], ids), dense[ids])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(100, 96), (576, 1536), (64, 32)])
def test_every_row_has_the_bits_of_the_float32_kernel_on_the_dequantized_weight(kind, n, k):
    raw, dense = random_blocks(kind, n, k, seed=n + k)
    packed = torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[kind])
    dense_packed = torch.ops.batchlm.pack_linear(dense)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1))
    for t in ROWS:
        want = torch.ops.batchlm.linear(x[:t], dense_packed, n)
        assert torch.equal(torch.ops.batchlm.linear_q(x[:t], packed, QUANTIZED_TYPES[kind], n), want), t


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch_or_the_threads(kind):
    raw, _ = quantized(kind, 300, 576)
    packed = torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[kind])
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([torch.ops.batchlm.linear_q(x[i:i + 1], packed, QUANTIZED_TYPES[kind], 300) for i in range(130)])
    for threads in (1, 2):
        with intra_op_threads(threads):
            for t in (2, 7, 130):
                assert torch.equal(torch.ops.batchlm.linear_q(x[:t], packed, QUANTIZED_TYPES[kind], 300), alone[:t])


def test_bad_arguments_are_refused_naming_what_is_wrong():
    raw, _ = quantized("Q4_1", 64, 64)
    packed = torch.ops.batchlm.pack_linear_q(raw, 3)
    with pytest.raises(RuntimeError, match="qtype must be 1"):
        torch.ops.batchlm.pack_linear_q(raw, 12)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.batchlm.linear_q(torch.zeros(1, 32), packed, 3, 64)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.batchlm.linear_q(torch.zeros(1, 64), packed, 8, 64)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.batchlm.linear_q(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 3, 64)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.batchlm.embedding_q(packed, 3, torch.tensor([64]))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small random Llama as a GGUF file of each quantized type, and one (tied embeddings, as the default
    model's) mixing them."""
    root = tmp_path_factory.mktemp("quantized")
    size = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=256, vocab_size=512, max_position_embeddings=256)
    folder = write_default_checkpoint(root / "hf", seed=5, **size)
    made = {kind: write_gguf(folder, root / f"{kind}.gguf", lambda name, k=kind: k) for kind in KINDS}
    tied = write_default_checkpoint(root / "tied", seed=6, tie_word_embeddings=True, **size)
    mixed = {"blk.0.attn_k.weight": "Q8_0", "blk.1.ffn_up.weight": "F16", "token_embd.weight": "Q8_0"}
    made["mixed"] = write_gguf(tied, root / "mixed.gguf", lambda name: mixed.get(name, "Q4_1"))
    return made


def answers(path, weights: str) -> list:
    engine = LLMEngine.from_parts(load_model(path, weights=weights), Tokenizer.from_dir(path),
                                  EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in engine.generate(PROMPTS, [params] * len(PROMPTS))]


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_a_quantized_file_answers_as_its_dequantized_model(files, kind):
    model = load_model(files[kind])
    linears = [model.lm_head] + [m for layer in model.layers for m in
                                 (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                  layer.mlp.down_proj)]
    backends = [m.backend for m in linears]
    if kind == "mixed":  # a fused projection of two types, or one of another type, stays dense
        assert backends.count("kernel") == 2 and model.layers[0].self_attn.qkv_proj.backend == "kernel"
        assert model.layers[1].mlp.gate_up_proj.backend == "kernel" and model.lm_head.qtype == "Q8_0"
    else:
        assert set(backends) == {"quantized"} and {m.qtype for m in linears} == {kind}
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert (model.embed_tokens.packed is model.lm_head.packed) == (kind == "mixed")  # tied: one copy
    assert answers(files[kind], "auto") == answers(files[kind], "dense")


def test_dense_weights_and_other_paths_dequantize_the_file(files):
    assert load_model(files["Q4_1"], weights="dense").lm_head.backend == "kernel"
    assert load_model(files["Q4_1"], linear="onednn").lm_head.backend == "onednn"
    with pytest.raises(InvalidArgument, match="weights"):
        load_model(files["Q4_1"], weights="int4")
    with pytest.raises(InvalidArgument, match="weights"):
        EngineConfig(weights="int4")


def test_loads_of_one_file_map_one_shared_pack(files, tmp_path):
    """The first load writes the packed blocks beside the file; later loads (the other models' processes)
    map that copy read-only. A changed file gets a new pack and the old one is removed."""
    path = tmp_path / "model.gguf"
    path.write_bytes(files["Q4_1"].read_bytes())
    first = load_model(path)
    packs = sorted(p.name for p in tmp_path.glob(".model.gguf.packed-*") if not p.name.endswith(("json", "lock")))
    assert len(packs) == 1
    written = (tmp_path / packs[0]).stat().st_mtime_ns
    second = load_model(path)
    assert (tmp_path / packs[0]).stat().st_mtime_ns == written
    with open("/proc/self/maps") as maps:  # "start-end perms offset dev inode path": mapped, read-only
        lines = [ln.split() for ln in maps if ln.rstrip().endswith(str(tmp_path / packs[0]))]
    assert lines and all(ln[1].startswith("r-") for ln in lines)
    assert torch.equal(first.lm_head.packed, second.lm_head.packed)
    assert answers(path, "auto") == answers(path, "dense")
    os.utime(path, ns=(written + 10**9, written + 10**9))
    load_model(path)
    now = [p.name for p in tmp_path.glob(".model.gguf.packed-*") if not p.name.endswith(("json", "lock"))]
    assert len(now) == 1 and now != packs
