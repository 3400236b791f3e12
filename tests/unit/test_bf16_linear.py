"""torch.ops.batchlm.linear_bf16 and models with `activations="bfloat16"`: a GGUF file's BF16 weights multiplied
with AVX-512 BF16's dot product against activations rounded to bfloat16 (batchlm/kernels/linear.cpp). Not
exact against the float32 product, so each output is checked to the bit against the operations the kernel's
header states (the instruction's two float32 additions per pair), and so is what must stay exact: a row's
result whatever its batch and threads, the embedding's values, and a request's tokens and log-probabilities
whatever else is batched with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchlm import kernels
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.model.checkpoint import load_model, write_default_checkpoint
from batchlm.model.gguf_export import write_gguf
from batchlm.model.quantized import QuantizedEmbedding
from tests.unit.test_int8_linear import engine
from tests.unit.test_quantized_linear import PROMPTS, files  # noqa: F401 (fixture)
from tests.unit.torch_threads import intra_op_threads

ROWS = (1, 2, 5, 6, 7, 13, 96, 97, 200)  # register blocks of 6 and short ones, more than one chunk of 96


@pytest.fixture(scope="module", autouse=True)
def native():
    if not kernels.linear_is_native(torch.bfloat16):
        pytest.skip("batchlm::linear_bf16 needs AVX-512 BF16")


def stated(x: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    """The header's arithmetic in numpy: x rounded to bfloat16, then per pair j from acc = 0, acc += x[2j+1]
    w[2j+1], then acc += x[2j] w[2j], each a float32 addition of an exact product (8-bit by 8-bit fractions)."""
    xb, wb = x.to(torch.bfloat16).float().numpy(), w.float().numpy()  # (T, K), (N, K)
    if xb.shape[1] % 2:
        xb, wb = np.pad(xb, ((0, 0), (0, 1))), np.pad(wb, ((0, 0), (0, 1)))
    acc = np.zeros((xb.shape[0], wb.shape[0]), np.float32)
    for j in range(xb.shape[1] // 2):
        for k in (2 * j + 1, 2 * j):
            acc = acc + np.outer(xb[:, k], wb[:, k]).astype(np.float32)  # float32 + float32: one rounding
    return acc


@pytest.mark.parametrize("n,k", [(70, 33), (128, 96), (200, 576)])
def test_outputs_are_the_stated_bfloat16_arithmetic_to_the_bit(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(max(ROWS), k, generator=g)
    x[3, :5] = 1 + 2.0 ** -8  # halfway between 1 and the next bfloat16 (1 + 2^-7): to even, 1
    x[4, :5] = -(1 + 3 * 2.0 ** -8)  # halfway between -(1 + 2^-7) and -(1 + 2^-6): to even, -(1 + 2^-6)
    packed = torch.ops.batchlm.pack_linear(w)
    want = stated(x, w)
    for t in ROWS:
        got = torch.ops.batchlm.linear_bf16(x[:t], packed, n)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want[:t]), t


def test_a_row_does_not_depend_on_its_batch_or_the_threads():
    g = torch.Generator().manual_seed(2)
    packed = torch.ops.batchlm.pack_linear(torch.randn(300, 576, generator=g).to(torch.bfloat16))
    x = torch.randn(130, 576, generator=g)
    alone = torch.cat([torch.ops.batchlm.linear_bf16(x[i:i + 1], packed, 300) for i in range(130)])
    for threads in (1, 2):
        with intra_op_threads(threads):
            for t in (2, 7, 130):
                assert torch.equal(torch.ops.batchlm.linear_bf16(x[:t], packed, 300), alone[:t])


def test_bad_arguments_are_refused_naming_what_is_wrong():
    w = torch.randn(64, 64)
    packed = torch.ops.batchlm.pack_linear(w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.batchlm.linear_bf16(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.batchlm.linear_bf16(torch.zeros(1, 64), torch.ops.batchlm.pack_linear(w), 64)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.batchlm.linear_bf16(torch.zeros(1, 32), packed, 64)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.batchlm.linear_bf16(torch.zeros(1, 64), packed, 65)
    with pytest.raises(InvalidArgument, match="activations"):
        EngineConfig(activations="bfloat16", weights="dense")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A small random Llama with tied embeddings (as the default model) as a BF16 GGUF file."""
    root = tmp_path_factory.mktemp("bf16")
    folder = write_default_checkpoint(root / "hf", seed=7, tie_word_embeddings=True, hidden_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      intermediate_size=256, vocab_size=512, max_position_embeddings=256)
    return write_gguf(folder, root / "BF16.gguf", lambda name: "BF16")


def test_a_request_answers_the_same_alone_and_batched(tied):
    model = load_model(tied, activations="bfloat16")
    linears = [model.lm_head] + [m for layer in model.layers for m in
                                 (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                  layer.mlp.down_proj)]
    assert {m.backend for m in linears} == {"bfloat16"}
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.packed is model.lm_head.packed
    exact_model = load_model(tied)
    ids = torch.tensor([511, 0, 64, 5, 5, 130])
    assert torch.equal(model.embed_tokens(ids), exact_model.embed_tokens(ids))  # the file's values, exactly
    assert model.embed_tokens(ids[:0]).shape == (0, 128)
    config = EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=64, activations="bfloat16")
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    together = engine(tied, config).generate(PROMPTS, [params] * len(PROMPTS))
    for prompt, want in zip(PROMPTS, together):
        alone = engine(tied, config).generate([prompt], [params])[0]
        assert (alone.token_ids, alone.logprobs) == (want.token_ids, want.logprobs)
    exact = engine(tied, EngineConfig(num_kv_blocks=64, max_model_len=256)).generate(PROMPTS, [params] * len(PROMPTS))
    assert any(o.logprobs != x.logprobs for o, x in zip(together, exact))  # bfloat16 ran: not the exact model


def test_only_bf16_linears_take_the_tier(files):  # noqa: F811 (the fixture)
    """An untied BF16 embedding stays in linear_q's layout (it is only looked up); other types stay exact."""
    model = load_model(files["BF16"], activations="bfloat16")
    assert model.lm_head.backend == "bfloat16" and model.embed_tokens.layout == "float32"
    mixed = load_model(files["mixed"], activations="bfloat16")  # Q4_1, Q8_0 and F16: no BF16
    assert {mixed.lm_head.backend, mixed.layers[0].mlp.down_proj.backend} == {"quantized"}
    f16 = load_model(files["F16"], activations="bfloat16")
    assert f16.lm_head.backend == "quantized"


def test_bfloat16_on_a_model_without_kept_blocks_says_so_and_runs_float32(files, caplog):  # noqa: F811
    folder = files["BF16"].parent / "hf"
    with caplog.at_level("WARNING", logger="batchlm.model.checkpoint"):
        model = load_model(folder, activations="bfloat16")
    assert "activations bfloat16" in caplog.text and "BF16" in caplog.text and model.lm_head.backend == "kernel"
