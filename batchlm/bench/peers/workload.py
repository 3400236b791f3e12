"""The requests every engine gets: the seeded workload's, or a file's, as token ids."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from batchlm.bench.workload import WorkloadSpec, build_requests


@dataclass(frozen=True)
class PeerRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int


def load_workload(path: str | Path) -> list[PeerRequest]:
    """A JSON list of {"prompt_ids": [int, ...], "max_tokens": int}, in arrival order."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    requests = []
    for i, item in enumerate(items):
        item = item if isinstance(item, dict) else {}
        ids, n = item.get("prompt_ids"), item.get("max_tokens")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{path}: request {i}: prompt_ids must be a non-empty list of token ids")
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"{path}: request {i}: max_tokens must be an int >= 1")
        requests.append(PeerRequest(i, list(ids), n))
    return requests


def seeded_workload(args: argparse.Namespace) -> list[PeerRequest]:
    """The seeded spec's requests, prompts encoded as the engine encodes them (BOS first)."""
    from batchlm.model.tokenizer import Tokenizer

    spec = workload_spec(args)
    tokenizer = Tokenizer.from_dir(args.model_dir)
    return [PeerRequest(r.index, tokenizer.encode(r.prompt), r.max_tokens)
            for r in build_requests(spec, args.model_dir)]


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(seed=args.seed, num_requests=args.num_requests, prompt_tokens_min=args.prompt_tokens_min,
                        prompt_tokens_max=args.prompt_tokens_max, output_mean=args.output_mean,
                        output_cap=args.output_cap)
