"""What a machine's step costs allow: the strategies' throughput ratios predicted from the cost of a
decode step at n sequences, the cost of a prompt token and the workload's lengths.

Every strategy generates the same tokens; what differs is how many forward passes it takes and how
wide they are. Per request (means over the workload, `Lengths`; the drain at a run's end left out):
- its prompt costs `prompt_token_ms` a token, the same in any batch (a prefill is arithmetic-bound), and
  gives its first output token;
- request-level batching (batches of 8, finished rows kept as padding) runs E[longest of 8] - 1 decode
  steps of 8 rows per batch, so a request's share is (E[longest of 8] - 1) * D(8) / 8;
- continuous batching at n sequences a step: (E[output] - 1) * D(n) / n.
With free prompts and D(n) / n flat, continuous/request-level is (E[longest of 8] - 1) / (E[output] - 1),
about the step-count bound E[longest of 8] / E[output] that the benchmark prints. A prompt that rides in a continuous step with
decode rows saves those rows most of their step; the model leaves that out, which understates
continuous batching by a few percent.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from client.workload import WorkloadRequest, WorkloadSpec

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
    a sample of its requests."""

    prompt: float        # mean prompt length, BOS included where the tokenizer adds it
    output: float        # mean output length
    output_square: float  # mean squared output length
    longest_of_batch: float  # mean longest output of a request-level batch (REQUEST_LEVEL_BATCH in arrival order)

    @classmethod
    def of_spec(cls, spec: WorkloadSpec, bos: bool) -> Lengths:
        return cls(prompt=(spec.prompt_tokens_min + spec.prompt_tokens_max) / 2 + (1 if bos else 0),
                   output=spec.expected_output_length(), output_square=spec.expected_output_square(),
                   longest_of_batch=spec.expected_max_output_length(REQUEST_LEVEL_BATCH))

    @classmethod
    def of_requests(cls, requests: Sequence[WorkloadRequest], bos: bool) -> Lengths:
        outputs = [r.max_tokens for r in requests]
        batches = [outputs[i:i + REQUEST_LEVEL_BATCH] for i in range(0, len(outputs), REQUEST_LEVEL_BATCH)]
        return cls(prompt=statistics.mean(r.prompt_tokens for r in requests) + (1 if bos else 0),
                   output=statistics.mean(outputs), output_square=statistics.mean(n * n for n in outputs),
                   longest_of_batch=statistics.mean(max(b) for b in batches))

    @property
    def step_count_bound(self) -> float:
        return self.longest_of_batch / self.output

    @property
    def request_level_context(self) -> int:
        """Mean KV length of a request-level decode step: every row runs until the batch's longest is done."""
        return round(self.prompt + self.longest_of_batch / 2)

    @property
    def continuous_context(self) -> int:
        """Mean KV length of a continuous decode step: over the steps a request runs in (the longer ones
        run in more), it holds E[O^2] / (2 E[O]) output tokens on average."""
        return round(self.prompt + self.output_square / (2 * self.output))


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
    prompts alone cost more than that)."""
    budget = request_ms(lengths, costs) / target - lengths.prompt * costs.prompt_token_ms
    return budget / (lengths.output - 1)
