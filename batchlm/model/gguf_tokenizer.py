"""The tokenizer of a llama GGUF file: a byte-level BPE `tokenizers.Tokenizer` rebuilt from its metadata.

The vocabulary, merges and token types come from the `tokenizer.ggml.*` keys; the pre-tokenizer from
`tokenizer.ggml.pre`'s name. Control tokens are matched whole and skipped when decoding. A kind this
package cannot run (SentencePiece's `llama`, an unknown pre-tokenizer) is refused naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchlm.errors import InvalidArgument

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`: the regex a word is split with before BPE, and
# whether digits are first split one by one. None: GPT-2's own regex (inside the ByteLevel step).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False), "gpt2": (None, False), "gpt-2": (None, False),
    "smollm": (None, True),
    "llama3": (_LLAMA3_SPLIT, False), "llama-v3": (_LLAMA3_SPLIT, False), "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)


def build_tokenizer(metadata: Callable[..., Any]):
    """A `tokenizers.Tokenizer` from a GGUF file's metadata: `metadata(key[, default])` returns a key's
    value (GGUFFile.metadata: InvalidArgument naming a required key that is missing)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidArgument("tokenizer.ggml.model",
                              f"{kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    pre = metadata("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise InvalidArgument("tokenizer.ggml.pre",
                              f"{pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")
    tokens = metadata("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in metadata("tokenizer.ggml.merges")]
    split, digits = PRE_TOKENIZERS[pre]
    hf = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                              ignore_merges=split is _LLAMA3_SPLIT))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    types = metadata("tokenizer.ggml.token_type", [])
    # NOTE: control tokens (<|im_start|>, ...) are matched whole in text and skipped when decoding;
    # user-defined ones are matched whole and kept, as llama.cpp treats them
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, kind in enumerate(types) if kind == _CONTROL])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, kind in enumerate(types) if kind == _USER_DEFINED])
    return hf
