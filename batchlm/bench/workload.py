"""Seeded workloads: prompt and output lengths drawn from distributions, shared by the benchmark and
the Locust files so both measure the same traffic.

The default follows the continuous-batching study the field cites: output lengths exponential, capped,
with EOS ignored so that each request produces exactly its length. It is scaled so a run fits minutes
on a 2-core CPU: outputs have mean 128 and cap 512 tokens; prompts are 16-128 tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from batchlm.model.synthetic_corpus import WORDS, sentence
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0  # the same seed gives the same requests
    num_requests: int = 200
    prompt_tokens_min: int = 16  # prompt length, uniform in [min, max] tokens
    prompt_tokens_max: int = 128
    output_mean: float = 128.0  # output length ~ Exponential(mean), rounded up, capped
    output_cap: int = 512
    output_min: int = 1  # output_min == output_cap: every request asks for exactly that many tokens

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_tokens_min", "output_cap", "output_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadSpec.{name} must be >= 1")
        if self.prompt_tokens_max < self.prompt_tokens_min:
            raise ValueError("WorkloadSpec.prompt_tokens_max must be >= prompt_tokens_min")
        if not self.output_mean > 0:
            raise ValueError("WorkloadSpec.output_mean must be > 0")
        if self.output_min > self.output_cap:
            raise ValueError("WorkloadSpec.output_min must be <= output_cap")

    def as_dict(self) -> dict:
        return asdict(self)

    def expected_output_length(self) -> float:
        """E[min(cap, max(min, ceil(Exp(mean))))], computed numerically."""
        return _expected_max_of(1, self)

    def expected_max_output_length(self, batch: int) -> float:
        """E[longest of `batch` output lengths]: a request-level batch's steps."""
        return _expected_max_of(batch, self)

    def output_cdf(self, n: int) -> float:
        """P(output length <= n)."""
        if n < self.output_min:
            return 0.0
        if n >= self.output_cap:
            return 1.0
        return 1.0 - math.exp(-n / self.output_mean)  # P(ceil(X) <= n) = P(X <= n)

    def static_speedup_bound(self, batch: int) -> float:
        """Step-count bound of continuous over request-level batching: E[longest of `batch`] / E[mean]."""
        return _expected_max_of(batch, self) / _expected_max_of(1, self)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt: str
    prompt_tokens: int  # as counted by the model's tokenizer (the server may add BOS)
    max_tokens: int


def output_length(rng: random.Random, spec: WorkloadSpec) -> int:
    value = math.ceil(rng.expovariate(1.0 / spec.output_mean))
    return max(spec.output_min, min(spec.output_cap, value))


def build_requests(spec: WorkloadSpec, model_dir: Path | str = TINY_MODEL_DIR) -> list[WorkloadRequest]:
    """The spec's requests, in arrival order; prompts are cut to their token length with the tokenizer."""
    tokenizer = Tokenizer.from_dir(model_dir)
    rng = random.Random(spec.seed)
    words = list(WORDS)
    requests = []
    for i in range(spec.num_requests):
        target = rng.randint(spec.prompt_tokens_min, spec.prompt_tokens_max)
        text = ""
        while len(tokenizer.hf.encode(text, add_special_tokens=False).ids) < target:
            text += sentence(rng, words) + " "
        ids = tokenizer.hf.encode(text, add_special_tokens=False).ids[:target]
        prompt = tokenizer.decode(ids).strip() or "hello"
        requests.append(WorkloadRequest(i, prompt, target, output_length(rng, spec)))
    return requests


def _expected_max_of(k: int, spec: WorkloadSpec) -> float:
    """E[max of k iid output lengths] = sum_{n>=1} P(max >= n) = sum_n 1 - F(n-1)^k."""
    return sum(1.0 - spec.output_cdf(n - 1) ** k for n in range(1, spec.output_cap + 1))
