"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the ids a model's engine makes of a prompt
(BOS included where the checkpoint asks for it, as the engine adds it), and the text of ids.

    {"model": M, "prompt": "Hi"}                          -> {"count": 2, "max_model_len": 1024, "tokens": [1, 9]}
    {"model": M, "messages": [...]}                       -> the same for the chat template's prompt
    {"model": M, "tokens": [1, 9]}  (to /detokenize)      -> {"prompt": "Hi"}

The tokenizer is the checkpoint's that the model's config names, read where this process can read it
(as the chat template is); a model served from a checkpoint the frontend cannot read is a 400 naming
`model`.
"""

from __future__ import annotations

from pathlib import Path

from batchlm.frontend.errors import invalid
from batchlm.model.tokenizer import Tokenizer


def load_tokenizer(model: str, model_dir: Path | None, purpose: str = "tokenize for it") -> Tokenizer:
    """The tokenizer of the checkpoint at `model_dir`; ApiError 400 naming `model` where there is none
    this process can read (its message says what the frontend cannot do then: `purpose`)."""
    if model_dir is None:
        raise invalid("model", f"{model}'s checkpoint cannot be read where the frontend runs, so it cannot "
                               f"{purpose}")
    return Tokenizer.from_dir(model_dir)


def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    ids = tokenizer.encode(text)
    return ids if add_special_tokens or not tokenizer.add_bos else ids[1:]


def detokenize(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens`; ApiError 400 naming `tokens` for an id outside the vocabulary."""
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise invalid("tokens", f"ids must be in [0, {tokenizer.vocab_size}), got {bad[:8]}")
    return tokenizer.decode(tokens)
