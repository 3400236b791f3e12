"""LlamaForCausalLM over the paged KV cache, checked against an independent no-cache reference."""

import random
from dataclasses import replace

import pytest
import torch

from batchlm import kernels
from batchlm.errors import InvalidArgument
from batchlm.model import attention
from batchlm.model.attention import group_by_length
from batchlm.model.checkpoint import SafetensorsCheckpoint, load_model, write_default_checkpoint
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache
from batchlm.model.rope import rope_inv_freq

# A small model with the default's structure (GQA 2:1, several layers) so the checks run in seconds.
SMALL = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256)
ATOL = 1e-4


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_default_checkpoint(tmp_path_factory.mktemp("small"), seed=1, **SMALL)


@pytest.fixture(scope="module", params=[("kernel", "kernel", "kernel"), ("torch", "onednn", "torch")],
                ids=["kernels", "torch"])
def small(small_dir, request):
    """Both attention paths, both packed matmuls and both element-wise paths: the native kernels (built by
    set-up; a missing build fails here), and SDPA with oneDNN and torch's element-wise ops."""
    attention, linear, pointwise = request.param
    if linear == "kernel" and not kernels.linear_is_native(torch.float32):
        pytest.skip("no AVX-512 or AVX2 on this CPU: the engine's linears go through oneDNN here")
    model = load_model(small_dir, attention=attention, linear=linear, pointwise=pointwise)
    assert model.linear_backend == linear and model.pointwise_backend == pointwise
    return model


@pytest.fixture(scope="module")
def small_torch(small_dir):
    return load_model(small_dir, attention="torch")


@pytest.fixture(scope="module")
def reference(small_dir, small):
    weights = dict(SafetensorsCheckpoint(small_dir))
    return lambda ids: reference_logits(weights, small.config, ids)


