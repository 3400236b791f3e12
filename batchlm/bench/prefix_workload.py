"""Seeded workloads for prefix caching (`batchlm-bench prefix`): two whose prompts repeat their beginning,
and a control whose prompts share none. The same spec and checkpoint give the same workload.

- chat: `conversations` scripted conversations of `turns_min`..`turns_max` user messages. Each opens
  with one of the project's short prompts (chat_prompts.jsonl: questions, explanations, lists, short
  stories) and goes on with follow-ups (prefix_texts.FOLLOW_UPS, none twice in one conversation). A turn
  is the whole history through the model's chat template, its earlier answers included, so each turn's
  prompt begins with the previous one's; the answers are the model's, so the prompts after the first
  turn exist only at run time (`Conversation.messages`). The conversations interleave as users do:
  conversation i starts `i * stagger_ms` after the first, and each user reads the answer and types for a
  think time before the next turn (seeded, exponential with mean `think_ms`, at most THINK_CAP times it).
- system: one system prompt of at least `system_prompt_tokens` tokens (the intro and the rules of
  prefix_texts in a seeded order) before each of `system_requests` short questions (prefix_texts.QUESTIONS,
  in seeded rounds through all of them, so each repeats once the requests outnumber them).
- control: `control_requests` prompts of generated text (batchlm.bench.workload.build_requests), sent as
  they are: the chat template's fixed opening would be a shared prefix, and no two of these share their
  first KV block.
Every answer is exactly `max_tokens` tokens (greedy, EOS ignored), so the cache on and off do the same work.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

from batchlm.bench.prefix_texts import FOLLOW_UPS, QUESTIONS, SYSTEM_INTRO, SYSTEM_RULES
from batchlm.bench.workload import WorkloadRequest, WorkloadSpec, build_requests, chat_prompts
from batchlm.model.chat_template import ChatTemplate
from batchlm.model.tokenizer import Tokenizer

OPENER_KINDS = ("question", "explanation", "list", "long_answer")  # chat_prompts.jsonl's short prompts
WORKLOADS = ("chat", "system", "control")
THINK_CAP = 4  # a think time is at most this many times the mean (a truncated exponential)


@dataclass(frozen=True)
class PrefixWorkloadSpec:
    seed: int = 0
    conversations: int = 8          # chat: conversations, one turn each in flight at a time
    turns_min: int = 5              # chat: user turns per conversation, uniform in [min, max]
    turns_max: int = 10
    stagger_ms: int = 500           # chat: a conversation starts this long after the one before it
    think_ms: int = 1000            # chat: mean think time between an answer and the next turn
    system_requests: int = 16       # system: requests, each the system prompt and one question
    system_prompt_tokens: int = 500  # system: the shared system prompt's length, at least
    control_requests: int = 16      # control: distinct prompts
    control_prompt_tokens_min: int = 128  # control: prompt length, uniform in [min, max] tokens
    control_prompt_tokens_max: int = 384
    max_tokens: int = 32            # every answer's length (EOS ignored)

    def __post_init__(self) -> None:
        for name in ("conversations", "turns_min", "system_requests", "control_requests",
                     "control_prompt_tokens_min", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrefixWorkloadSpec.{name} must be >= 1")
        if self.turns_max < self.turns_min:
            raise ValueError("PrefixWorkloadSpec.turns_max must be >= turns_min")
        if self.turns_max > len(FOLLOW_UPS) + 1:
            raise ValueError(f"PrefixWorkloadSpec.turns_max must be <= {len(FOLLOW_UPS) + 1}: the opening "
                             f"question and {len(FOLLOW_UPS)} distinct follow-ups")
        if self.control_prompt_tokens_max < self.control_prompt_tokens_min:
            raise ValueError("PrefixWorkloadSpec.control_prompt_tokens_max must be >= control_prompt_tokens_min")
        for name in ("system_prompt_tokens", "stagger_ms", "think_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"PrefixWorkloadSpec.{name} must be >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Conversation:
    index: int
    turns: tuple[str, ...]        # the user's messages, in order
    start_s: float = 0.0          # when its first turn is sent, seconds from the workload's start
    think_s: tuple[float, ...] = ()  # think_s[k]: seconds from the answer to turn k+1 to sending turn k+2

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """The chat messages of turn `turn` (0-based): every user message up to it, each earlier one
        followed by the model's answer to it (`answers`, at least `turn` of them)."""
        if not 0 <= turn < len(self.turns) or len(answers) < turn:
            raise ValueError(f"turn {turn} of {len(self.turns)} needs {turn} answers, got {len(answers)}")
        messages = []
        for i in range(turn):
            messages += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answers[i]}]
        return messages + [{"role": "user", "content": self.turns[turn]}]


