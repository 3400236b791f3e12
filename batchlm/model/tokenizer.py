"""Tokenizer over a HF `tokenizer.json`, and IncrementalDetokenizer for streaming text token by token."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from batchlm.model.model_config import token_ids

_REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that are not (yet) a whole UTF-8 character
# Text that ends in U+FFFD may still change: the bytes of a character split over tokens decode as U+FFFD
# until its last byte comes. A lossy UTF-8 decode (byte-level BPE) can change only the last U+FFFD; a
# byte-fallback decoder turns every byte of an unfinished group into one, and changes them all. So the
# whole trailing run of U+FFFD is held while it spans fewer than _HOLD_RUN_TOKENS tokens, then all of it
# but its last character (invalid bytes, say from a model with random weights, are not held for long),
# and past _MAX_HELD_TOKENS everything goes out (a bound on the decode work per token).
_HOLD_RUN_TOKENS = 8
_MAX_HELD_TOKENS = 64


class Tokenizer:
    """encode(text) -> ids (BOS first when the checkpoint asks); decode(ids) -> text (specials skipped)."""

    def __init__(self, hf: HFTokenizer, add_bos: bool, bos_token_id: int | None,
                 eos_token_ids: frozenset[int]) -> None:
        self.hf = hf
        self.add_bos = add_bos and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Read tokenizer.json plus the BOS/EOS settings of tokenizer_config.json, config.json and
        generation_config.json (EOS ids are the union of what they name); or all of it from a GGUF file."""
        from batchlm.model.gguf_file import is_gguf, open_gguf

        if is_gguf(model_dir):
            gguf = open_gguf(model_dir)
            return cls(gguf.tokenizer(), gguf.add_bos, gguf.bos_token_id, frozenset(gguf.eos_token_ids))
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        hf = HFTokenizer.from_file(str(path))
        tok_cfg, cfg, gen_cfg = (_read_json(root / n) for n in
                                 ("tokenizer_config.json", "config.json", "generation_config.json"))
        bos = _special_id(hf, tok_cfg.get("bos_token"))
        for source in (gen_cfg, cfg):
            if source.get("bos_token_id") is not None:
                bos = token_ids(source["bos_token_id"], "bos_token_id")[0]
        eos = set(token_ids(cfg.get("eos_token_id"), "eos_token_id"))
        eos |= set(token_ids(gen_cfg.get("eos_token_id"), "eos_token_id"))
        if not eos and _special_id(hf, tok_cfg.get("eos_token")) is not None:
            eos.add(_special_id(hf, tok_cfg.get("eos_token")))
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:  # no explicit setting: do what the tokenizer's post-processor does
            with_specials = hf.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(with_specials) > 0 and with_specials[0] == bos
        return cls(hf, bool(add_bos), bos, frozenset(eos))

    def encode(self, text: str) -> list[int]:
        # NOTE: encode_batch, not encode: it lets go of the GIL while it works, and encode holds it for
        # the whole text (~25 ms for 64 KiB), stalling every other thread of the process, a serving
        # model's stepping thread among them
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of input one token can stand for, or None where that does not bound
        the token count (a normalizer may shrink the text before it is split). With it, a text of B
        bytes has at least B / max_bytes_per_token tokens: enough to refuse a text far too long for a
        model without tokenizing it."""
        if self.hf.normalizer is not None:
            return None
        # NOTE: decoding each token alone overstates a partial UTF-8 sequence (it decodes to U+FFFD,
        # 3 bytes), which only loosens the bound
        texts = self.hf.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, *(len(text.encode()) for text in texts))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turn generated ids into text one token at a time, never splitting a UTF-8 character.

    Keeps two offsets into prompt + output ids: text is decoded from `prefix_offset` (a few tokens of
    context, so tokenizers that drop a leading space decode a word correctly) and what lies past
    `read_offset` is new. A trailing run of U+FFFD in the new text is held back until the next tokens
    complete it (see _HOLD_RUN_TOKENS); the text before it goes out at once, and `_emitted` counts
    the characters of the new text already handed out.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        # NOTE: a few prompt tokens of context, as vLLM does; the prompt's own text is never emitted.
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self._emitted = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) + self._emitted:
            return ""
        new_text = full_text[len(prefix_text):]
        held = len(self.ids) - self.read_offset
        run = len(new_text) - len(new_text.rstrip(_REPLACEMENT))
        if run and held < _MAX_HELD_TOKENS:
            ready = new_text[:len(new_text) - (run if held < _HOLD_RUN_TOKENS else 1)]
            return self._hand_out(ready)
        piece = self._hand_out(new_text)
        self.prefix_offset, self.read_offset, self._emitted = self.read_offset, len(self.ids), 0
        return piece

    def flush(self) -> str:
        """At the end of generation: whatever was held back (possibly an invalid, replaced tail)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        piece = self._hand_out(full_text[len(prefix_text):])
        self.prefix_offset, self.read_offset, self._emitted = len(self.ids), len(self.ids), 0
        return piece

    def _hand_out(self, ready: str) -> str:
        """The part of `ready` (new text known final) not handed out before."""
        piece = ready[self._emitted:]
        self._emitted = max(self._emitted, len(ready))
        self.text += piece
        return piece


def chat_template_of(model_dir: str | Path) -> tuple[str | None, str, str]:
    """(template source or None, BOS token text, EOS token text) of the checkpoint at `model_dir`: a GGUF
    file's `tokenizer.chat_template`; in a Hugging Face folder `chat_template.jinja` (where transformers 5
    saves it) or tokenizer_config.json's `chat_template` (a list of named ones: "default")."""
    from batchlm.model.gguf_file import is_gguf, open_gguf

    if is_gguf(model_dir):
        try:
            gguf = open_gguf(model_dir)
        except ValueError:
            return None, "", ""
        eos = gguf.eos_token_ids[0] if gguf.eos_token_ids else None
        return gguf.chat_template, gguf.special_token(gguf.bos_token_id) or "", gguf.special_token(eos) or ""
    root = Path(model_dir)
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    source = config.get("chat_template")
    if (root / "chat_template.jinja").is_file():
        source = (root / "chat_template.jinja").read_text()
    if isinstance(source, list):
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        source = None
    return source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))


def _token_text(value) -> str:
    if isinstance(value, dict):  # older tokenizer_config.json: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _special_id(hf: HFTokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):  # older tokenizer_config.json: {"content": "<s>", ...}
        token = token.get("content")
    return hf.token_to_id(token) if token else None
