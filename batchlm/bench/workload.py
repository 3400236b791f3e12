"""Seeded workloads, shared by the benchmark, the comparison and the Locust files so all measure the
same traffic. Two kinds:

- chat (`ChatWorkloadSpec`, what `make compare` runs on the default model): the project's own prompt set
  (chat_prompts.jsonl beside this file: 220 questions, explanations, lists, paragraphs to work on, code
  requests and longer answers), each sent through the model's chat template, greedy, ended by the
  model's EOS or the max_tokens cap. The model decides every output length; `OutputLengths` reports the
  distribution observed and the step-count bound computed from it.
- synthetic (`WorkloadSpec`): the continuous-batching study the field cites: output lengths drawn from
  an exponential, capped, with EOS ignored so that each request produces exactly its length (mean 128,
  cap 512; prompts of 16-128 tokens of generated text). Any model, random weights included.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from batchlm.model.synthetic_corpus import WORDS, sentence
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import DEFAULT_MODEL, TINY_MODEL_DIR, served_model

CHAT_PROMPTS = Path(__file__).with_name("chat_prompts.jsonl")


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
    ignore_eos: bool = True  # synthetic: exactly max_tokens; chat: the model's EOS ends it


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


@dataclass(frozen=True)
class ChatWorkloadSpec:
    seed: int = 0  # the order the prompts are sent in; the same seed gives the same requests
    num_requests: int = 200  # more than the 220 prompts: they come round again, reshuffled
    max_tokens: int = 512  # the cap on each answer; the model's EOS ends most before it
    kind: str = "chat"

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChatWorkloadSpec.{name} must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)


def chat_prompts() -> list[dict]:
    """The project's prompt set: {"kind", "prompt"} per line of chat_prompts.jsonl."""
    import json

    return [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]


def build_chat_requests(spec: ChatWorkloadSpec, model: Path | str | None = None) -> list[WorkloadRequest]:
    """The spec's requests: each prompt as one user message through the chat template of `model` (default:
    the checkpoint the repository serves), EOS-driven, capped at spec.max_tokens."""
    from batchlm.model.chat_template import load_chat_template

    model = served_model(str(DEFAULT_MODEL)) if model is None else Path(model)
    tokenizer, template = Tokenizer.from_dir(model), load_chat_template(model)
    prompts = chat_prompts()
    rng = random.Random(spec.seed)
    order: list[int] = []
    while len(order) < spec.num_requests:
        round_ = list(range(len(prompts)))
        rng.shuffle(round_)
        order += round_
    requests = []
    for i, k in enumerate(order[:spec.num_requests]):
        text = template.render([{"role": "user", "content": prompts[k]["prompt"]}])
        requests.append(WorkloadRequest(i, text, len(tokenizer.encode(text)), spec.max_tokens, ignore_eos=False))
    return requests


def make_spec(kind: str, num_requests: int, seed: int = 0) -> WorkloadSpec | ChatWorkloadSpec:
    """The default spec of `kind` ("chat" or "synthetic") with this many requests."""
    if kind == "chat":
        return ChatWorkloadSpec(seed=seed, num_requests=num_requests)
    if kind == "synthetic":
        return WorkloadSpec(seed=seed, num_requests=num_requests)
    raise ValueError(f"workload kind must be chat or synthetic, got {kind!r}")


def requests_of(spec: WorkloadSpec | ChatWorkloadSpec, model: Path | str | None = None) -> list[WorkloadRequest]:
    if isinstance(spec, ChatWorkloadSpec):
        return build_chat_requests(spec, model)
    return build_requests(spec) if model is None else build_requests(spec, model)


@dataclass(frozen=True)
class OutputLengths:
    """Output lengths as observed (the chat workload's are the model's to decide)."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 0:
            raise ValueError("OutputLengths needs at least one length, none negative")

    def percentile(self, q: float) -> int:
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    def expected_max(self, batch: int) -> float:
        """E[longest of `batch` lengths drawn from the observed ones]: a request-level batch's steps."""
        n, top = len(self.lengths), max(self.lengths)
        counts = [0] * (top + 1)
        for length in self.lengths:
            counts[length] += 1
        below, total = 0, 0.0
        for value in range(top + 1):  # sum over v >= 1 of P(max >= v) = 1 - F(v - 1)^batch
            if value >= 1:
                total += 1.0 - (below / n) ** batch
            below += counts[value]
        return total

    def step_bound(self, batch: int) -> float:
        """Step-count bound of continuous over request-level batching at `batch` rows: E[longest] / mean."""
        return self.expected_max(batch) / self.mean

    def summary(self, batch: int = 8) -> dict:
        return {"requests": len(self.lengths), "mean": round(self.mean, 1), "p50": self.percentile(50),
                "p90": self.percentile(90), "p99": self.percentile(99), "max": max(self.lengths),
                f"step_bound_{batch}": round(self.step_bound(batch), 2)}
