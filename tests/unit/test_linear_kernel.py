"""torch.ops.batchlm.linear: close to a float64 reference, and each row's bits independent of the other rows
of the call, of its register block and chunk, and of the thread count (what keeps decoding batch-invariant
bit for bit), in float32 (vector code with AVX-512, or AVX2 and FMA) and, where the CPU has AVX-512 BF16,
in bfloat16."""

import pytest
import torch

from batchlm import kernels
from tests.unit.torch_threads import intra_op_threads

COLS = 64  # output columns per packed group (linear.cpp)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert kernels.load(), f"kernel library not built: {kernels.library_path()} (run python -m batchlm.kernels)"


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    """float32 always runs (without AVX-512 or AVX2, the kernel's scalar loop); bfloat16 needs AVX-512 BF16."""
    if request.param is torch.bfloat16 and not kernels.linear_is_native(request.param):
        pytest.skip("no AVX-512 BF16 on this CPU: bfloat16 linears go through oneDNN")
    return request.param


def weight(n: int, k: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)


def rows(t: int, k: int, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.batchlm.linear(x, torch.ops.batchlm.pack_linear(w), w.shape[0])


def test_pack_layout_groups_64_columns_and_zero_pads_the_last():
    w = weight(100, 7)
    packed = torch.ops.batchlm.pack_linear(w)
    assert packed.shape == (2, 7, COLS) and packed.is_contiguous()
    for n in (0, 63, 64, 99):
        assert torch.equal(packed[n // COLS, :, n % COLS], w[n])
    assert not packed[1, :, 36:].any()


def test_bfloat16_pack_pairs_consecutive_k_and_zero_pads_an_odd_k():
    w = weight(100, 7, dtype=torch.bfloat16)
    packed = torch.ops.batchlm.pack_linear(w)
    assert packed.shape == (2, 4, COLS, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for n in (0, 63, 64, 99):
        assert torch.equal(packed[n // COLS, :, n % COLS].reshape(-1)[:7], w[n])
        assert packed[n // COLS, 3, n % COLS, 1] == 0
    assert not packed[1, :, 36:].any()


@pytest.mark.parametrize("n,k", [(768, 512), (512, 1408), (100, 37), (64, 1), (130, 3)])
@pytest.mark.parametrize("t", [1, 5, 6, 7, 40, 97, 200])
def test_matches_the_float64_product(dtype, n, k, t):
    w, x = weight(n, k, dtype=dtype), rows(t, k, dtype=dtype)
    out = linear(x, w)
    assert out.shape == (t, n) and out.dtype == dtype
    ref = x.double() @ w.double().T  # the exact product of the inputs as given
    if dtype is torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * k ** 0.5, rtol=1e-5)
    else:  # float32 sums, then one rounding to bfloat16 (8 bits: 2^-8 relative)
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * k ** 0.5, rtol=2 ** -8)


def fma_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 out[t][n] = fma(x[t][K-1], W[n][K-1], ... fma(x[t][0], W[n][0], 0)): each product is exact in
    float64 and each sum is rounded to float32 (through float64: a double rounding that differs from one fused
    rounding about once in 2^29 operations; these inputs are fixed)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (x[:, k, None].double() * w[None, :, k].double() + acc.double()).float()
    return acc


@pytest.mark.parametrize("n,k,t", [(130, 37, 7), (64, 300, 13), (200, 1, 6)])
def test_float32_sums_are_the_written_fma_chain_to_the_bit(n, k, t):
    """Vector code (AVX-512 or AVX2) and the scalar loop compute the same sums, so a row has the same bits on
    every CPU the library builds for."""
    w, x = weight(n, k, seed=n), rows(t, k, seed=k)
    assert torch.equal(linear(x, w), fma_chain(x, w))


@pytest.mark.parametrize("n,k", [(512, 1408), (200, 511)])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_call(dtype, n, k):
    """Alone, at every offset of a 6-row block and of a 96-row chunk, and with 1 or 2 threads."""
    w, x = weight(n, k, dtype=dtype), rows(203, k, dtype=dtype)
    packed = torch.ops.batchlm.pack_linear(w)
    alone = torch.cat([torch.ops.batchlm.linear(x[i:i + 1], packed, n) for i in range(len(x))])
    for t in (2, 6, 7, 40, 96, 97, 203):
        assert torch.equal(torch.ops.batchlm.linear(x[:t], packed, n), alone[:t]), t
    assert torch.equal(torch.ops.batchlm.linear(x[5:45], packed, n), alone[5:45])
    with intra_op_threads(1):
        assert torch.equal(torch.ops.batchlm.linear(x, packed, n), alone)


@pytest.mark.parametrize("threads", [3, 8])
@pytest.mark.parametrize("n,t", [(4096, 1), (4096, 8), (300, 40), (64, 3)])
def test_every_group_is_computed_once_however_the_threads_share_them(threads, n, t):
    """More threads than this machine's cores: some are preempted mid-call and the others take the groups
    left in their shares (work_split.h). Every output must still be the one-thread result, call after call;
    each call has new inputs, so a group that no thread computed cannot pass with the last call's values."""
    w = weight(n, 96)
    packed = torch.ops.batchlm.pack_linear(w)
    xs = [rows(t, 96, seed=i) for i in range(24)]
    with intra_op_threads(1):
        serial = [torch.ops.batchlm.linear(x, packed, n) for x in xs]
    with intra_op_threads(threads):
        for i, x in enumerate(xs):
            assert torch.equal(torch.ops.batchlm.linear(x, packed, n), serial[i]), i


def test_non_contiguous_rows_and_empty_calls():
    w = weight(70, 33)
    x = rows(33, 10).T  # (10, 33), not contiguous
    torch.testing.assert_close(linear(x, w), linear(x.contiguous(), w), atol=0, rtol=0)
    assert linear(torch.empty(0, 33), w).shape == (0, 70)


def test_bad_inputs_are_refused_with_what_is_wrong():
    w = weight(70, 33)
    packed = torch.ops.batchlm.pack_linear(w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.batchlm.linear(rows(2, 33).double(), packed, 70)
    with pytest.raises(RuntimeError, match="pack_linear"):  # x in bfloat16, the weight packed in float32
        torch.ops.batchlm.linear(rows(2, 33, dtype=torch.bfloat16), packed, 70)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.batchlm.linear(rows(2, 32), packed, 70)
    with pytest.raises(RuntimeError, match="groups of 64"):
        torch.ops.batchlm.linear(rows(2, 33), packed, 129)
    with pytest.raises(RuntimeError, match="groups of 64"):
        torch.ops.batchlm.linear(rows(2, 33), packed, 64)
    with pytest.raises(RuntimeError, match="pack_linear"):
        torch.ops.batchlm.linear(rows(2, 33), w, 70)