def reference_logits(w: dict, cfg, ids: list[int]) -> torch.Tensor:
    """Plain HF-convention Llama over one whole sequence, no cache: logits (T, V) at every position."""
    T, H, KVH, hd = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)

    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd)
    angles = torch.outer(torch.arange(T).double(), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, KVH, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, KVH, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
        scores = (q @ k.transpose(1, 2)) / hd ** 0.5
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        h = h + attn.transpose(0, 1).reshape(T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


class Seq:
    """One sequence's token ids, how many are cached, and the blocks it owns (taken from a shared pool)."""

    def __init__(self, ids: list[int], pool: list[int], block_size: int) -> None:
        self.ids, self.cached, self.blocks, self.pool, self.bs = list(ids), 0, [], pool, block_size

    def schedule(self, n: int) -> dict:
        start, end = self.cached, self.cached + n
        while len(self.blocks) * self.bs < end:
            self.blocks.append(self.pool.pop())
        pos = list(range(start, end))
        self.cached = end
        return dict(ids=self.ids[start:end], pos=pos, context=end, blocks=list(self.blocks),
                    slots=[self.blocks[p // self.bs] * self.bs + p % self.bs for p in pos])


def forward(model, cache: KVCache, steps: list[dict]) -> torch.Tensor:
    """Run one ForwardBatch made of the given per-sequence steps; logits (S, V)."""
    width = max(len(s["blocks"]) for s in steps)
    last, logits_indices = -1, []
    for s in steps:
        last += len(s["ids"])
        logits_indices.append(last)
    batch = ForwardBatch(
        input_ids=torch.tensor([t for s in steps for t in s["ids"]]),
        positions=torch.tensor([p for s in steps for p in s["pos"]]),
        slot_mapping=torch.tensor([x for s in steps for x in s["slots"]]),
        query_lens=[len(s["ids"]) for s in steps],
        context_lens=[s["context"] for s in steps],
        block_tables=torch.tensor([s["blocks"] + [0] * (width - len(s["blocks"])) for s in steps]),
        logits_indices=torch.tensor(logits_indices))
    return model(batch, cache)


def shuffled_pool(num_blocks: int, seed: int) -> list[int]:
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    return pool


def test_incremental_decode_matches_full_recompute(small, reference):
    cache = KVCache(small.config, num_blocks=32, block_size=4)
    rng = random.Random(0)
    seq = Seq([rng.randrange(3, 8192) for _ in range(11)], shuffled_pool(32, 0), block_size=4)
    logits = forward(small, cache, [seq.schedule(11)])
    assert logits.shape == (1, small.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], reference(seq.ids)[-1], atol=ATOL, rtol=0)
    for _ in range(7):  # crosses block boundaries; blocks are non-contiguous and out of order
        seq.ids.append(rng.randrange(3, 8192))
        logits = forward(small, cache, [seq.schedule(1)])
        torch.testing.assert_close(logits[0], reference(seq.ids)[-1], atol=ATOL, rtol=0)
    assert seq.blocks != sorted(seq.blocks)


@pytest.mark.parametrize("chunks", [[5, 4, 4], [12, 1], [1, 6, 6]])
def test_chunked_prefill_equals_whole_prompt(small, reference, chunks):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 8192) for _ in range(sum(chunks))]
    whole_cache, chunk_cache = KVCache(small.config, 16, 4), KVCache(small.config, 16, 4)
    whole = Seq(prompt, shuffled_pool(16, 1), 4)
    expected = forward(small, whole_cache, [whole.schedule(len(prompt))])
    chunked = Seq(prompt, shuffled_pool(16, 2), 4)
    for n in chunks:
        logits = forward(small, chunk_cache, [chunked.schedule(n)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0], reference(prompt)[-1], atol=ATOL, rtol=0)
    for seq, cache in ((whole, whole_cache), (chunked, chunk_cache)):  # the caches agree too
        seq.ids.append(7)
    assert torch.allclose(forward(small, whole_cache, [whole.schedule(1)]),
                          forward(small, chunk_cache, [chunked.schedule(1)]), atol=ATOL, rtol=0)


def greedy_alone(model, prompt: list[int], steps: int, seed: int) -> list[int]:
    cache = KVCache(model.config, num_blocks=64, block_size=4)
    seq = Seq(prompt, shuffled_pool(64, seed), 4)
    logits = forward(model, cache, [seq.schedule(len(prompt))])
    out = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        seq.ids.append(out[-1])
        logits = forward(model, cache, [seq.schedule(1)])
    return out


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    return write_default_checkpoint(tmp_path_factory.mktemp("default"), seed=0)


@pytest.fixture(scope="module")
def default_model(default_dir):
    return load_model(default_dir)


def test_ragged_batch_gives_each_sequence_its_greedy_tokens_alone(default_model):
    """Prefill chunks and decodes of different lengths share forwards; greedy tokens must not change."""
    rng, steps = random.Random(2), 8
    prompts = [[1] + [rng.randrange(3, 8192) for _ in range(n)] for n in (2, 8, 16, 5)]
    expected = [greedy_alone(default_model, p, steps, seed=i) for i, p in enumerate(prompts)]
    cache = KVCache(default_model.config, num_blocks=96, block_size=4)
    pool = shuffled_pool(96, 3)
    seqs = [Seq(p, pool, 4) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    # prompt chunk sizes per step (None: decode); seq 2 prefills over 3 steps next to others' decodes
    plan = [{0: 3, 1: 9}, {0: 1, 1: 1, 2: 6, 3: 6}, {0: 1, 1: 1, 2: 6, 3: 1}, {0: 1, 1: 1, 2: 5, 3: 1}]
    while any(len(o) < steps for o in outputs):
        chunk = plan.pop(0) if plan else {i: 1 for i in range(4) if len(outputs[i]) < steps}
        order = list(chunk)
        logits = forward(default_model, cache, [seqs[i].schedule(chunk[i]) for i in order])
        for row, i in enumerate(order):
            if seqs[i].cached == len(seqs[i].ids) and len(outputs[i]) < steps:
                outputs[i].append(int(logits[row].argmax()))
                seqs[i].ids.append(outputs[i][-1])
    assert outputs == expected


def test_the_linear_kernel_is_refused_where_it_cannot_run(small_dir):
    with pytest.raises(InvalidArgument) as err:
        load_model(small_dir, dtype=torch.float16, linear="kernel")
    assert err.value.field == "linear"
    assert load_model(small_dir, dtype=torch.bfloat16).linear_backend == auto_linear_backend(torch.bfloat16)


def auto_linear_backend(dtype: torch.dtype) -> str:
    """What `linear="auto"` picks on this CPU: the kernel where it has vector code (AVX-512 or AVX2, and
    AVX-512 BF16 for bfloat16), else oneDNN, except for bfloat16 where oneDNN has none (an AVX2-only
    CPU: it refuses to pack the weight), which stays dense."""
    if kernels.linear_is_native(dtype):
        return "kernel"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "dense"
    return "onednn"


def test_the_pointwise_kernels_are_refused_where_they_cannot_run(small_dir):
    with pytest.raises(InvalidArgument) as err:
        load_model(small_dir, dtype=torch.float16, pointwise="kernel")
    assert err.value.field == "pointwise"
    with pytest.raises(InvalidArgument) as err:
        load_model(small_dir, pointwise="fused")
    assert err.value.field == "pointwise"
    assert load_model(small_dir, dtype=torch.float16).pointwise_backend == "torch"  # auto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_are_bit_identical_alone_and_batched(default_dir, dtype):
    """With the native kernels, a sequence's logits do not depend on what shares its step, to the bit."""
    if not kernels.linear_is_native(dtype):
        pytest.skip(f"no vector linear kernel for {dtype} on this CPU")
    default_model = load_model(default_dir, dtype=dtype)
    assert default_model.linear_backend == "kernel" and default_model.attention_kernel
    assert default_model.pointwise_backend == "kernel"
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 8192) for _ in range(n)] for n in (4, 11, 7, 2, 9, 6, 13)]
    cache = KVCache(default_model.config, num_blocks=64, block_size=4, dtype=dtype)
    pool = shuffled_pool(64, 6)
    alone = []
    for p in prompts:  # each prompt alone, then one decode step alone
        s = Seq(p, pool, 4)
        forward(default_model, cache, [s.schedule(len(p))])
        s.ids.append(5)
        alone.append(forward(default_model, cache, [s.schedule(1)])[0])
    seqs = [Seq(p, pool, 4) for p in prompts]
    forward(default_model, cache, [s.schedule(len(s.ids)) for s in seqs])
    for s in seqs:
        s.ids.append(5)
    batched = forward(default_model, cache, [s.schedule(1) for s in seqs])
    for i, row in enumerate(alone):
        assert torch.equal(batched[i], row), i


