"""What a machine's step costs allow: the strategies' throughput ratios predicted from the cost of a
decode step at n sequences, the cost of a prompt token and the workload's lengths.

Every strategy generates the same tokens; what differs is how many forward passes it takes and how
wide they are. Per request (means over the workload, `Lengths`; the drain at a run's end left out):
- its prompt costs `prompt_token_ms` a token in every strategy (a prefill is arithmetic-bound, so a
  prompt token costs about the same in any batch), and gives its first output token;
- request-level batching (batches of 8, finished rows kept as padding) runs E[longest of 8] - 1 decode
  steps of 8 rows per batch, so a request's share is (E[longest of 8] - 1) * D(8) / 8;
- continuous batching at n sequences a step: (E[output] - 1) * D(n) / n.
With free prompts, D(n) / n flat and request-level steps that cost D(8) too (their context differs),
continuous/request-level is (E[longest of 8] - 1) / (E[output] - 1), about the step-count bound
E[longest of 8] / E[output] that the benchmark prints. Left out, and each in continuous batching's
favour: a prompt that rides in a continuous step with decode rows spares those rows most of a step, and
a cost per step outside the forward pass (the same in both) weighs more on request-level batching's
(E[longest of 8] - 1) / (E[output] - 1) times as many steps per token (2.63 for the default spec). Also
left out: a prefill of more prompt tokens than the engine's step budget takes an extra step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchlm.bench.workload import WorkloadRequest, WorkloadSpec

REQUEST_LEVEL_BATCH = 8


@dataclass(frozen=True)
class StepCosts:
    """Measured on one machine, in milliseconds."""

    prompt_token_ms: float              # a prompt token, in a prefill of REQUEST_LEVEL_BATCH prompts
    request_level_step_ms: float        # a decode step of REQUEST_LEVEL_BATCH rows at request-level's context
    decode_step_ms: Mapping[int, float]  # a decode step of n rows at continuous batching's context, by n


@dataclass(frozen=True)
class Lengths:
    """A workload's lengths in tokens, as the model needs them: expectations of a spec, or the means of
    a sample of its requests (request-level batches: REQUEST_LEVEL_BATCH requests in arrival order).

    A decode step's context is the KV length a row attends over, averaged over the decode steps a
    strategy runs: the j-th decode step of a request with prompt P and O output tokens attends over
    P + j tokens (j = 1 .. O - 1); a finished row kept as padding re-feeds its last cached token
    (position P + O - 2) and attends over P + O - 1 tokens, until its batch ends."""

    prompt: float            # mean prompt length, BOS included where the tokenizer adds it
    output: float            # mean output length
    longest_of_batch: float  # mean longest output of a request-level batch
    request_level_context: float  # mean KV length of a row in a request-level decode step, padding included
    continuous_context: float     # mean KV length of a row in a continuous decode step

    @classmethod
    def of_spec(cls, spec: WorkloadSpec, bos: bool) -> Lengths:
        prompt = (spec.prompt_tokens_min + spec.prompt_tokens_max) / 2 + (1 if bos else 0)
        pmf = [spec.output_cdf(n) - spec.output_cdf(n - 1) for n in range(spec.output_cap + 1)]
        others = REQUEST_LEVEL_BATCH - 1  # the batch's other rows: the pmf of their longest
        pmf_others = [spec.output_cdf(n) ** others - spec.output_cdf(n - 1) ** others
                      for n in range(spec.output_cap + 1)]
        # a row's decode-step context summed over its batch's steps, given its length and the batch's longest
        row_tokens = sum(p * q * _padded_row_tokens(o, max(o, m))
                         for o, p in enumerate(pmf) if p for m, q in enumerate(pmf_others) if q)
        longest = spec.expected_max_output_length(REQUEST_LEVEL_BATCH)
        mean_output = spec.expected_output_length()
        output_pairs = sum(p * o * (o - 1) / 2 for o, p in enumerate(pmf))  # E[sum_{j<O} j]
        decodes = mean_output > 1  # else no request has a decode step, and a step's context is moot
        return cls(prompt=prompt, output=mean_output, longest_of_batch=longest,
                   request_level_context=prompt + row_tokens / (longest - 1) if decodes else prompt,
                   continuous_context=prompt + output_pairs / (mean_output - 1) if decodes else prompt)

    @classmethod
    def of_requests(cls, requests: Sequence[WorkloadRequest], bos: bool) -> Lengths:
        extra = 1 if bos else 0
        batches = [requests[i:i + REQUEST_LEVEL_BATCH] for i in range(0, len(requests), REQUEST_LEVEL_BATCH)]
        rows = steps = 0.0  # request-level: context summed over rows and steps, and row-steps
        for batch in batches:
            longest = max(r.max_tokens for r in batch)
            for r in batch:
                rows += (r.prompt_tokens + extra) * (longest - 1) + _padded_row_tokens(r.max_tokens, longest)
            steps += len(batch) * (longest - 1)
        decode_steps = sum(r.max_tokens - 1 for r in requests)
        live = sum((r.max_tokens - 1) * (r.prompt_tokens + extra) + r.max_tokens * (r.max_tokens - 1) / 2
                   for r in requests)
        prompt = statistics.mean(r.prompt_tokens for r in requests) + extra
        return cls(prompt=prompt, output=statistics.mean(r.max_tokens for r in requests),
                   longest_of_batch=statistics.mean(max(r.max_tokens for r in b) for b in batches),
                   request_level_context=rows / steps if steps else prompt,  # as in of_spec
                   continuous_context=live / decode_steps if decode_steps else prompt)

    @property
    def step_count_bound(self) -> float:
        """E[longest of a request-level batch] / E[output]: continuous over request-level batching when
        prompts are free and a step costs the same at any width."""
        return self.longest_of_batch / self.output


def _padded_row_tokens(length: int, longest: int) -> int:
    """Output tokens a row of `length` attends over, summed over its batch's `longest` - 1 decode steps:
    j at step j while it runs, then `length` - 1 as padding."""
    return (length - 1) * length // 2 + (length - 1) * (longest - length)


def request_ms(lengths: Lengths, costs: StepCosts, seqs: int | None = None, prompts: bool = True) -> float:
    """Milliseconds of forward passes per request: request-level batching with `seqs` None, else continuous
    batching at `seqs` sequences a step. `prompts=False` leaves the prompts' cost out."""
    prompt = lengths.prompt * costs.prompt_token_ms if prompts else 0.0
    if seqs is None:
        return prompt + (lengths.longest_of_batch - 1) * costs.request_level_step_ms / REQUEST_LEVEL_BATCH
    return prompt + (lengths.output - 1) * costs.decode_step_ms[seqs] / seqs


def ratio(lengths: Lengths, costs: StepCosts, seqs: int, prompts: bool = True) -> float:
    """Continuous batching at `seqs` sequences over request-level batching, output tokens/s."""
    return request_ms(lengths, costs, prompts=prompts) / request_ms(lengths, costs, seqs, prompts=prompts)


def decode_token_ms_needed(lengths: Lengths, costs: StepCosts, target: float) -> float:
    """What a continuous decode token, D(n) / n, may cost at most for continuous batching to reach
    `target` times request-level batching's output tokens/s with the prompts as they cost (<= 0: the
    prompts alone cost more than that; inf: no request decodes)."""
    if lengths.output <= 1:
        return math.inf
    budget = request_ms(lengths, costs) / target - lengths.prompt * costs.prompt_token_ms
    return budget / (lengths.output - 1)
