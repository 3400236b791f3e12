"""SamplingParams (one request's decoding knobs, validated) and Sampler (one token per logits row)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from batchlm.engine.guided_decoding import check_guide
from batchlm.errors import InvalidArgument
from batchlm.request_schema import INPUTS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS

MAX_SEED = INPUTS["seed"].data_type.bounds[1]  # the seed input's type, uint64


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding knobs; each means what its input of the same name does
    (batchlm.request_schema.INPUTS, which gives the defaults a request leaves out)."""

    max_tokens: int = 16  # offline use's default; a request always carries its own
    temperature: float = INPUTS["temperature"].default
    top_k: int = INPUTS["top_k"].default
    top_p: float = INPUTS["top_p"].default
    seed: int | None = INPUTS["seed"].default
    stop: tuple[str, ...] = INPUTS["stop"].default
    ignore_eos: bool = INPUTS["ignore_eos"].default
    min_tokens: int = INPUTS["min_tokens"].default
    presence_penalty: float = INPUTS["presence_penalty"].default
    frequency_penalty: float = INPUTS["frequency_penalty"].default
    repetition_penalty: float = INPUTS["repetition_penalty"].default
    logit_bias: tuple[tuple[int, float], ...] = INPUTS["logit_bias"].default  # (token id, bias) pairs
    guided_decoding_guide_type: str | None = INPUTS["guided_decoding_guide_type"].default
    guided_decoding_guide: str | None = INPUTS["guided_decoding_guide"].default
    logprobs: int | None = INPUTS["logprobs"].default
    prompt_logprobs: int | None = INPUTS["prompt_logprobs"].default

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgument("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, 0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
            if self.seed > MAX_SEED:
                raise InvalidArgument("seed", f"must fit in uint64, got {self.seed}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)):
            raise InvalidArgument("stop", f"must be a list of strings, got {self.stop!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgument("stop", "every stop string must be a non-empty string")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidArgument("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, got "
                                          f"{max(len(s) for s in self.stop)}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgument("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidArgument(name, f"must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidArgument("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        check_guide(self.guided_decoding_guide_type, self.guided_decoding_guide)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise InvalidArgument(name, f"must be <= {MAX_LOGPROBS}, got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits before sampling (logit_bias, min_tokens or a penalty)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs from pairs or a mapping; the ids' range is the engine's vocabulary to check."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise InvalidArgument("logit_bias", f"must map token ids to biases, got {value!r}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
    for token, bias in pairs:
        _check_int("logit_bias", token, 0)
        _check_number("logit_bias", bias)
        if not -100.0 <= bias <= 100.0:
            raise InvalidArgument("logit_bias", f"a bias must be in [-100, 100], got {bias}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise InvalidArgument("logit_bias", "a token id appears twice")
    return tuple((token, float(bias)) for token, bias in pairs)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgument(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(name, f"must be a finite number, got {value!r}")


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator | None:
    """The per-request RNG for a seeded request; None means "use torch's global RNG"."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Picks one token per logits row, each row with its own params and RNG.

    Rows are independent: a seeded row draws exactly one uniform number per step from its own
    generator, so the same seed gives the same tokens whatever else shares the batch.
    """

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """logits (S, vocab) float -> S token ids."""
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy) == len(params):
            return _greedy(logits).tolist()
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # (S,)
        if greedy:
            tokens[greedy] = _greedy(logits[greedy])
        if sampled:
            tokens[sampled] = self._sample_rows(
                logits[sampled].float(), [params[i] for i in sampled], [generators[i] for i in sampled])
        return tokens.tolist()

    def _sample_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> torch.Tensor:
        """Inverse-CDF sampling over the (optionally top-k / top-p filtered) distribution."""
        n, vocab = logits.shape
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        # NOTE: the row's largest logit first, and a temperature no smaller than the dtype's smallest
        # normal: then every scaled logit is <= 0 and the largest is 0, so a tiny temperature (1e-38, or
        # 1e-46, which is 0 in float32) gives its greedy token instead of inf / inf = NaN and the last id.
        temps = temps.clamp(min=torch.finfo(logits.dtype).tiny)
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temps[:, None]  # (n, V)
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        if filtered:
            logits, order = logits.sort(dim=-1, descending=True)         # (n, V) each
            logits = _mask_top_k(logits, [p.top_k for p in params])
        probs = torch.softmax(logits, dim=-1)                            # (n, V)
        if filtered and any(p.top_p < 1.0 for p in params):
            probs = _mask_top_p(probs, [p.top_p for p in params])
        cdf = probs.cumsum(dim=-1)                                       # (n, V)
        u = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])  # (n,)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # (n, 1)
        pick = pick.clamp_(max=vocab - 1)
        if filtered:
            pick = order.gather(1, pick)
        return pick[:, 0]


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """(S, vocab) -> (S,) index of each row's largest logit, the first one on ties (as argmax).

    NOTE: max(dim).indices, not argmax: the same indices, and torch's CPU max reduction is the cheaper
    of the two on a (rows, vocab) tensor.
    """
    return logits.max(dim=-1).indices


def _mask_top_k(sorted_logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Set every rank >= k to -inf in rows sorted descending; k = 0 keeps the row whole."""
    n, vocab = sorted_logits.shape
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=sorted_logits.device)
    ranks = torch.arange(vocab, device=sorted_logits.device)
    return sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))


def _mask_top_p(sorted_probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Zero the tail once the mass before a token already reaches top_p (the first token stays)."""
    p = torch.tensor(top_p, device=sorted_probs.device, dtype=sorted_probs.dtype)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                     # (n, V)
    drop = (mass_before >= p[:, None]) & (p[:, None] < 1.0)
    return sorted_probs.masked_fill(drop, 0.0)