def test_logits_only_for_each_sequences_last_token(small, reference):
    cache = KVCache(small.config, 16, 4)
    pool = shuffled_pool(16, 4)
    a, b = Seq([5, 6, 7, 8, 9], pool, 4), Seq([42], pool, 4)  # a 1-token prompt is a single-token query
    logits = forward(small, cache, [a.schedule(5), b.schedule(1)])
    assert logits.shape == (2, small.config.vocab_size)
    torch.testing.assert_close(logits[0], reference(a.ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], reference(b.ids)[-1], atol=ATOL, rtol=0)


def test_last_layer_runs_only_the_rows_that_reach_lm_head(small, reference):
    """A prompt chunk's other tokens need the last layer's K/V only: its attention output, o_proj and MLP
    run for each sequence's last token (the logits match the reference; the next step reads the cache)."""
    rows_seen = {}
    hooks = [small.layers[i].mlp.down_proj.register_forward_hook(
        lambda _m, args, _out, i=i: rows_seen.__setitem__(i, args[0].shape[0])) for i in (0, -1)]
    try:
        cache = KVCache(small.config, 16, 4)
        pool = shuffled_pool(16, 5)
        a, b = Seq([5, 6, 7, 8, 9, 10], pool, 4), Seq([11, 12, 13], pool, 4)
        logits = forward(small, cache, [a.schedule(6), b.schedule(3)])
        assert rows_seen == {0: 9, -1: 2}  # 9 tokens through the first layer's MLP, 2 through the last's
        a.ids.append(21)
        b.ids.append(22)
        logits = forward(small, cache, [a.schedule(1), b.schedule(1)])
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(logits[0], reference(a.ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], reference(b.ids)[-1], atol=ATOL, rtol=0)


