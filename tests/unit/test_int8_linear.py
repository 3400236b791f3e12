"""torch.ops.batchlm.linear_q8 and models with `activations="int8"`: Q4_0, Q4_1 and Q8_0 blocks multiplied in
integers against activations rounded to int8 per block of 32 (batchlm/kernels/linear_int8.cpp). Not exact
against the float32 product, so each output is checked to the bit against the float32 operations the
kernel's header states (whichever vector form this CPU runs: AVX2 or AVX-512 VNNI), and so is what must
stay exact: a row's result whatever its batch and threads, the embedding's values, and a request's tokens
and log-probabilities whatever else is batched with it."""

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


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma: the product of two float32 values is exact in float64, the sum rounds there and then to
    float32 (a double rounding that differs from one rounding only on a float32 midpoint: not at these seeds)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def stated(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The header's arithmetic with its float32 operations from the file's blocks: x rounded per block of 32,
    the integer sums per block, then acc = fma(float(i), d * dx, acc) block by block (Q4_1: and
    fma(m, dx * s, acc)). Every vector form of the kernel must give these bits."""
    T, K = x.shape
    NB = K // 32
    xb = x.numpy().reshape(T, NB, 32)
    a = np.abs(xb).max(-1)
    inv = np.where(a > 0, np.float32(127) / np.where(a > 0, a, np.float32(1)), np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)  # float32 product, rounded half to even as nearbyint
    dx = (a / np.float32(127)).astype(np.float32)
    s = xq.sum(-1)
    blocks = raw.numpy().reshape(raw.shape[0], NB, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, NB)
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int64)
    else:
        nib = blocks[..., 4 if kind == "Q4_1" else 2:].astype(np.int64)
        q = np.concatenate([nib & 15, nib >> 4], -1)
    i = np.einsum("tbk,nbk->tnb", xq, q)
    if kind == "Q4_0":
        i -= 8 * s[:, None, :]
    acc = np.zeros((T, raw.shape[0]), np.float32)
    for b in range(NB):
        acc = fma32(i[:, :, b].astype(np.float32), d[None, :, b] * dx[:, b, None], acc)
        if kind == "Q4_1":
            m = blocks[:, b, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
            acc = fma32(m[None, :], (dx[:, b] * s[:, b].astype(np.float32))[:, None], acc)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [quantized, random_blocks], ids=["written", "random"])
@pytest.mark.parametrize("n,k", [(100, 96), (576, 1536), (64, 32), (20, 64)])
def test_outputs_are_the_stated_int8_arithmetic_to_the_bit(kind, make, n, k):
    raw, dense = make(kind, n, k, seed=n + k)
    packed = torch.ops.batchlm.pack_linear_q8(raw, QUANTIZED_TYPES[kind])
    assert packed.shape == torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[kind]).shape  # same tile sizes
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1))
    x[3, :32] = 0  # a block of zeros: no scale, no division by zero
    x[4, 5] = 1e4  # a block whose other values round to zero
    want = stated(x, raw, kind)
    for t in ROWS:
        assert torch.equal(q8(x[:t], packed, kind, n), want[:t]), t
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
    assert model.embed_tokens.layout == "int8"
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
