"""Errors that carry the name of the field that was wrong.

`InvalidArgument` is bad input: a request field (prompt, max_tokens, ...) or a configuration key.
The serving layer maps it to Triton's INVALID_ARG (HTTP 400); anything else is an internal error.
"""


class InvalidArgument(ValueError):
    """A value the caller supplied is not acceptable; `field` names it.

    `str(err)` reads "<field>: <message>" so a client can see which input to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Unavailable(RuntimeError):
    """The model cannot take the request now (queue full, unloading); the client may retry.
    The serving layer maps it to Triton's UNAVAILABLE."""
