"""How close each tier of the engine is to transformers on the same checkpoint (in process, no server).

    batchlm-bench agreement [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--prompts 16] [--tokens 64]
                            [--activations float32,int8]   (bfloat16: for a file of BF16 weights)

transformers (float32, eager attention, EOS ignored) continues each of the first `--prompts` chat prompts
of the served workload (batchlm/bench/chat_prompts.jsonl, 34-42 tokens templated) greedily for `--tokens`
tokens, and gives the log-probability of each of its tokens. Then, for each `--activations`, the engine
reads every prompt with transformers' continuation appended (prompt_logprobs: teacher-forced, so one early
difference does not hide the rest) and reports, over all those positions:
- top-1 = transformers: the share whose most likely token under the engine is transformers' token;
- |d log p| mean and max: the engine's log-probability of transformers' token against transformers' own;
- greedy equal: the prompts whose engine greedy continuation (free-running, its own tokens) equals
  transformers' on the first 32 tokens (or --tokens, if fewer), as `peers-served` counts them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchlm.paths import DEFAULT_MODEL

GREEDY_TOKENS = 32  # the prefix peers-served compares


def transformers_reference(model: Path, prompts: list[list[int]],
                           tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy continuation of each prompt and the log-probability of each of its tokens."""
    import torch

    from batchlm.bench.peers_served.reference import load_transformers

    hf = load_transformers(model)
    ids, logps = [], []
    with torch.inference_mode():
        for prompt in prompts:
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)
            cont = out[0, len(prompt):].tolist()
            logits = hf(out).logits[0, len(prompt) - 1:-1].float()  # the positions that predict `cont`
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
            ids.append(cont)
            logps.append(lp.tolist())
    return ids, logps


def engine_figures(model: Path, activations: str, prompts: list[list[int]], ref_ids: list[list[int]],
                   ref_logps: list[list[float]]) -> dict:
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig
    from batchlm.engine.sampling import SamplingParams
    from batchlm.model.checkpoint import load_model
    from batchlm.model.tokenizer import Tokenizer

    config = EngineConfig(activations=activations, max_num_seqs=8, enable_prefix_caching=False)
    engine = LLMEngine.from_parts(load_model(model, activations=activations), Tokenizer.from_dir(model), config)
    forced = engine.generate([p + r for p, r in zip(prompts, ref_ids)],
                             [SamplingParams(max_tokens=1, prompt_logprobs=1)] * len(prompts))
    top1 = diffs = 0
    worst = 0.0
    positions = 0
    for prompt, ids, logps, out in zip(prompts, ref_ids, ref_logps, forced):
        for lp, want, ref in zip(out.prompt_logprobs[len(prompt) - 1:], ids, logps):
            top1 += lp.top[0][0] == want
            d = abs(lp.logprob - ref)
            diffs += d
            worst = max(worst, d)
            positions += 1
    n = min(GREEDY_TOKENS, len(ref_ids[0]))
    free = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)] * len(prompts))
    equal = sum(o.token_ids == ids[:n] for o, ids in zip(free, ref_ids))
    return {"activations": activations, "top1": top1 / positions, "mean_dlogp": diffs / positions,
            "max_dlogp": worst, "greedy_equal": equal, "greedy_tokens": n, "prompts": len(prompts),
            "positions": positions}


def format_table(rows: list[dict]) -> str:
    lines = ["| activations | top-1 = transformers | mean abs d log p | max abs d log p "
             f"| greedy equal, first {rows[0]['greedy_tokens']} tokens |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['activations']} | {100 * r['top1']:.1f}% of {r['positions']} | {r['mean_dlogp']:.2e} "
                     f"| {r['max_dlogp']:.2e} | {r['greedy_equal']}/{r['prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="batchlm-bench agreement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="transformers' continuation, per prompt")
    ap.add_argument("--activations", default="float32,int8", help="comma-separated: float32, int8, bfloat16")
    args = ap.parse_args(argv)
    from batchlm.bench.peers_served.workload import ServedWorkloadSpec, build_workload

    requests = build_workload(ServedWorkloadSpec(max_tokens=args.tokens), args.prompts, args.model)
    prompts = [list(r.prompt_ids) for r in requests]
    ref_ids, ref_logps = transformers_reference(args.model, prompts, args.tokens)
    rows = [engine_figures(args.model, a, prompts, ref_ids, ref_logps) for a in args.activations.split(",")]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
