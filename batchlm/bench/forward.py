"""Time one decode forward of the model at several batch sizes (in process, no server).

    batchlm-bench forward [--model models/tiny-random] [--context 128] [--threads 2]
                                    [--batch-sizes 1,2,4,8,16] [--dtype float32|bfloat16] [--prompt-len 0]
                                    [--profile] [--linear auto|kernel|onednn] [--pointwise auto|kernel|torch]
                                    [--weights auto|dense] [--activations float32|int8]
                                    [--interfere SECONDS]

Prints ms per step and tokens/s per batch size, and the batch-8 / batch-1 tokens/s ratio; with
--prompt-len L also one prefill forward of each batch size's prompts (L tokens each) and its cost per
prompt token. Reports the 20th-percentile step time, which is robust to other processes sharing the cores.
`--profile` splits each forward (torch.profiler, self CPU time) into the linears, attention and the
rest, gives the linears' GFLOP/s, and first times a 1024 x 1024 x 1024 matmul in the same dtype: how
close the linears run to what this CPU's matmul can do. `--linear` picks the packed matmul
(LlamaForCausalLM.prepack_linears): the batchlm kernel or oneDNN, to compare the two; `--pointwise` the
element-wise ops (LlamaForCausalLM.set_pointwise): the batchlm kernels or torch's; `--weights` whether a
GGUF file's quantized tensors stay quantized (batchlm/model/quantized.py) or are dequantized, and
`--activations` int8 or bfloat16 multiplies them against activations rounded to int8 (batchlm::linear_q8)
or to bfloat16 (BF16 weights, batchlm::linear_bf16).
`--interfere S` also times each batch size's decode step for S seconds alone and S seconds beside two
processes that each spin SPIN_S of a core every SPIN_S + SLEEP_S (what a server's and a client's
wake-ups do to the engine on a shared machine), and prints the two mean step times and their ratio:
a preempted engine thread costs a step more than the CPU it lost if its partner waits for it.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from batchlm.model.backends import ACTIVATIONS_CHOICES, LINEAR_BACKENDS, POINTWISE_BACKENDS, WEIGHTS_CHOICES
from batchlm.model.checkpoint import load_model
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache


def decode_batch(batch_size: int, context: int, block_size: int) -> ForwardBatch:
    """`batch_size` sequences, each decoding the token at position context - 1, in disjoint blocks."""
    nb = -(-context // block_size)
    tables = torch.arange(batch_size * nb).view(batch_size, nb)  # (S, nb)
    pos = torch.full((batch_size,), context - 1)  # (S,)
    slots = tables[:, -1] * block_size + pos % block_size  # (S,)
    return ForwardBatch(
        input_ids=torch.randint(3, 1000, (batch_size,)), positions=pos, slot_mapping=slots,
        query_lens=[1] * batch_size, context_lens=[context] * batch_size, block_tables=tables,
        logits_indices=torch.arange(batch_size))


def prefill_batch(batch_size: int, prompt_len: int, block_size: int) -> ForwardBatch:
    """`batch_size` prompts of `prompt_len` tokens each, fed whole, in disjoint blocks."""
    nb = -(-prompt_len // block_size)
    tables = torch.arange(batch_size * nb).view(batch_size, nb)  # (S, nb)
    pos = torch.arange(prompt_len).repeat(batch_size)  # (T,)
    rows = torch.arange(batch_size).repeat_interleave(prompt_len)  # (T,) sequence of each token
    slots = tables[rows, pos // block_size] * block_size + pos % block_size  # (T,)
    return ForwardBatch(
        input_ids=torch.randint(3, 1000, (batch_size * prompt_len,)), positions=pos, slot_mapping=slots,
        query_lens=[prompt_len] * batch_size, context_lens=[prompt_len] * batch_size, block_tables=tables,
        logits_indices=torch.arange(1, batch_size + 1) * prompt_len - 1)


def time_step(model, cache: KVCache, batch: ForwardBatch, iters: int) -> float:
    for _ in range(5):
        model(batch, cache)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        model(batch, cache)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 5]


SPIN_S, SLEEP_S = 0.0002, 0.0018  # --interfere: each of the 2 spinners takes 10% of a core in 0.2 ms bursts
# NOTE: a spinner ends by itself once its parent is gone, so a killed benchmark leaves no process spinning
SPINNER = ("import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    t = time.perf_counter()\n"
           f"    while time.perf_counter() - t < {SPIN_S}: pass\n    time.sleep({SLEEP_S})\n")


def mean_step(model, cache: KVCache, batch: ForwardBatch, seconds: float) -> float:
    """Mean seconds a step over `seconds` of back-to-back steps (every step counts, slow ones included)."""
    for _ in range(3):
        model(batch, cache)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model(batch, cache)
        steps += 1
    return (time.perf_counter() - start) / steps


def interfered(model, cache: KVCache, batch: ForwardBatch, seconds: float) -> tuple[float, float]:
    """mean_step alone, then beside two spinner processes (killed before returning)."""
    alone = mean_step(model, cache, batch, seconds)
    spinners = [subprocess.Popen([sys.executable, "-c", SPINNER]) for _ in range(2)]
    try:
        time.sleep(0.2)
        beside = mean_step(model, cache, batch, seconds)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return alone, beside


def linear_flops(config, tokens: int, seqs: int) -> int:
    """FLOPs of the linears in one forward of `tokens` rows from `seqs` sequences: every token through
    the layers' qkv projection, the last layer's o_proj and MLP and lm_head only for each sequence's
    last token (LlamaForCausalLM.forward), every other layer's o_proj and MLP for every token."""
    D, I, hd = config.hidden_size, config.intermediate_size, config.head_dim  # noqa: E741 (the usual names)
    qkv = D * (config.num_heads + 2 * config.num_kv_heads) * hd
    rest = config.num_heads * hd * D + D * 2 * I + I * D
    layers = config.num_layers * qkv * tokens + (config.num_layers - 1) * rest * tokens + rest * seqs
    return 2 * (layers + D * config.vocab_size * seqs)


