"""Log-probabilities of chosen tokens, and the most likely alternatives, from a step's logits.

They are the model's own distribution: the raw logits' log-softmax, before temperature, top-k and top-p
(vLLM's default, `raw_logprobs`), so a token's log-probability does not depend on how it was sampled.
Each row is reduced on its own, so a row's values do not depend on the other rows of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchlm.response_schema import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """logits (R, V), one row per token; row r: log p(token_ids[r]) and its num_top[r] most likely ids."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)                                   # (R, V)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()                               # (R,)
    k = max(num_top)
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
    values, indices = logp.topk(k, dim=-1)                                             # (R, k) each
    values, indices = values.tolist(), indices.tolist()
    return [TokenLogprob(t, lp, tuple(zip(indices[r][:n], values[r][:n])))
            for r, (t, lp, n) in enumerate(zip(token_ids, chosen, num_top))]
