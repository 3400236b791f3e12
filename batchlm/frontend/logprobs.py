"""A choice's text and `logprobs`, shaped from the model's Chunks as OpenAI's two APIs show them.

    shaper = ChoiceShaper(schema, chat=False, texts=TokenTexts(tokenizer))
    piece = shaper.piece(chunk)        # each Chunk in turn; a whole answer is one Chunk
    piece.text, piece.logprobs         # a stream chunk's text and `logprobs`, or the whole body's

Completions (OpenAI's legacy shape), N = `logprobs`:

    {"tokens": ["Hello", " world"], "token_logprobs": [-1.2, -0.4],
     "top_logprobs": [{"Hello": -1.2, "Hi": -1.5}, ...], "text_offset": [0, 5]}

`top_logprobs` holds the N most likely tokens, most likely first, and the chosen one where it is not
among them (N + 1 at most, as OpenAI's API and vLLM; N = 0: the chosen one alone). With `echo`, the
prompt's tokens come first: its first token has `token_logprobs` and `top_logprobs` null (nothing
comes before it). `text_offset` is each token's character offset into the choice's text, across a
stream's chunks; with `echo` the generated tokens start at the prompt's length.

Chat, N = `top_logprobs` (0 where only `logprobs: true`):

    {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, ...]}],
     "refusal": null}

A token's text and bytes are token_text.py's: a token that holds part of a character shows U+FFFD and
its exact bytes. Log-probabilities below -9999 (and -inf, which JSON cannot carry) show as -9999, as
OpenAI's API shows them.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from batchlm.frontend.schema_request import SchemaRequest
from batchlm.frontend.token_text import TokenTexts
from batchlm.response_schema import Chunk, MalformedResponse, TokenLogprob

LOWEST_LOGPROB = -9999.0

# (token id, its TokenLogprob; None for the prompt's first token, which has none)
Entry = tuple[int, TokenLogprob | None]


@dataclass(frozen=True)
class Piece:
    """One Chunk's share of the choice: its text and the `logprobs` of its tokens (None where none were
    asked for)."""

    text: str
    logprobs: dict | None = None
    tokens: int = 0   # the tokens `logprobs` holds

    def __bool__(self) -> bool:
        """Whether a stream has anything to send for it."""
        return bool(self.text) or self.tokens > 0


class ChoiceShaper:
    """Shapes one request's Chunks, in order, into its choice's pieces: `echo`'s prompt first,
    `keep_output=False`'s generated token left out, and text offsets that run on across pieces."""

    def __init__(self, schema: SchemaRequest, chat: bool, texts: TokenTexts | None,
                 echo_text: str | None = None) -> None:
        """`echo_text`: what `echo` puts first, the prompt as sent or the text of its token ids (default:
        the first choice's text prompt)."""
        if schema.logprobs is not None and texts is None:
            raise ValueError("log-probabilities need the model's TokenTexts")
        self._alternatives = schema.logprobs
        if schema.echo and echo_text is None:
            echo_text = str(schema.fields["text_input"])
        self._prompt = echo_text if schema.echo else None
        self._keep_output = schema.keep_output
        self._chat = chat
        self._texts = texts
        self._started = False
        self._offsets = _Offsets(texts) if texts is not None else None

    def piece(self, chunk: Chunk) -> Piece:
        """The next piece of the choice, from the next Chunk.

        Raises:
            MalformedResponse: log-probabilities were asked for, and the model sent tokens without them.
        """
        text = chunk.text if self._keep_output else ""
        entries = self._generated(chunk) if self._keep_output else []
        prompt: list[Entry] = []
        if not self._started:
            self._started = True
            if self._prompt is not None:
                text = self._prompt + text
                prompt = self._prompt_entries(chunk)
        if self._alternatives is None:
            return Piece(text)
        if self._chat:
            return Piece(text, {"content": [self._chat_entry(e) for e in entries], "refusal": None}, len(entries))
        offsets = self._offsets.of(prompt)
        if prompt:
            self._offsets.restart(len(self._prompt))  # NOTE: the prompt as sent, whatever its tokens decode to
        offsets += self._offsets.of(entries)
        return Piece(text, self._completion(prompt + entries, offsets), len(prompt) + len(entries))

    def _generated(self, chunk: Chunk) -> list[Entry]:
        if self._alternatives is None:
            return []
        if chunk.logprobs is None:
            if chunk.token_ids or (chunk.token_ids is None and chunk.text):
                raise MalformedResponse("the model sent tokens without their log-probabilities (output_log_probs)")
            return []
        return [(t.token_id, t) for t in chunk.logprobs]

    def _prompt_entries(self, chunk: Chunk) -> list[Entry]:
        if self._alternatives is None:
            return []
        if not chunk.prompt_ids or chunk.prompt_logprobs is None:
            raise MalformedResponse("the model's first response has no prompt log-probabilities (prompt_log_probs)")
        return [(chunk.prompt_ids[0], None), *((t.token_id, t) for t in chunk.prompt_logprobs)]

    def _completion(self, entries: list[Entry], offsets: list[int]) -> dict:
        text_of = self._texts.text_of
        return {"tokens": [text_of(i) for i, _ in entries],
                "token_logprobs": [None if t is None else _shown(t.logprob) for _, t in entries],
                "top_logprobs": [None if t is None else self._top_by_text(t) for _, t in entries],
                "text_offset": offsets}

    def _top_by_text(self, token: TokenLogprob) -> dict[str, float]:
        # NOTE: keyed by text, as OpenAI's legacy shape is: of two ids with one text, the likelier shows
        top: dict[str, float] = {}
        for token_id, logprob in token.top:
            top.setdefault(self._texts.text_of(token_id), _shown(logprob))
        top.setdefault(self._texts.text_of(token.token_id), _shown(token.logprob))
        return top

    def _chat_entry(self, entry: Entry) -> dict:
        token_id, token = entry
        return {**self._chat_token(token_id, token.logprob),
                "top_logprobs": [self._chat_token(i, logprob) for i, logprob in token.top]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        return {"token": self._texts.text_of(token_id), "logprob": _shown(logprob),
                "bytes": list(self._texts.bytes_of(token_id))}


def _shown(logprob: float) -> float:
    return max(float(logprob), LOWEST_LOGPROB)


class _Offsets:
    """Character offsets of tokens into the text they make, token after token: each starts where the
    characters finished before it end (a token that starts a character and the one that finishes it
    share an offset); a special token adds no character, as the models' text leaves it out."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self.restart(0)

    def restart(self, at: int) -> None:
        self._at = at
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def of(self, entries: list[Entry]) -> list[int]:
        offsets = []
        for token_id, _ in entries:
            offsets.append(self._at)
            if not self._texts.is_special(token_id):
                self._at += len(self._decoder.decode(self._texts.bytes_of(token_id)))
        return offsets
