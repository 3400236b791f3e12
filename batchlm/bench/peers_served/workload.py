"""The one workload every server gets: chat-templated short questions, a fixed answer length, EOS ignored."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServedWorkloadSpec:
    seed: int = 0                # the order the prompts are sent in; the same seed gives the same requests
    prompt_tokens_min: int = 34  # chat_prompts.jsonl's prompts whose templated length is in [min, max] tokens
    prompt_tokens_max: int = 42
    max_tokens: int = 128        # every answer's length (greedy, EOS ignored)

    def __post_init__(self) -> None:
        if self.prompt_tokens_min < 1 or self.prompt_tokens_max < self.prompt_tokens_min:
            raise ValueError("ServedWorkloadSpec.prompt_tokens_max must be >= prompt_tokens_min >= 1")
        if self.max_tokens < 1:
            raise ValueError("ServedWorkloadSpec.max_tokens must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ServedRequest:
    index: int
    prompt_ids: tuple[int, ...]  # as the project's tokenizer encodes the text (its BOS, where it adds one)
    text: str                    # the same prompt as text, for servers that take no token ids
    max_tokens: int


def eligible_prompts(texts: list[str], count_tokens, spec: ServedWorkloadSpec) -> list[tuple[str, list[int]]]:
    """(text, ids) of the templated texts whose length is within the spec's bounds, in their order."""
    kept = []
    for text in texts:
        ids = count_tokens(text)
        if spec.prompt_tokens_min <= len(ids) <= spec.prompt_tokens_max:
            kept.append((text, ids))
    if not kept:
        raise ValueError(f"no prompt of {spec.prompt_tokens_min}-{spec.prompt_tokens_max} tokens")
    return kept


def sequence(prompts: list[tuple[str, list[int]]], n: int, spec: ServedWorkloadSpec) -> list[ServedRequest]:
    """`n` requests: the prompts shuffled with the spec's seed, round after round. Every concurrency's list
    is a prefix of the same sequence, so its first requests (the ones checked against the reference) are
    the same distinct prompts at every concurrency."""
    rng = random.Random(spec.seed)
    order: list[int] = []
    while len(order) < n:
        round_ = list(range(len(prompts)))
        rng.shuffle(round_)
        order += round_
    return [ServedRequest(i, tuple(prompts[k][1]), prompts[k][0], spec.max_tokens) for i, k in enumerate(order[:n])]


def build_workload(spec: ServedWorkloadSpec, n: int, model: Path) -> list[ServedRequest]:
    """`n` requests from batchlm/bench/chat_prompts.jsonl, each prompt one user message through the chat
    template of the checkpoint at `model`, encoded by the project's tokenizer."""
    from batchlm.bench.workload import chat_prompts
    from batchlm.model.chat_template import load_chat_template
    from batchlm.model.tokenizer import Tokenizer

    tokenizer, template = Tokenizer.from_dir(model), load_chat_template(model)
    texts = [template.render([{"role": "user", "content": p["prompt"]}]) for p in chat_prompts()]
    return sequence(eligible_prompts(texts, tokenizer.encode, spec), n, spec)
