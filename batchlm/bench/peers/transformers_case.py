"""transformers' cases: its continuous batching (hf-cb) and its request-level `generate` (hf-static)."""

from __future__ import annotations

import argparse
import time

from batchlm.bench.peers.groups import now_since, run_groups, truncate
from batchlm.bench.peers.workload import PeerRequest

PAD_ID = 0  # left padding for hf-static (masked out; any id would do)


def _hf_model(args: argparse.Namespace, attention: str | None = None):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    kwargs = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, local_files_only=True,
                                                **kwargs).eval()


def run_hf_cb(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """transformers' continuous batching: requests added one by one, each with its own max_new_tokens."""
    import math

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(args, args.hf_attention)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    page = ContinuousBatchingConfig.page_size
    # KV room for max_num_seqs sequences of max(longest request, 1024) tokens, as the engine's 8 x 1024
    num_blocks = max(1, math.ceil(args.max_num_seqs * max(longest, 1024) / page))
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs,
                                         max_batch_tokens=args.max_batch_tokens, num_blocks=num_blocks)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                                  eos_token_id=-1, pad_token_id=PAD_ID)
    tokens: list[list[int]] = [[] for _ in requests]
    ttft = [0.0] * len(requests)
    e2e = [0.0] * len(requests)

    def wait_for(count: int, on_result) -> None:
        done = 0
        while done < count:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if out.error is not None:
                raise RuntimeError(f"transformers' request {out.request_id} failed: {out.error}")
            if out.is_finished():
                on_result(out)
                done += 1

    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=30) as manager:
        manager.add_request(requests[0].prompt_ids, request_id="warmup", max_new_tokens=8, eos_token_id=-1)
        wait_for(1, lambda out: None)
        t0 = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt_ids, request_id=f"r{r.index}", max_new_tokens=r.max_tokens,
                                eos_token_id=-1, record_timestamps=True)

        def record(out) -> None:
            i = int(out.request_id[1:])
            tokens[i] = list(out.generated_tokens)
            ttft[i] = out.timestamps[0] - t0 if out.timestamps else math.nan
            e2e[i] = now_since(t0)

        wait_for(len(requests), record)
        wall = now_since(t0)
        resolved = manager.continuous_batching_config
        notes = (f"attn {model.config._attn_implementation}, "
                 f"max_requests_per_batch={resolved.max_requests_per_batch}, "
                 f"max_batch_tokens={resolved.max_batch_tokens}, "
                 f"num_blocks={resolved.num_blocks} x page {resolved.page_size}")
    return {"tokens": tokens, "ttft_s": ttft, "e2e_s": e2e, "wall_s": wall, "notes": notes}


def run_hf_static(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """transformers' `generate`, request-level: left-padded groups run to their longest request."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """Notes when a group's first generated tokens arrive (put #1 is the prompt, put #2 the first token)."""

        def __init__(self) -> None:
            self.puts = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    model = _hf_model(args)

    def generate(group: list[PeerRequest], streamer: FirstToken | None = None) -> list[list[int]]:
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[PAD_ID] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in group),
                                 min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                                 streamer=streamer)
        return truncate(out[:, width:].tolist(), [r.max_tokens for r in group])

    def generate_group(group: list[PeerRequest]) -> tuple[list[list[int]], list[float]]:
        streamer = FirstToken()
        rows = generate(group, streamer)
        return rows, [streamer.first] * len(rows)

    return {**run_groups(requests, args.max_num_seqs, generate_group),
            "notes": f"attn {model.config._attn_implementation}, left padding, groups of {args.max_num_seqs}"}