def conversations(spec: PrefixWorkloadSpec) -> list[Conversation]:
    """The chat workload's scripts: a distinct opener each (while the prompt set lasts), then follow-ups;
    staggered starts and seeded think times between the turns."""
    rng = random.Random(spec.seed)
    # NOTE: a stream of its own, so the think times leave the texts as the seed alone makes them
    think_rng = random.Random(f"{spec.seed}:think")
    openers = [p["prompt"] for p in chat_prompts() if p["kind"] in OPENER_KINDS]
    rng.shuffle(openers)
    scripts = []
    for i in range(spec.conversations):
        turns = rng.randint(spec.turns_min, spec.turns_max)
        think = tuple(think_time(think_rng, spec.think_ms) for _ in range(turns - 1))
        scripts.append(Conversation(i, (openers[i % len(openers)], *rng.sample(FOLLOW_UPS, turns - 1)),
                                    i * spec.stagger_ms / 1000, think))
    return scripts


def think_time(rng: random.Random, mean_ms: int) -> float:
    """One user's pause in seconds: exponential with mean `mean_ms`, at most THINK_CAP times it, to the ms."""
    if mean_ms == 0:
        return 0.0
    return round(min(rng.expovariate(1 / mean_ms), THINK_CAP * mean_ms)) / 1000


def system_prompt(spec: PrefixWorkloadSpec, tokenizer: Tokenizer) -> str:
    """The intro, then the rules in a seeded order until the text has `system_prompt_tokens` tokens;
    ValueError when all of them are fewer."""
    rules = list(SYSTEM_RULES)
    random.Random(spec.seed).shuffle(rules)
    text = SYSTEM_INTRO
    for rule in rules:
        if len(tokenizer.encode(text)) >= spec.system_prompt_tokens:
            return text
        text += " " + rule
    if len(tokenizer.encode(text)) < spec.system_prompt_tokens:
        raise ValueError(f"PrefixWorkloadSpec.system_prompt_tokens: the system prompt has "
                         f"{len(tokenizer.encode(text))} tokens at most, {spec.system_prompt_tokens} asked")
    return text


def system_requests(spec: PrefixWorkloadSpec, tokenizer: Tokenizer, template: ChatTemplate) -> list[WorkloadRequest]:
    """The system workload's requests: the system prompt and one question each, through `template`."""
    system = system_prompt(spec, tokenizer)
    rng = random.Random(spec.seed)
    order: list[str] = []
    while len(order) < spec.system_requests:
        round_ = list(QUESTIONS)
        rng.shuffle(round_)
        order += round_
    requests = []
    for i, question in enumerate(order[:spec.system_requests]):
        text = template.render([{"role": "system", "content": system}, {"role": "user", "content": question}])
        requests.append(WorkloadRequest(i, text, len(tokenizer.encode(text)), spec.max_tokens))
    return requests


def control_requests(spec: PrefixWorkloadSpec, model: Path | str) -> list[WorkloadRequest]:
    """The control workload's requests: generated text of the spec's lengths, no template."""
    n = spec.max_tokens
    return build_requests(WorkloadSpec(seed=spec.seed, num_requests=spec.control_requests,
                                       prompt_tokens_min=spec.control_prompt_tokens_min,
                                       prompt_tokens_max=spec.control_prompt_tokens_max,
                                       output_mean=float(n), output_cap=n, output_min=n), model)
