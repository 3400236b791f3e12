"""torch.ops.batchlm.paged_attention: exact against a float64 reference, and each token's bits independent
of what else is in the call (the property that keeps greedy decoding batch-invariant in bfloat16)."""

import pytest
import torch

from batchlm import kernels
from tests.unit.torch_threads import intra_op_threads

BS, KVH, H, HD = 16, 2, 8, 64


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert kernels.load(), f"kernel library not built: {kernels.library_path()} (run python -m batchlm.kernels)"


def paged(dtype, num_blocks=64, seed=0, hd=HD, bs=BS):
    """A random cache (K transposed per block, V slot-major) and shuffled block tables for 5 sequences."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * bs, KVH, hd, generator=g).to(dtype)  # slot-major, for the reference
    v = torch.randn(num_blocks * bs, KVH, hd, generator=g).to(dtype)
    k_cache = k.view(num_blocks, bs, KVH, hd).permute(0, 2, 3, 1).contiguous()
    tables = torch.randperm(num_blocks, generator=g)[:5 * 12].view(5, 12).contiguous()
    return k, k_cache, v, tables


def reference(q, k, v, tables, seq, n_keys, bs=BS):
    """float64 softmax(q k^T / sqrt(hd)) v for one token of sequence `seq` over keys 0..n_keys-1."""
    slots = (tables[seq, :, None] * bs + torch.arange(bs)).reshape(-1)[:n_keys]
    kk, vv = k[slots].double().transpose(0, 1), v[slots].double().transpose(0, 1)  # (KVH, n, hd)
    qq = q.double().view(KVH, -1, q.shape[-1])  # (KVH, G, hd)
    p = torch.softmax(qq @ kk.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
    return (p @ vv).reshape(q.shape)


def call(q, k_cache, v, tables, seq_ids, key_lens, bs=BS):
    return torch.ops.batchlm.paged_attention(q.contiguous(), k_cache, v, tables, torch.tensor(seq_ids),
                                             torch.tensor(key_lens), bs, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hd,bs", [(HD, BS), (32, 4)])  # the specialized and the generic code
def test_matches_float64_reference(dtype, atol, hd, bs):
    k, k_cache, v, tables = paged(dtype, hd=hd, bs=bs)
    seq_ids, key_lens = [0, 1, 1, 1, 2, 3, 4], [1, 5, 6, 7, bs, bs + 1, 12 * bs]  # edges of blocks
    q = torch.randn(len(seq_ids), H, hd).to(dtype)
    out = call(q, k_cache, v, tables, seq_ids, key_lens, bs)
    assert out.dtype == dtype and out.shape == q.shape
    for t, (s, n) in enumerate(zip(seq_ids, key_lens)):
        torch.testing.assert_close(out[t].double(), reference(q[t], k, v, tables, s, n, bs), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_alone_and_in_any_batch(dtype):
    k, k_cache, v, tables = paged(dtype)
    seq_ids = [0, 0, 0, 1, 2, 3, 4, 4]
    key_lens = [30, 31, 32, 100, 7, 191, 150, 151]  # a 3-token prefill chunk, decodes, a 2-token chunk
    q = torch.randn(len(seq_ids), H, HD).to(dtype)
    together = call(q, k_cache, v, tables, seq_ids, key_lens)
    for t in range(len(seq_ids)):
        alone = call(q[t:t + 1], k_cache, v, tables[seq_ids[t]:seq_ids[t] + 1].contiguous(), [0], [key_lens[t]])
        assert torch.equal(alone[0], together[t]), f"token {t} changed with the batch"
    with intra_op_threads(1):  # and with the thread that computes it
        assert torch.equal(call(q, k_cache, v, tables, seq_ids, key_lens), together)


@pytest.mark.parametrize("threads", [3, 8])
def test_every_token_is_attended_once_however_the_threads_share_them(threads):
    """Contexts from 1 to 190 keys, so the (token, KV head) items are uneven, and more threads than this
    machine's cores, so some are preempted and the others take what is left of their shares
    (work_split.h). Each call gets new queries: an item that no thread computed cannot pass with the
    last call's output, and every output must be the one-thread result."""
    k, k_cache, v, tables = paged(torch.float32)
    g = torch.Generator().manual_seed(7)
    seq_ids = torch.randint(0, 5, (40,), generator=g).tolist()
    key_lens = torch.randint(1, 191, (40,), generator=g).tolist()
    qs = [torch.randn(40, H, HD, generator=g) for _ in range(16)]
    with intra_op_threads(1):
        serial = [call(q, k_cache, v, tables, seq_ids, key_lens) for q in qs]
    with intra_op_threads(threads):
        for i, q in enumerate(qs):
            assert torch.equal(call(q, k_cache, v, tables, seq_ids, key_lens), serial[i]), i


def test_the_vector_code_gets_the_bits_of_the_generic_code():
    """bs 16 and hd 64 with 3 query heads per KV head (SmolLM2-135M) or 4 (the tiny model) run the vector
    code (AVX-512 or AVX2); 2 heads per KV head run the generic loops. A head's result depends on its own
    query alone, so heads 0-1 of each group must come out the same, to the bit, either way."""
    def heads(per_group):
        return [g * (H // KVH) + h for g in range(KVH) for h in range(per_group)]

    for dtype in (torch.float32, torch.bfloat16):
        k, k_cache, v, tables = paged(dtype, seed=4)
        seq_ids, key_lens = [0, 1, 1, 2, 3, 4], [1, 17, 18, 100, 191, 12 * BS]
        q = torch.randn(len(seq_ids), H, HD, generator=torch.Generator().manual_seed(5)).to(dtype)
        generic = call(q[:, heads(2)], k_cache, v, tables, seq_ids, key_lens)  # (T, 4, hd): G = 2
        for per_group in (3, 4):
            vector = call(q[:, heads(per_group)], k_cache, v, tables, seq_ids, key_lens)
            first_two = [g * per_group + h for g in range(KVH) for h in range(2)]
            assert torch.equal(vector[:, first_two], generic), (dtype, per_group)


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    k, k_cache, v, tables = paged(torch.float32)
    q = torch.randn(1, H, HD)
    with pytest.raises(RuntimeError, match="key_lens"):
        call(q, k_cache, v, tables, [0], [12 * BS + 1])  # more keys than the table covers
    with pytest.raises(RuntimeError, match="seq_ids"):
        call(q, k_cache, v, tables, [5], [3])
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="block_tables"):
        call(q, k_cache, v, bad, [0], [3])
    with pytest.raises(RuntimeError, match="dtype"):
        call(q.double(), k_cache, v, tables, [0], [3])
