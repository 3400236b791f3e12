"""Structured output: a body's `response_format`, or vLLM's `guided_*` extensions, as the schema's guide
(`guided_decoding_guide_type` and `guided_decoding_guide`), which the engine applies as a token mask.

    response_format {"type": "text"}                        -> no guide
    response_format {"type": "json_object"}                 -> `json` (any JSON object)
    response_format {"type": "json_schema",
                     "json_schema": {"name", "schema", ...}} -> `json_schema`, the schema as JSON
    guided_json (a schema, as an object or its JSON text)   -> `json_schema`
    guided_regex                                            -> `regex`
    guided_grammar (GBNF, llama.cpp's grammar format)       -> `ebnf_grammar`
    guided_choice (a list of strings)                       -> `regex`: one of them, exactly

A request holds at most one guide; a second is a 400 naming it. Whether a schema, expression or grammar
compiles is the engine's to say: its INVALID_ARG names `guided_decoding_guide`, which the 400 turns into
the parameter the guide came from. `json_schema.strict` is accepted either way: the output always
follows the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from batchlm.frontend.errors import invalid
from batchlm.frontend.protocol import ResponseFormat

# The characters a regular expression gives a meaning; llguidance's syntax (Rust's regex crate) lets any
# ASCII punctuation be escaped, so escaping these holds a choice to its exact text.
_REGEX_SPECIALS = frozenset("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class Guide:
    """One request's guide: the schema's two fields, and the parameter it came from."""

    type: str
    text: str | None
    param: str


def guide_of(response_format: ResponseFormat | None, guided_json: dict | str | None = None,
             guided_regex: str | None = None, guided_grammar: str | None = None,
             guided_choice: list[str] | None = None) -> Guide | None:
    """The request's guide, or None; ApiError 400 naming the parameter of a second guide or a bad one."""
    found: list[Guide] = []
    if response_format is not None and response_format.type != "text":
        found.append(_response_format(response_format))
    if guided_json is not None:
        found.append(Guide("json_schema", guided_json if isinstance(guided_json, str) else json.dumps(guided_json),
                           "guided_json"))
    if guided_regex is not None:
        found.append(Guide("regex", guided_regex, "guided_regex"))
    if guided_grammar is not None:
        found.append(Guide("ebnf_grammar", guided_grammar, "guided_grammar"))
    if guided_choice is not None:
        found.append(Guide("regex", choice_regex(guided_choice), "guided_choice"))
    if len(found) > 1:
        raise invalid(found[1].param, f"a request holds one guide, and {found[0].param} is one already")
    return found[0] if found else None


def _response_format(response_format: ResponseFormat) -> Guide:
    if response_format.type == "json_object":
        if response_format.json_schema is not None:
            raise invalid("response_format", "json_schema goes with type json_schema, not json_object")
        return Guide("json", None, "response_format")
    if response_format.json_schema is None:
        raise invalid("response_format", "type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}")
    return Guide("json_schema", json.dumps(response_format.json_schema.json_schema), "response_format")


def choice_regex(choices: list[str]) -> str:
    """A regular expression that matches exactly one of `choices`; ApiError naming `guided_choice` for
    an empty list or an empty string."""
    if not choices or not all(choices):
        raise invalid("guided_choice", "must be a list of non-empty strings")
    return "(" + "|".join("".join(f"\\{c}" if c in _REGEX_SPECIALS else c for c in choice)
                          for choice in choices) + ")"
