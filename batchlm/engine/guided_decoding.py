"""Guided decoding: a request's output held to any JSON, a JSON schema, a regular expression or a grammar,
by a mask over the vocabulary applied inside the engine's step (llguidance), so guided and free requests
share a batch.

llguidance, not xgrammar: both compute a step's mask in microseconds, but llguidance compiles a JSON
schema several times faster (no compiled-grammar cache needed per request), keeps special tokens out of
the text it allows, and is one wheel with no dependencies, where xgrammar pulls in the GPU compiler
`triton` (`batchlm-bench guided` measures both; docs/benchmarking.md quotes it). A guide is compiled and
checked where the request is validated (any thread); a copy of its matcher lives on the sequence and is
advanced by the model runner on the engine's thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from batchlm.errors import InvalidArgument

# the guide types a request may name (`guided_decoding_guide_type`), as TensorRT-LLM's backend names
# them, and llguidance's name of each
GUIDE_TYPES = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex",
               "ebnf_grammar": "grammar", "lark": "lark"}
MAX_GUIDE_CHARS = 64 * 1024
_ANY_JSON = '{"type": "object"}'


def check_guide(guide_type: object, guide: object) -> None:
    """Raise InvalidArgument naming the field for a guide that is not acceptable before compiling it."""
    if guide_type is None:
        if guide is not None:
            raise InvalidArgument("guided_decoding_guide", "needs guided_decoding_guide_type")
        return
    if guide_type not in GUIDE_TYPES:
        raise InvalidArgument("guided_decoding_guide_type", f"must be one of {sorted(GUIDE_TYPES)}, got {guide_type!r}")
    if guide is None:
        if guide_type != "json":
            raise InvalidArgument("guided_decoding_guide", f"is required with guide type {guide_type!r}")
        return
    if not isinstance(guide, str) or not guide:
        raise InvalidArgument("guided_decoding_guide", "must be a non-empty string")
    if len(guide) > MAX_GUIDE_CHARS:
        raise InvalidArgument("guided_decoding_guide", f"at most {MAX_GUIDE_CHARS} characters, got {len(guide)}")


class GuideCompiler:
    """Compiles guides for one tokenizer; thread-safe. The llguidance tokenizer (~0.6 s for a 49k vocabulary)
    is built once, by the first guided request.

    Building a matcher parses its grammar, which takes long for a large one, so `check` (where a request
    is validated, off the engine thread) builds it and keeps it, and `matcher` (on the engine thread, as
    the request is added) copies the kept one; the last CACHED guides are kept."""

    CACHED = 64

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str | None], object] = OrderedDict()  # guide -> fresh matcher

    def check(self, guide_type: str, guide: str | None) -> None:
        """Compile a guide (and keep it for `matcher`); InvalidArgument naming `guided_decoding_guide` if it
        does not compile."""
        self._compiled_matcher(guide_type, guide)

    def matcher(self, guide_type: str, guide: str | None) -> GuideMatcher:
        """A matcher at the start of the guide, for one request."""
        return GuideMatcher(self._compiled_matcher(guide_type, guide).deep_copy(), self._vocab_size)

    def _compiled_matcher(self, guide_type: str, guide: str | None):
        key = (guide_type, guide)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        import llguidance

        try:
            grammar = llguidance.grammar_from(GUIDE_TYPES[guide_type], _ANY_JSON if guide is None else guide)
        except ValueError as exc:
            raise InvalidArgument("guided_decoding_guide", f"does not compile: {exc}") from None
        tokenizer = self._llg_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidArgument("guided_decoding_guide", f"does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer


class GuideMatcher:
    """One request's place in its guide: which tokens may come next, and the tokens it has taken."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's: ids past it are never allowed

    def bitmask(self) -> bytes:
        """One bit per token id, least significant first: whether the guide allows it next."""
        return self._matcher.compute_bitmask()

    def take(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)

    def is_done(self) -> bool:
        """The guide is complete (EOS taken, or nothing may follow) or failed: the output ends here."""
        return self._matcher.is_stopped() or self._matcher.is_error()


def apply_guides(logits: torch.Tensor, shaped: torch.Tensor, matchers: list[GuideMatcher | None]) -> torch.Tensor:
    """`shaped` (S, V) with every guided row's disallowed tokens at -inf (one mask for all guided rows).
    Where shaping left a guided row nothing the guide allows (min_tokens holding back the EOS that alone
    may come), the guide wins over the shaping: that row is the raw `logits` row, masked."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return shaped
    num_logits = shaped.shape[1]
    packed = np.frombuffer(b"".join(matchers[i].bitmask() for i in rows), np.uint8).reshape(len(rows), -1)
    bits = np.unpackbits(packed, axis=1, bitorder="little")                          # (G, >= vocab)
    allowed = np.zeros((len(rows), num_logits), dtype=bool)
    n = min(num_logits, matchers[rows[0]].vocab_size)
    allowed[:, :n] = bits[:, :n]
    allowed_t = torch.from_numpy(allowed).to(shaped.device)                           # (G, V)
    was_shaped = shaped is not logits
    out = shaped if was_shaped else shaped.clone()
    masked = out[rows].masked_fill(~allowed_t, float("-inf"))                         # (G, V)
    if was_shaped:
        for g in torch.isinf(masked).all(dim=1).nonzero()[:, 0].tolist():
            masked[g] = logits[rows[g]].masked_fill(~allowed_t[g], float("-inf"))
    out[rows] = masked
    return out
