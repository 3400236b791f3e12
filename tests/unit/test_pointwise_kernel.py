"""torch.ops.batchlm.rms_norm, add_rms_norm, silu_mul and rope_write_kv: what torch's ops compute (float64
references), each row's bits independent of the other rows of the call and of the thread count, K and V in
the slots and layout KVCache defines, and bad inputs refused with the reason."""

import pytest
import torch
import torch.nn.functional as F

from batchlm import kernels
from batchlm.model.rope import Rope, apply_rope
from tests.unit.torch_threads import intra_op_threads

EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert kernels.load(), f"kernel library not built: {kernels.library_path()} (run python -m batchlm.kernels)"


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def tolerance(dtype):
    """float32: a few ulp of the result; bfloat16: one rounding of the output (2^-8 relative)."""
    return dict(atol=1e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=1e-2, rtol=8e-3)


def norm64(x, w):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


@pytest.mark.parametrize("t,d", [(1, 512), (8, 512), (40, 512), (3, 37), (600, 64)])
def test_rms_norm_matches_the_float64_norm(dtype, t, d):
    x, w = randn(t, d, dtype=dtype), randn(d, seed=1, dtype=dtype)
    y = torch.ops.batchlm.rms_norm(x, w, EPS)
    assert y.dtype == dtype and y.shape == (t, d)
    torch.testing.assert_close(y.double(), norm64(x, w), **tolerance(dtype))


def test_add_rms_norm_returns_the_rounded_sum_and_its_norm(dtype):
    x, r, w = randn(9, 512, dtype=dtype), randn(9, 512, seed=2, dtype=dtype), randn(512, seed=1, dtype=dtype)
    h, y = torch.ops.batchlm.add_rms_norm(x, r, w, EPS)
    assert torch.equal(h, x + r)  # the residual stream holds what torch's add would
    torch.testing.assert_close(y.double(), norm64(h, w), **tolerance(dtype))
    assert torch.equal(y, torch.ops.batchlm.rms_norm(h, w, EPS))


def test_silu_mul_matches_silu_of_the_first_half_times_the_second(dtype):
    gu = randn(11, 2 * 1408, dtype=dtype, scale=6.0)  # |a| up to ~30: both branches of the sigmoid
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0], dtype=dtype)  # saturated and zero
    out = torch.ops.batchlm.silu_mul(gu)
    g, u = gu.double().chunk(2, -1)
    assert out.shape == (11, 1408) and out.dtype == dtype
    torch.testing.assert_close(out.double(), F.silu(g) * u, **tolerance(dtype))


def rope_tables(positions, hd, dtype):
    freqs = torch.outer(positions.double(), 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(dtype).unsqueeze(1)  # (T, 1, hd), as batchlm.model.rope
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(dtype).unsqueeze(1)
    return cos, sin


def test_rope_write_kv_rotates_q_and_k_and_stores_k_and_v_in_their_slots(dtype):
    T, H, KVH, hd, bs, nb = 13, 8, 2, 64, 4, 10
    qkv = randn(T, H + 2 * KVH, hd, dtype=dtype)
    cos, sin = rope_tables(torch.randint(0, 900, (T,), generator=torch.Generator().manual_seed(3)), hd, dtype)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(4))[:T]
    k_cache = torch.full((nb, KVH, hd, bs), 7.0, dtype=dtype)
    v_cache = torch.full((nb * bs, KVH, hd), 7.0, dtype=dtype)
    q = torch.ops.batchlm.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots)
    rotated = apply_rope(qkv[:, :H + KVH].double(), Rope(cos.double(), sin.double()))  # (T, H + KVH, hd)
    assert q.shape == (T, H, hd) and q.is_contiguous()
    torch.testing.assert_close(q.double(), rotated[:, :H], **tolerance(dtype))
    keys = k_cache.permute(0, 3, 1, 2)[slots // bs, slots % bs]  # (T, KVH, hd): key `offset` of its block
    torch.testing.assert_close(keys.double(), rotated[:, H:], **tolerance(dtype))
    assert torch.equal(v_cache[slots], qkv[:, H + KVH:])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (v_cache[untouched] == 7).all()
    assert (k_cache.permute(0, 3, 1, 2).reshape(nb * bs, KVH, hd)[untouched] == 7).all()


def call_all(x, gu, qkv, cos, sin, slots, w):
    """Every op on these rows: (norm, sum, norm of sum, silu_mul, q, the k and v caches)."""
    k_cache = torch.zeros(16, 2, 64, 4, dtype=x.dtype)
    v_cache = torch.zeros(64, 2, 64, dtype=x.dtype)
    h, y = torch.ops.batchlm.add_rms_norm(x, x.flip(1).contiguous(), w, EPS)
    q = torch.ops.batchlm.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots)
    return (torch.ops.batchlm.rms_norm(x, w, EPS), h, y, torch.ops.batchlm.silu_mul(gu), q,
            k_cache.permute(0, 3, 1, 2).reshape(64, 2, 64)[slots], v_cache[slots])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(dtype, threads):
    T = 60
    x, gu, w = randn(T, 512, dtype=dtype), randn(T, 2816, seed=5, dtype=dtype), randn(512, seed=1, dtype=dtype)
    qkv = randn(T, 12, 64, seed=6, dtype=dtype)
    cos, sin = rope_tables(torch.arange(T) * 7, 64, dtype)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(7))[:T]
    with intra_op_threads(threads):
        together = call_all(x, gu, qkv, cos, sin, slots, w)
        for i in (0, 17, T - 1):
            one = slice(i, i + 1)
            alone = call_all(x[one], gu[one], qkv[one], cos[one], sin[one], slots[one], w)
            for name, a, b in zip(("norm", "sum", "norm of sum", "silu_mul", "q", "k", "v"), alone, together):
                assert torch.equal(a[0], b[i]), (name, i)


def test_bad_inputs_are_refused_with_the_reason():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.batchlm.rms_norm(x.half(), w.half(), EPS)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.batchlm.rms_norm(torch.randn(8, 4).t(), w, EPS)
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.batchlm.rms_norm(x, torch.randn(7), EPS)
    with pytest.raises(RuntimeError, match="r must be"):
        torch.ops.batchlm.add_rms_norm(x, torch.randn(4, 7), w, EPS)
    with pytest.raises(RuntimeError, match=r"\(T, 2I\)"):
        torch.ops.batchlm.silu_mul(torch.randn(4, 7))
    qkv, cos, sin = torch.randn(3, 12, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    k_cache, v_cache = torch.zeros(4, 2, 64, 4), torch.zeros(16, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.batchlm.rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 16]))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.batchlm.rope_write_kv(qkv, cos, sin, k_cache, torch.zeros(16, 2, 32), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.batchlm.rope_write_kv(qkv, cos[:2], sin, k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.batchlm.rope_write_kv(qkv, cos, sin, k_cache.bfloat16(), v_cache, torch.tensor([0, 1, 2]))