def matmul_peak(dtype: torch.dtype, n: int = 1024) -> float:
    """GFLOP/s of an n-cube matmul (20th-percentile time of 20): what this CPU's matmul reaches hot."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / sorted(times)[len(times) // 5] / 1e9


LINEAR_OPS = ("batchlm::linear", "batchlm::linear_bf16", "batchlm::linear_q", "batchlm::linear_q8",
              "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm")
ATTENTION_OPS = ("batchlm::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def profile_split(model, cache: KVCache, batch: ForwardBatch, iters: int = 10) -> tuple[float, float, float]:
    """ms per forward in the linears, in attention and in everything else (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            model(batch, cache)
    linears = attention = total = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total
        if event.key in LINEAR_OPS:
            linears += event.self_cpu_time_total
        elif event.key in ATTENTION_OPS:
            attention += event.self_cpu_time_total
    ms = 1e-3 / iters
    return linears * ms, attention * ms, (total - linears - attention) * ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/tiny-random"))
    ap.add_argument("--context", type=int, default=128, help="tokens in each sequence's KV cache")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--prompt-len", type=int, default=0, help="also time a prefill of this many tokens a prompt")
    ap.add_argument("--profile", action="store_true", help="split each forward into linears, attention, rest")
    ap.add_argument("--linear", choices=LINEAR_BACKENDS, default="auto", help="packed matmul")
    ap.add_argument("--weights", choices=WEIGHTS_CHOICES, default="auto", help="GGUF quantized tensors kept or not")
    ap.add_argument("--activations", choices=ACTIVATIONS_CHOICES, default="float32",
                    help="what kept tensors multiply (int8: Q4_0/Q4_1/Q8_0 by batchlm::linear_q8; bfloat16: BF16 "
                         "by batchlm::linear_bf16)")
    ap.add_argument("--pointwise", choices=POINTWISE_BACKENDS, default="auto", help="element-wise ops")
    ap.add_argument("--interfere", type=float, default=0, metavar="SECONDS",
                    help="also time decode steps alone and beside two spinning processes, this long each")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype, linear=args.linear, pointwise=args.pointwise, weights=args.weights,
                       activations=args.activations)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    block_size = 16
    tokens = max(args.context, args.prompt_len)
    cache = KVCache(model.config, num_blocks=max(sizes) * -(-tokens // block_size), block_size=block_size,
                    dtype=dtype)
    if args.profile:
        print(f"matmul 1024^3 {args.dtype}: {matmul_peak(dtype):.0f} GFLOP/s")
    print(f"linears: {model.linear_backend}")
    print(f"element-wise ops: {model.pointwise_backend}")
    ms = {}
    for s in sizes:
        decode = decode_batch(s, args.context, block_size)
        ms[s] = 1e3 * time_step(model, cache, decode, args.iters)
        line = f"batch {s:3d}: {ms[s]:7.2f} ms/step  {1e3 * s / ms[s]:8.1f} tokens/s"
        if args.prompt_len > 0:
            prefill_rows = prefill_batch(s, args.prompt_len, block_size)
            prefill = 1e3 * time_step(model, cache, prefill_rows, max(3, args.iters // 10))
            line += f"  prefill {prefill:8.1f} ms ({prefill / (s * args.prompt_len):.3f} ms per prompt token)"
        print(line)
        if args.interfere > 0:
            alone, beside = interfered(model, cache, decode, args.interfere)
            print(f"  decode mean: {1e3 * alone:.2f} ms alone, {1e3 * beside:.2f} ms beside 2 spinners "
                  f"(x{beside / alone:.3f})")
        if args.profile:
            runs = [("decode", decode, linear_flops(model.config, s, s))]
            if args.prompt_len > 0:
                runs.append(("prefill", prefill_rows, linear_flops(model.config, s * args.prompt_len, s)))
            for kind, batch, flops in runs:
                linears, attn, rest = profile_split(model, cache, batch)
                print(f"  {kind}: linears {linears:.2f} ms ({flops / linears / 1e6:.0f} GFLOP/s), "
                      f"attention {attn:.2f} ms, rest {rest:.2f} ms (profiled)")
    if 1 in ms and 8 in ms:
        print(f"tokens/s ratio batch 8 / batch 1: {8 * ms[1] / ms[8]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
