"""torch.ops.batchlm.linear_q8 and models with `activations="int8"`: Q4_0, Q4_1 and Q8_0 blocks multiplied in
integers against activations rounded to int8 per block of 32 (batchlm/kernels/linear_int8.cpp). Not exact,
so each output is checked against a float64 evaluation of the arithmetic the kernel's header states, and
what must stay exact is checked to the bit: a row's result whatever its batch and threads, the embedding's
values, and a request's tokens and log-probabilities whatever else is batched with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchlm import kernels
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.model.checkpoint import load_model
from batchlm.model.gguf_file import QUANTIZED_TYPES
from batchlm.model.quantized import QuantizedEmbedding
from batchlm.model.tokenizer import Tokenizer
from tests.unit.test_quantized_linear import PROMPTS, files, quantized, random_blocks  # noqa: F401 (fixture)
from tests.unit.torch_threads import intra_op_threads

KINDS = ("Q4_0", "Q4_1", "Q8_0")
ROWS = (1, 2, 3, 4, 5, 9, 96, 97, 200)  # register blocks of 4 and a short one, more than one chunk of 96


@pytest.fixture(scope="module", autouse=True)
def native():
    if not kernels.linear_q8_is_native():
        pytest.skip("batchlm::linear_q8 has no vector code here (needs AVX2)")


def q8(x: torch.Tensor, packed: torch.Tensor, kind: str, n: int) -> torch.Tensor:
    return torch.ops.batchlm.linear_q8(x, packed, QUANTIZED_TYPES[kind], n)


def stated(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The header's arithmetic in float64 from the file's blocks: x rounded per block of 32 as the kernel
    rounds it (in float32), times the integer weights, scaled by the blocks' d (and m)."""
    T, K = x.shape
    xb = x.numpy().reshape(T, K // 32, 32)
    a = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(a > 0, np.float32(127) / np.where(a > 0, a, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv).astype(np.float64)  # float32 product, rounded half to even as nearbyint
    dx = (a / np.float32(127)).astype(np.float64)
    blocks = raw.numpy().reshape(raw.shape[0], K // 32, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # (N, NB)
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.float64)
    else:
        nib = blocks[..., 4 if kind == "Q4_1" else 2:]
        q = np.concatenate([nib & 15, nib >> 4], -1).astype(np.float64) - (8 if kind == "Q4_0" else 0)
    out = np.einsum("tbk,nbk,tb,nb->tn", xq, q, dx[..., 0], d)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        out += np.einsum("tb,tb,nb->tn", xq.sum(-1), dx[..., 0], m)
    return torch.from_numpy(out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [quantized, random_blocks], ids=["written", "random"])
@pytest.mark.parametrize("n,k", [(100, 96), (576, 1536), (64, 32)])
def test_outputs_are_the_stated_int8_arithmetic(kind, make, n, k):
    raw, dense = make(kind, n, k, seed=n + k)
    packed = torch.ops.batchlm.pack_linear_q8(raw, QUANTIZED_TYPES[kind])
    assert packed.shape == torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[kind]).shape  # same tile sizes
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1))
    x[3, :32] = 0  # a block of zeros: no scale, no division by zero
    x[4, 5] = 1e4  # a block whose other values round to zero
    want = stated(x, raw, kind)
    for t in ROWS:
        got = q8(x[:t], packed, kind, n).double()
        scale = want[:t].abs().max().clamp_min(1e-30)
        assert ((got - want[:t]).abs() <= 1e-5 * scale).all(), t
    if make is quantized:  # real blocks: int8 activations stay close to the exact product
        exact = x.double() @ dense.double().T
        assert (q8(x, packed, kind, n).double() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch_or_the_threads(kind):
    raw, _ = quantized(kind, 300, 576)
    packed = torch.ops.batchlm.pack_linear_q8(raw, QUANTIZED_TYPES[kind])
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([q8(x[i:i + 1], packed, kind, 300) for i in range(130)])
    for threads in (1, 2):
        with intra_op_threads(threads):
            for t in (2, 5, 7, 130):
                assert torch.equal(q8(x[:t], packed, kind, 300), alone[:t])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [quantized, random_blocks], ids=["written", "random"])
def test_embedding_rows_have_the_exact_layouts_values(kind, make):
    raw, dense = make(kind, 100, 96)
    packed = torch.ops.batchlm.pack_linear_q8(raw, QUANTIZED_TYPES[kind])
    ids = torch.tensor([99, 0, 64, 5, 5, 63])
    assert torch.equal(torch.ops.batchlm.embedding_q8(packed, QUANTIZED_TYPES[kind], ids), dense[ids])


def test_bad_arguments_are_refused_naming_what_is_wrong():
    raw, _ = quantized("Q4_1", 64, 64)
    packed = torch.ops.batchlm.pack_linear_q8(raw, 3)
    with pytest.raises(RuntimeError, match="qtype must be 2"):
        torch.ops.batchlm.pack_linear_q8(raw, 1)  # F16 has no int8 form
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.batchlm.linear_q8(torch.zeros(1, 32), packed, 3, 64)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.batchlm.linear_q8(torch.zeros(1, 64), packed, 8, 64)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.batchlm.embedding_q8(packed, 3, torch.tensor([64]))
    with pytest.raises(InvalidArgument, match="activations"):
        EngineConfig(activations="int4")
    with pytest.raises(InvalidArgument, match="activations"):
        EngineConfig(activations="int8", weights="dense")


def engine(path, config: EngineConfig) -> LLMEngine:
    model = load_model(path, weights=config.weights, activations=config.activations)
    return LLMEngine.from_parts(model, Tokenizer.from_dir(path), config)


@pytest.mark.parametrize("kind", ["Q4_1", "mixed"])
def test_a_request_answers_the_same_alone_and_batched(files, kind):  # noqa: F811 (the fixture)
    config = EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=64, activations="int8")
    model = load_model(files[kind], activations="int8")
    assert model.lm_head.backend == "int8" and model.layers[0].mlp.down_proj.backend == "int8"
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.embed_tokens.lookup is torch.ops.batchlm.embedding_q8
    assert (model.embed_tokens.packed is model.lm_head.packed) == (kind == "mixed")  # tied: one copy
    if kind == "mixed":  # a projection of two types stays dense
        assert model.layers[1].mlp.gate_up_proj.backend == "kernel"
        assert model.layers[0].self_attn.qkv_proj.backend == "kernel"
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    e = engine(files[kind], config)
    together = e.generate(PROMPTS, [params] * len(PROMPTS))
    for prompt, want in zip(PROMPTS, together):
        alone = engine(files[kind], config).generate([prompt], [params])[0]
        assert (alone.token_ids, alone.logprobs) == (want.token_ids, want.logprobs)
    exact = engine(files[kind], EngineConfig(num_kv_blocks=64, max_model_len=256)).generate(
        PROMPTS, [params] * len(PROMPTS))
    assert any(o.logprobs != x.logprobs for o, x in zip(together, exact))  # int8 ran: not the exact model


def test_int8_on_a_model_without_kept_blocks_says_so_and_runs_float32(files, caplog):  # noqa: F811
    """A safetensors folder has no blocks to multiply in integers: a warning, and the float32 kernel."""
    folder = files["Q4_1"].parent / "hf"
    with caplog.at_level("WARNING", logger="batchlm.model.checkpoint"):
        model = load_model(folder, activations="int8")
    assert "activations int8" in caplog.text and model.lm_head.backend == "kernel"