def test_kv_cache_layout_and_size(small):
    cfg = small.config
    cache = KVCache(cfg, num_blocks=10, block_size=16)
    assert cache.k[0].shape == (10, cfg.num_kv_heads, cfg.head_dim, 16)  # keys transposed per block
    assert cache.v[0].shape == (160, cfg.num_kv_heads, cfg.head_dim) and len(cache.v) == cfg.num_layers
    assert cache.bytes_per_block() == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert KVCache.blocks_for_budget(cfg, 16, torch.float32, 10 * cache.bytes_per_block()) == 10


def test_kv_cache_memory_is_taken_as_it_is_written(small):
    """The cache is zeros, but its pages become resident only when touched: a server's memory grows with
    the tokens it holds, not with the blocks it was configured with."""
    def resident_mb() -> float:
        with open("/proc/self/status") as status:
            return int(next(ln for ln in status if ln.startswith("VmRSS")).split()[1]) / 1024

    before = resident_mb()
    cache = KVCache(small.config, num_blocks=16384, block_size=16)
    size_mb = cache.storage.numel() * cache.storage.element_size() / 2 ** 20
    assert size_mb > 200 and resident_mb() - before < size_mb / 10
    assert not cache.k[0][-1].any() and not cache.v[-1][-16:].any()
    cache.k[1][5].fill_(1.0)
    assert cache.k[1][5].all() and not cache.k[1][4].any() and not cache.k[0][5].any()


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies(small):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    plain = rope_inv_freq(small.config)
    scaled = rope_inv_freq(replace(small.config, rope_scaling=tuple(sorted(scaling.items()))))
    assert scaled[0] == plain[0]  # shortest wavelength: unchanged
    assert torch.isclose(scaled[-1], plain[-1] / 8)  # longest: slowed by `factor`
    assert (scaled <= plain).all() and (scaled >= plain / 8).all()


def test_group_by_length_splits_only_where_padding_saved_pays():
    bs = 16
    assert group_by_length([100] * 8, bs) == [list(range(8))]  # equal lengths: one group
    # one long context and seven short ones: padding the seven to 40 blocks wastes 7 * 38 blocks
    groups = group_by_length([640] + [20] * 7, bs)
    assert groups == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert group_by_length([48, 40, 32], bs) == [[0, 1, 2]]  # 3 blocks at most to save: not worth it
    spread = group_by_length(list(range(16, 16 * 65, 16)), bs)  # 1..64 blocks
    assert len(spread) == attention.MAX_DECODE_GROUPS
    assert sorted(i for g in spread for i in g) == list(range(64))


@pytest.mark.parametrize("with_prefill", [False, True])
def test_decode_groups_of_different_lengths_match_the_reference(small_torch, reference, monkeypatch,
                                                                with_prefill):
    """Torch path: single-token queries split into several length groups (scattered into T) are exact."""
    small = small_torch
    monkeypatch.setattr(attention, "SPLIT_SAVING_BLOCKS", 1)  # split wherever lengths differ
    rng = random.Random(5)
    cache = KVCache(small.config, num_blocks=64, block_size=4)
    pool = shuffled_pool(64, 5)
    seqs = [Seq([rng.randrange(3, 8192) for _ in range(n)], pool, 4) for n in (3, 17, 9, 30, 5)]
    for seq in seqs:
        forward(small, cache, [seq.schedule(len(seq.ids))])
        seq.ids.append(rng.randrange(3, 8192))
    steps = [seq.schedule(1) for seq in seqs]
    if with_prefill:  # a prompt chunk between the decodes: the groups' rows are not 0..S-1
        newcomer = Seq([rng.randrange(3, 8192) for _ in range(6)], pool, 4)
        steps.insert(2, newcomer.schedule(6))
        seqs.insert(2, newcomer)
    batch_meta = []
    original_build = attention.AttentionMetadata.build.__func__

    def build(cls, batch, block_size, device, use_kernel=False):
        batch_meta.append(original_build(cls, batch, block_size, device, use_kernel))
        return batch_meta[-1]

    monkeypatch.setattr(attention.AttentionMetadata, "build", classmethod(build))
    logits = forward(small, cache, steps)
    assert len(batch_meta[0].decode_groups) > 1
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], reference(seq.ids)[-1], atol=ATOL, rtol=0)
