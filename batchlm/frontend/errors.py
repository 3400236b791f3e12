"""OpenAI's error JSON, and Triton's errors mapped onto it.

Every error the frontend answers has the body `{"error": {"message", "type", "param", "code"}}`:

| status | when | type | code |
|---|---|---|---|
| 400 | bad input; `param` names the OpenAI parameter (1) | `invalid_request_error` | `invalid_value` |
| 401 | an API key is configured and the request lacks it (auth.py) | `invalid_request_error` | `invalid_api_key` |
| 404 | a model that is not served | `invalid_request_error` | `model_not_found` |
| 429 | the model is overloaded (2) | `rate_limit_error` | `overloaded` |
| 503 | the model is not ready, unloading or unloaded; Triton unreachable | `service_unavailable` | `model_not_ready` |
| 504 | the frontend's `--request-timeout` passed | `server_error` | `timeout` |
| 500 | anything else (a failed engine step) | `server_error` | `internal_error` |

(1) Also for a model's own INVALID_ARG, whose message starts with the schema field.
(2) The message says "is overloaded", or dynamic_batching's "Exceeds maximum queue size".
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

# The message of a model's INVALID_ARG starts with the schema field: "max_tokens: must be >= 1, got 0".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*): ")
_OVERLOAD_MARKS = ("is overloaded", "exceeds maximum queue size")
_NOT_READY_MARKS = ("is unloading", "was unloaded", "was reloaded", "is not ready", "not ready")
_UNKNOWN_MODEL_MARKS = ("unknown model",)


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP `status` and the body `body()` returns."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    """400 for bad input; the message starts with the parameter, as the models' own do."""
    text = f"{param}: {message}" if param else message
    return ApiError(400, text, "invalid_request_error", param, "invalid_value")


def unauthorized(message: str) -> ApiError:
    """401 for a missing, malformed or wrong API key: OpenAI's own type and code for a bad key."""
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def model_not_found(model: str, served: Collection[str]) -> ApiError:
    return ApiError(404, f"model: {model!r} is not served here; served: {', '.join(sorted(served)) or 'none'}",
                    "invalid_request_error", "model", "model_not_found")


def overloaded(message: str) -> ApiError:
    return ApiError(429, message, "rate_limit_error", None, "overloaded")


def not_ready(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "model_not_ready")


def internal(message: str) -> ApiError:
    return ApiError(500, message, "server_error", None, "internal_error")


def from_triton(status: str | None, message: str, inputs: Collection[str],
                params: Mapping[str, str]) -> ApiError:
    """The OpenAI error for an error a Triton model (or Triton) answered.

    `status`: the gRPC status name ("StatusCode.INVALID_ARGUMENT"), or None where the transport carries
    the message alone (a gRPC stream). `inputs`: the model's input names; a message that starts with one
    of them is that field's INVALID_ARG. `params`: schema field -> the OpenAI parameter it came from
    (`text_input` -> `prompt` or `messages`), so the 400 names what the caller sent."""
    lowered = message.lower()
    if any(mark in lowered for mark in _OVERLOAD_MARKS):
        return overloaded(message)
    field = _FIELD_PREFIX.match(message)
    if field and field.group(1) in inputs and status in (None, "StatusCode.INVALID_ARGUMENT"):
        name = field.group(1)
        param = params.get(name, name)
        text = message if param == name else f"{param}: {message[len(name) + 2:]}"
        return ApiError(400, text, "invalid_request_error", param, "invalid_value")
    if any(mark in lowered for mark in _UNKNOWN_MODEL_MARKS) or status == "StatusCode.NOT_FOUND":
        return ApiError(404, message, "invalid_request_error", "model", "model_not_found")
    if status == "StatusCode.UNAVAILABLE" or any(mark in lowered for mark in _NOT_READY_MARKS):
        return not_ready(message)
    if status == "StatusCode.INVALID_ARGUMENT":
        return ApiError(400, message, "invalid_request_error", None, "invalid_value")
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return ApiError(504, message, "server_error", None, "timeout")
    return internal(message)
