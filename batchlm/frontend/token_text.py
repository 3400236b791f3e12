"""The exact bytes of single token ids, and the text OpenAI's log-probabilities show for them.

    texts = TokenTexts(tokenizer)
    texts.bytes_of(i)   # b"\\xe6\\x97" for a byte-level BPE token that holds part of a character
    texts.text_of(i)    # those bytes decoded, an unfinished character as U+FFFD (what vLLM shows)
    texts.is_special(i) # the answer's text leaves it out, as the engine's decode does

A token's bytes come from its vocabulary piece, as the tokenizer's decoder reads it: a byte-level BPE
piece maps each character to one byte (GPT-2's byte alphabet); a SentencePiece piece is `<0xNN>` (byte
fallback) or its text with `▁` as a space. Decoding the id alone cannot give them: a decoder turns
the bytes of an unfinished character into U+FFFD. A tokenizer whose decoder is neither gets the text
of the id decoded alone. Special and added tokens are their content.
"""

from __future__ import annotations

import json
import re

from batchlm.model.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPACE_MARK = "\u2581"  # SentencePiece's "▁"


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves;
    each other byte, in order, for the next code point from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The types of a tokenizer.json decoder and of the decoders of a `Sequence`."""
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for part in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(part)
    return kinds


class TokenTexts:
    """The bytes and shown text of one tokenizer's single ids, each worked out once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._hf = tokenizer.hf
        kinds = _decoder_kinds(json.loads(tokenizer.hf.to_str()).get("decoder"))
        self._byte_level = "ByteLevel" in kinds
        self._sentencepiece = bool(kinds & {"Metaspace", "ByteFallback", "Replace"})
        added = tokenizer.hf.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special = frozenset(i for i, t in added.items() if t.special)
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The token's UTF-8 bytes: a piece of a character where the token holds one."""
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._read_bytes(token_id)
        return found

    def text_of(self, token_id: int) -> str:
        """The token as OpenAI's `token` shows it: its bytes decoded, those of an unfinished character
        as U+FFFD; a special token's content (`<|im_end|>`)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """Whether the answer's text leaves the token out (as the engine's decode skips it)."""
        return token_id in self._special

    def _read_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._hf.id_to_token(token_id)
        if piece is None:  # NOTE: a model's vocabulary may be padded past the tokenizer's; such an id has no text
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._sentencepiece:
            match = _BYTE_PIECE.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(_SPACE_MARK, " ").encode()
        return self._hf.decode([token_id], skip_special_tokens=False).encode()
