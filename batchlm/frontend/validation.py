"""A request body that pydantic refused -> one 400 in OpenAI's shape, naming the parameter."""

from __future__ import annotations

from collections.abc import Sequence

from batchlm.frontend.errors import ApiError, invalid

# Parts of a pydantic error location that name a member of a union, not a parameter.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def param_of(loc: Sequence) -> str | None:
    """`messages.0.content` for the location ("body", "messages", 0, "content", "str")."""
    parts: list[str] = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            parts.append(part)
        else:
            break
    return ".".join(parts) or None


def validation_error(problems: Sequence[dict]) -> ApiError:
    """The 400 for pydantic's errors: the first parameter named, with every reason given for it (a
    union such as `stop`, a string or a list of them, has one per member)."""
    if not problems:
        return invalid(None, "the request body is not valid")
    first = problems[0]
    if first.get("type") == "json_invalid":
        return invalid(None, f"the request body is not valid JSON: {first.get('msg')}")
    param = param_of(first.get("loc", ()))
    reasons: list[str] = []
    for problem in problems:
        if param_of(problem.get("loc", ())) == param:
            reason = _reason(problem)
            if reason not in reasons:
                reasons.append(reason)
    if param is None:
        return invalid(None, f"the request body must be a JSON object: {'; or '.join(reasons)}")
    return invalid(param, "; or ".join(reasons))


def _reason(problem: dict) -> str:
    kind = problem.get("type")
    if kind == "extra_forbidden":
        return "unknown parameter"
    if kind == "missing":
        return "is required"
    return str(problem.get("msg", "is not valid"))
